"""The benchmark's latency proxy: every HTTP request pays the delay, bytes pass unchanged.

A behaviour check of the tool the S3 benchmark puts in front of its object store: real
sockets on loopback, a real keep-alive HTTP server upstream and a raw TCP echo server.
The only time measured is a lower bound the proxy guarantees by construction (it sleeps
``delay`` before forwarding a request), never the speed of anything.
"""

from __future__ import annotations

import hashlib
import http.client
import http.server
import importlib.util
import json
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "latency_proxy.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("latency_proxy", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["latency_proxy"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


lp = _load()
DELAY = 0.05


def body_of(n: int) -> bytes:
    """``n`` deterministic, non-repeating-looking bytes."""
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.blake2b(counter.to_bytes(8, "little")).digest()
        counter += 1
    return bytes(out[:n])


class Handler(http.server.BaseHTTPRequestHandler):
    """GET /N: N bytes of body_of(N); PUT: answers the blake2b of the body it read."""

    protocol_version = "HTTP/1.1"  # keep-alive: several requests per connection

    def do_GET(self) -> None:
        data = body_of(int(self.path.lstrip("/")))
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self) -> None:
        data = self.rfile.read(int(self.headers["Content-Length"]))
        digest = hashlib.blake2b(data).hexdigest().encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(digest)))
        self.end_headers()
        self.wfile.write(digest)

    def log_message(self, format: str, *args: object) -> None:
        pass


class Echo(socketserver.BaseRequestHandler):
    """Raw TCP: send back everything read, until the client half-closes."""

    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


class Threaded(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture(scope="module")
def http_upstream() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()
    thread.join(10)


@pytest.fixture(scope="module")
def echo_upstream() -> Iterator[int]:
    server = Threaded(("127.0.0.1", 0), Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()
    thread.join(10)


def test_every_request_on_a_keep_alive_connection_pays_the_delay(http_upstream: int) -> None:
    sizes = [0, 10, 200_000, 3, 1_000_000]
    with lp.ProxyThread("127.0.0.1", http_upstream, delay_s=DELAY) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        try:
            for n in sizes:
                t0 = time.perf_counter()
                conn.request("GET", f"/{n}")
                data = conn.getresponse().read()
                assert time.perf_counter() - t0 >= DELAY  # a lower bound: the proxy sleeps
                assert data == body_of(n)
            # An upload of many TCP segments is one request: delayed once, not per segment.
            body = body_of(2_000_000)
            t0 = time.perf_counter()
            conn.request("PUT", "/up", body=body)
            answer = conn.getresponse().read()
            assert time.perf_counter() - t0 >= DELAY
            assert answer == hashlib.blake2b(body).hexdigest().encode()
        finally:
            conn.close()
        stats = proxy.proxy.stats
        assert stats.connections == 1  # all of them on one connection, kept alive
        assert stats.delayed_requests == len(sizes) + 1
        assert stats.waiting == 0  # every one was answered


def test_waiting_counts_a_request_until_its_answer_begins(http_upstream: int) -> None:
    with lp.ProxyThread("127.0.0.1", http_upstream, delay_s=0.5) as proxy:
        stats = proxy.proxy.stats
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        try:
            conn.request("GET", "/100")  # sent; the proxy holds it for the delay
            deadline = time.monotonic() + 10
            while stats.waiting != 1:  # bounded poll: it is counted on arrival
                assert time.monotonic() < deadline, "the request was never counted"
                time.sleep(0.005)
            assert conn.getresponse().read() == body_of(100)
            assert stats.waiting == 0
        finally:
            conn.close()


def test_each_new_connection_pays_the_delay(http_upstream: int) -> None:
    with lp.ProxyThread("127.0.0.1", http_upstream, delay_s=DELAY) as proxy:
        for _ in range(3):
            conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
            try:
                t0 = time.perf_counter()
                conn.request("GET", "/5")
                assert conn.getresponse().read() == body_of(5)
                assert time.perf_counter() - t0 >= DELAY
            finally:
                conn.close()
        assert proxy.proxy.stats.delayed_requests == 3


def roundtrip(port: int, payload: bytes, pieces: list[int]) -> bytes:
    """Send ``payload`` cut at ``pieces``, half-close, read until the upstream's EOF."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        got = bytearray()
        start = 0
        for cut in [*sorted(pieces), len(payload)]:
            s.sendall(payload[start:cut])
            start = max(start, cut)
        s.shutdown(socket.SHUT_WR)
        while data := s.recv(65536):
            got += data
    return bytes(got)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_bytes_pass_unchanged_both_ways(echo_upstream: int, data: st.DataObject) -> None:
    payload = data.draw(st.binary(min_size=0, max_size=4096), label="payload")
    if data.draw(st.booleans(), label="big"):
        payload = payload + body_of(data.draw(st.integers(0, 600_000), label="extra"))
    pieces = data.draw(st.lists(st.integers(0, len(payload)), max_size=5), label="cuts")
    with lp.ProxyThread("127.0.0.1", echo_upstream, delay_s=0.0) as proxy:
        assert roundtrip(proxy.port, payload, pieces) == payload
        assert proxy.proxy.stats.bytes_up == len(payload)
        assert proxy.proxy.stats.bytes_down == len(payload)


def test_connections_beyond_the_bound_are_closed(echo_upstream: int) -> None:
    with lp.ProxyThread("127.0.0.1", echo_upstream, delay_s=0.0, max_connections=1) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as first:
            first.sendall(b"ping")
            assert first.recv(4) == b"ping"  # the first is being served
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as second:
                assert second.recv(1) == b""  # closed at once: over the bound
            first.sendall(b"pong")
            assert first.recv(4) == b"pong"  # and the first is still served
        assert proxy.proxy.stats.refused == 1


def test_an_upstream_that_is_down_cuts_the_client() -> None:
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        dead = int(s.getsockname()[1])
        with (
            lp.ProxyThread("127.0.0.1", dead, delay_s=0.0) as proxy,
            socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as c,
        ):
            assert c.recv(1) == b""


@pytest.mark.parametrize(
    ("upstream", "listen"), [("10.1.2.3", "127.0.0.1"), ("127.0.0.1", "0.0.0.0")]
)
def test_only_loopback(upstream: str, listen: str) -> None:
    with pytest.raises(ValueError, match="loopback"):
        lp.LatencyProxy(upstream, 80, host=listen)


@pytest.mark.timeout(60)  # bounds the read of the ready line
def test_command_line_prints_ready_and_stops_on_sigterm(http_upstream: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--upstream", f"127.0.0.1:{http_upstream}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready" and ready["delay_ms"] == 50.0
        conn = http.client.HTTPConnection("127.0.0.1", ready["port"], timeout=10)
        try:
            t0 = time.perf_counter()
            conn.request("GET", "/1000")
            assert conn.getresponse().read() == body_of(1000)
            assert time.perf_counter() - t0 >= 0.05  # the default delay
        finally:
            conn.close()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert json.loads(err.strip().splitlines()[-1])["delayed_requests"] == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
