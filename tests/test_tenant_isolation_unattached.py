"""Data connections that pass the handshake but never say hello, on a real server: they
are capped (``--max-unattached-connections``), closed after ``--hello-timeout-s``, counted
in ``/v1/status``, and a trainer that did say hello is served throughout.

Before, 4,000 of them held 4,000 descriptors for as long as the client wished, and
``/v1/status`` said ``connections: 0``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import zmq

from live_server import LiveServer
from shard_data import BYTE
from tokenfeed_server.store import write_dataset
from waiting import wait_until

pytestmark = pytest.mark.network

TOKEN = "tenant-token-abcdefghijklmnop"
ADMIN = "admin-token-zyxwvutsrqponmlkj"
CAP = 40
FLOOD = 150


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    root = tmp_path / "store"
    docs = [np.arange(2000, dtype=np.uint16) % 256 for _ in range(8)]
    write_dataset(root, "alpha", docs, shuffle_seed=0, tokenizer=BYTE)
    env = {**os.environ, "TOKENFEED_TOKEN": TOKEN, "TOKENFEED_ADMIN_TOKEN": ADMIN}
    extra = ["--hello-timeout-s", "2", "--max-unattached-connections", str(CAP)]
    with LiveServer(root, extra=extra, env=env, log_path=tmp_path / "log") as srv:
        yield srv


def _status(srv: LiveServer) -> dict[str, Any]:
    answer = httpx.get(
        srv.http + "/v1/status", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10
    )
    answer.raise_for_status()
    return dict(answer.json())


def _fds(srv: LiveServer) -> int:
    assert srv.proc is not None
    return len(os.listdir(f"/proc/{srv.proc.pid}/fd"))


def test_connections_that_never_say_hello_are_capped_and_closed(server: LiveServer) -> None:
    baseline = _fds(server)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    silent = []
    try:
        for _ in range(FLOOD):  # authenticated (the right token), then nothing
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, -1)  # closed means gone: counts stay exact
            sock.plain_username = b"tokenfeed"
            sock.plain_password = TOKEN.encode()
            sock.connect(server.zmq)
            silent.append(sock)
        seen = []

        def all_closed() -> bool:
            status = _status(server)
            seen.append(status["unattached"])
            counters = status["counters"]
            closed = counters.get("unattached_refused", 0) + counters.get("unattached_timed_out", 0)
            return bool(closed == FLOOD and status["unattached"] == 0)

        # Meanwhile a trainer says hello, waits past the hello timeout, and reads on.
        from tokenfeed import TokenFeedDataset

        loader = TokenFeedDataset(
            server.zmq, "alpha", seq_len=64, batch_size=2, rank=0, world_size=1,
            samples=8, token=TOKEN, request_timeout=5.0, deadline=30.0,
        )  # fmt: skip
        batches = iter(loader)
        first = next(batches)
        time.sleep(3)  # longer than --hello-timeout-s: an attached connection stays
        rest = list(batches)
        assert len(rest) == 3 and first is not None
        wait_until(all_closed, 30, "every silent connection closed")
        assert max(seen) <= CAP  # never more open than the cap
        counters = _status(server)["counters"]
        assert counters["unattached_refused"] >= FLOOD - CAP  # the cap closed the rest at once
        assert counters["unattached_timed_out"] >= 1
        # the descriptors went back (a few for the loader's finished connection at most)
        wait_until(lambda: _fds(server) <= baseline + 4, 10, "descriptors released")
    finally:
        for sock in silent:
            sock.close(linger=0)
        ctx.term()
    log = (server.log_path or Path()).read_text()
    assert "--max-unattached-connections" in log  # the refusal names the setting
