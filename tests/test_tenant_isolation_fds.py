"""The server at its descriptor limit, on a real process whose RLIMIT_NOFILE is forced low:
flooded with connections that never finish a request, it still answers ``/healthz``, and
its log says so once per interval instead of once per accept attempt.

Before the reserve (``http/guard.py``), asyncio logged "socket.accept() out of system
resource" for every queued connection (a million lines in 20 s), and the probe waited
behind the flood until the header deadline.
"""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from live_server import LiveServer
from shard_data import BYTE
from tokenfeed_server.store import write_dataset

pytestmark = pytest.mark.network

#: the child's descriptor limit (soft and hard, so the server cannot lift it)
NOFILE = 160
#: more connections than the child can hold
FLOOD = 400

_LIMITED = (
    "import resource, runpy, sys; "
    f"resource.setrlimit(resource.RLIMIT_NOFILE, ({NOFILE}, {NOFILE})); "
    "sys.argv = ['tokenfeed-server', *sys.argv[1:]]; "
    "runpy.run_module('tokenfeed_server.cli', run_name='__main__')"
)


@pytest.fixture
def limited(tmp_path: Path) -> Iterator[LiveServer]:
    root = tmp_path / "store"
    docs = [np.arange(300, dtype=np.uint16) % 256 for _ in range(4)]
    write_dataset(root, "alpha", docs, shuffle_seed=0, tokenizer=BYTE)
    command = [
        sys.executable, "-c", _LIMITED, "serve", "--store", str(root), "--host", "127.0.0.1",
        "--zmq-port", "0", "--http-port", "0",
        # neither the header deadline nor the connection cap comes to the rescue here
        "--http-header-timeout-s", "120", "--http-max-connections", "4096",
    ]  # fmt: skip
    with LiveServer(command=command, log_path=tmp_path / "log") as srv:
        yield srv


def _flood(url: str, count: int) -> list[socket.socket]:
    """``count`` connections that send half a request line and then nothing (non-blocking
    connects: beyond the listen backlog the kernel leaves them half open)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    socks = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.connect_ex((host, int(port)))
        socks.append(sock)
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.send(b"GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    return socks


def test_health_answers_at_the_descriptor_limit(limited: LiveServer, tmp_path: Path) -> None:
    flood = _flood(limited.http, FLOOD)
    try:
        # The probe waits its turn behind the flood; the server makes room for it.
        answer = httpx.get(limited.http + "/healthz", timeout=60.0)
        assert answer.status_code == 200
        again = httpx.get(limited.http + "/healthz", timeout=60.0)
        assert again.status_code == 200
    finally:
        for sock in flood:
            sock.close()
    lines = (tmp_path / "log").read_text().splitlines()
    exhausted = [line for line in lines if "out of file descriptors" in line]
    assert exhausted, "the flood never reached the descriptor limit: raise FLOOD"
    assert not [line for line in lines if "out of system resource" in line]
    assert len(exhausted) <= 3  # once per 10 s interval, for a probe that took seconds
    assert len(lines) < 60, lines[-20:]
