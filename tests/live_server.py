"""A real ``tokenfeed-server serve`` process for tests, with HTTP helpers.

Start-up waits on the server's ``ready`` line (see :mod:`tokenfeed_server.launch`);
every wait has a timeout so a broken server fails the test instead of hanging it.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import zmq

from tokenfeed_server.dataplane.auth import token_digest
from tokenfeed_server.launch import ServerProcess


class LiveServer(ServerProcess):
    """One server process on loopback with OS-assigned (or given) ports."""

    def start(self, timeout: float = 30.0) -> LiveServer:
        super().start(timeout)
        return self

    def __enter__(self) -> LiveServer:
        return self.start()

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(self.http + path, timeout=10.0, **kwargs)

    def run_job(self, dataset: str, token: str | None = None) -> None:
        """Leave a job on this server by reading two batches of ``dataset`` (it stays
        listed for --job-ttl-s after the trainer leaves)."""
        from tokenfeed import TokenFeedDataset  # torch: only for the tests that train

        loader = TokenFeedDataset(
            self.zmq,
            dataset,
            seq_len=64,
            batch_size=2,
            rank=0,
            world_size=1,
            samples=4,
            token=token,
            request_timeout=2.0,
            deadline=15.0,
        )
        assert sum(1 for _ in loader) == 2

    def settled_counter(self, name: str) -> int:
        """A data-plane counter once everything sent to this server before now is counted.

        The status snapshot is refreshed a few times a second: send one known bad message
        and read the counter from the first snapshot that counts it (bounded).
        """
        marks = int(self.get("/v1/status").json()["counters"].get("err_bad_request", 0))
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.zmq)
            sock.send(b"not msgpack")
            assert sock.poll(10_000), "no answer to the marker message"
            sock.recv()
        finally:
            sock.close(linger=0)
        for _ in range(200):  # bounded: 200 reads of the snapshot
            counters = self.get("/v1/status").json()["counters"]
            if int(counters.get("err_bad_request", 0)) > marks:
                return int(counters.get(name, 0))
            time.sleep(0.05)
        raise AssertionError("the status snapshot never counted the marker message")

    def get_at(self, host: str, path: str) -> httpx.Response:
        """GET through another address of this server (for one bound to 0.0.0.0)."""
        return httpx.get(f"http://{host}:{self.http_port}{path}", timeout=10.0)


def tenants_toml(admin: str | None, tenants: dict[str, tuple[str, list[str]]]) -> str:
    """A tenants file: ``{name: (token, dataset patterns)}``, and an admin token if given."""
    out = [f'admin_token_sha256 = "{token_digest(admin)}"\n'] if admin is not None else []
    for name, (token, patterns) in tenants.items():
        datasets = ", ".join(f'"{p}"' for p in patterns)
        out.append(
            f'[[tenant]]\nname = "{name}"\ntoken_sha256 = "{token_digest(token)}"\n'
            f"datasets = [{datasets}]\n"
        )
    return "\n".join(out)
