"""The HTTP port under abuse, on a real server: half-sent requests are cut off, the number
of connections is bounded, and HTTPS works with a certificate of the operator's.

Before the guard, 3,000 connections that never finished their headers stayed open for as
long as the client wished, each holding a descriptor, until the server could not accept
its own health probe.
"""

from __future__ import annotations

import logging
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from live_server import LiveServer
from shard_data import BYTE
from tokenfeed_server.config import ServerConfig
from tokenfeed_server.dataplane.security import tenants_for
from tokenfeed_server.store import write_dataset
from waiting import wait_until

pytestmark = pytest.mark.network


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("guard")
    docs = [np.arange(300, dtype=np.uint16) % 256 for _ in range(4)]
    write_dataset(root, "alpha", docs, shuffle_seed=0, tokenizer=BYTE)
    return root


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.settimeout(0.2)
    return sock


def _closed(sock: socket.socket) -> bool:
    """True once the server has closed ``sock`` (a read returns end of file)."""
    try:
        return sock.recv(1024) == b""
    except (TimeoutError, BlockingIOError):
        return False
    except ConnectionError:
        return True


@pytest.fixture
def guarded(store: Path, tmp_path: Path) -> Iterator[LiveServer]:
    extra = ["--http-header-timeout-s", "1", "--http-max-connections", "8"]
    with LiveServer(store, extra=extra, log_path=tmp_path / "log") as srv:
        yield srv


def test_half_sent_requests_are_cut_off_and_health_still_answers(guarded: LiveServer) -> None:
    slow = [_connect(guarded.http) for _ in range(5)]
    for sock in slow:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n")  # never the blank line
    t0 = time.monotonic()
    wait_until(lambda: all(_closed(s) for s in slow), 10, "half-sent requests closed")
    assert time.monotonic() - t0 < 5  # cut at the 1 s deadline, not when the client quits
    assert guarded.get("/healthz").status_code == 200
    for sock in slow:
        sock.close()


def test_connections_beyond_the_cap_are_closed_at_once(guarded: LiveServer) -> None:
    held = [_connect(guarded.http) for _ in range(8)]
    time.sleep(0.3)  # the server has seen them
    extra = [_connect(guarded.http) for _ in range(4)]
    wait_until(lambda: all(_closed(s) for s in extra), 5, "connections over the cap closed")
    assert not any(_closed(s) for s in held[:2])  # the first ones are still served
    for sock in held + extra:
        sock.close()
    # once they are gone (the header deadline), the port answers again
    wait_until(lambda: guarded.get("/healthz").status_code == 200, 10, "healthz again")


def test_https_with_the_operators_certificate(store: Path, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    extra = ["--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    with LiveServer(store, extra=extra, log_path=tmp_path / "log") as srv:
        assert srv.http.startswith("https://127.0.0.1:")
        trust = ssl.create_default_context(cafile=str(cert))
        answer = httpx.get(f"{srv.http}/v1/datasets", verify=trust, timeout=10)
        assert answer.status_code == 200 and answer.json()[0]["name"] == "alpha"
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not spoken there
            httpx.get(srv.http.replace("https://", "http://") + "/healthz", timeout=5)


def test_tokens_in_clear_and_on_the_command_line_are_warned_about(
    store: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token = "a-long-enough-token-0123"
    with LiveServer(store, extra=["--token", token], log_path=tmp_path / "log"):
        pass
    log = (tmp_path / "log").read_text()
    assert "--token on the command line shows in the process list" in log
    assert token not in log
    # off loopback, each cleartext port is named with its fix
    config = ServerConfig(store=str(store), host="0.0.0.0", token=token)
    with caplog.at_level(logging.WARNING):
        tenants_for(config)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "clear on the data port" in said and "--curve-secret-key" in said
    assert "clear on the HTTP port" in said and "--tls-cert-file" in said


def test_a_loopback_server_answers_only_loopback_host_names(guarded: LiveServer) -> None:
    assert guarded.get("/v1/datasets").status_code == 200  # Host: 127.0.0.1:PORT
    for name in ("localhost", "[::1]"):
        assert guarded.get("/healthz", headers={"Host": name}).status_code == 200
    # a page of attacker.example rebound to 127.0.0.1 sends its own name: refused
    rebound = guarded.get("/v1/datasets", headers={"Host": "attacker.example:7401"})
    assert rebound.status_code == 400


def test_allowed_hosts_is_a_setting(store: Path, tmp_path: Path) -> None:
    extra = ["--http-allowed-hosts", "trainer-gw.internal, 127.0.0.1"]
    with LiveServer(store, extra=extra, log_path=tmp_path / "log") as srv:
        gateway = srv.get("/healthz", headers={"Host": "trainer-gw.internal"})
        assert gateway.status_code == 200
        assert srv.get("/healthz", headers={"Host": "localhost"}).status_code == 400
