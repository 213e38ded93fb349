"""A loopback TCP front of the S3 test server that can fail on purpose: outages for tests.

The tokenfeed server talks to :attr:`S3Front.endpoint` (its ``AWS_ENDPOINT_URL``); the
front forwards every connection to the S3 server (``tests/s3_server.py``) byte for byte,
until a test switches it to a fault, and back:

* :meth:`S3Front.refuse` closes the listening socket: new connections are refused
  (``ECONNREFUSED``), as from an endpoint that is down; ``reset=True`` instead accepts
  and resets each connection at once (``ECONNRESET``), as a balancer with no backend;
* :meth:`S3Front.slow_down` answers every HTTP request itself with ``503 SlowDown`` and
  the S3 XML error body, as throttled S3 does;
* :meth:`S3Front.forward` forwards again.

Every switch drops the connections open at that moment (pooled keep-alive connections
would otherwise carry on through the old mode). The S3 server keeps its buckets in
memory, so a test stops the front, never the S3 server. Threads only (one per
connection), loopback only, every socket with a timeout; ``stop()`` joins what it
started. :meth:`S3Front.outage` is the usual way: ``with front.outage("refuse"): ...``.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["SLOW_DOWN_BODY", "FrontStats", "S3Front"]

SLOW_DOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message>"
    b"<RequestId>s3-front</RequestId></Error>"
)
_READ = 64 * 1024


@dataclass
class FrontStats:
    """What went through the front: connections forwarded, reset, answered 503."""

    forwarded: int = 0
    reset: int = 0
    slowed: int = 0


def _rst(sock: socket.socket) -> None:
    """Close ``sock`` with a reset (SO_LINGER 0), not a graceful FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class _Conn:
    """One client connection and its thread; ``drop()`` ends it from outside."""

    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.upstream: socket.socket | None = None
        self.dropped = threading.Event()

    def drop(self) -> None:
        self.dropped.set()
        for sock in (self.client, self.upstream):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's select at once

    def close(self) -> None:
        _rst(self.client)
        if self.upstream is not None:
            _rst(self.upstream)


class S3Front:
    """A front of the S3 server at ``upstream`` (``http://127.0.0.1:PORT``)."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").partition(":")
        if host not in ("127.0.0.1", "localhost"):
            raise ValueError(f"the S3 front is for loopback only, not {upstream}")
        self.upstream = ("127.0.0.1", int(port))
        self.mode = "forward"
        self.stats = FrontStats()
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        # The acceptor thread alone opens and closes the listening socket (closing it
        # under a thread blocked in accept() would leave the port open a while): a switch
        # says what it wants and waits until the acceptor has done it.
        self._changed = threading.Condition(self._lock)
        self._want_listening = True
        self._listener: socket.socket | None = self._bind(0)
        self.port = int(self._listener.getsockname()[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> S3Front:
        self._acceptor.start()
        return self

    def stop(self) -> None:
        """Stop accepting, drop every connection, join every thread (bounded)."""
        self._stop.set()
        self._drop_all()
        self._acceptor.join(10)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(10)

    def __enter__(self) -> S3Front:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- switching ---------------------------------------------------------------------

    def forward(self) -> None:
        """Forward to the S3 server again."""
        self._switch("forward")

    def refuse(self, *, reset: bool = False) -> None:
        """Refuse new connections (closed port), or with ``reset`` accept and reset them."""
        self._switch("reset" if reset else "refuse")

    def slow_down(self) -> None:
        """Answer every request with ``503 SlowDown``."""
        self._switch("slowdown")

    @contextlib.contextmanager
    def outage(self, mode: str, *, reset: bool = False) -> Iterator[float]:
        """Fail in ``mode`` ("refuse" or "slowdown") for the ``with`` block, then forward
        again; yields the time the fault began (``time.monotonic``)."""
        began = time.monotonic()
        if mode == "refuse":
            self.refuse(reset=reset)
        elif mode == "slowdown":
            self.slow_down()
        else:
            raise ValueError(f"unknown outage mode {mode!r}")
        try:
            yield began
        finally:
            self.forward()

    def _switch(self, mode: str) -> None:
        with self._lock:
            self.mode = mode
            self._want_listening = mode != "refuse"
            # bounded: the acceptor looks every 0.1 s
            self._changed.wait_for(
                lambda: (self._listener is not None) == self._want_listening, timeout=10
            )
        self._drop_all()

    def _drop_all(self) -> None:
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.drop()

    # -- the listening socket ----------------------------------------------------------

    @staticmethod
    def _bind(port: int) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
        sock.settimeout(0.1)
        return sock

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if self._want_listening and self._listener is None:
                    self._listener = self._bind(self.port)  # the same port: the same URL
                    self._changed.notify_all()
                elif not self._want_listening and self._listener is not None:
                    self._listener.close()
                    self._listener = None
                    self._changed.notify_all()
                sock = self._listener
            if sock is None:
                self._stop.wait(0.05)
                continue
            try:
                client, _ = sock.accept()
            except (TimeoutError, OSError):
                continue
            self._handle(client)

    def _handle(self, client: socket.socket) -> None:
        client.settimeout(10.0)
        with self._lock:
            mode = self.mode
        if mode in ("reset", "refuse"):  # refuse: accepted just before the port closed
            self.stats.reset += 1
            _rst(client)
            return
        conn = _Conn(client)
        target = self._forward if mode == "forward" else self._slow_down
        thread = threading.Thread(target=self._run, args=(conn, target), daemon=True)
        with self._lock:
            self._conns.add(conn)
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _run(self, conn: _Conn, target: object) -> None:
        try:
            assert callable(target)
            target(conn)
        except OSError:
            pass  # a peer closed, or the connection was dropped by a switch
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(conn)

    # -- the two ways to answer ----------------------------------------------------------

    def _forward(self, conn: _Conn) -> None:
        """Bytes both ways until either side closes or the connection is dropped."""
        conn.upstream = socket.create_connection(self.upstream, timeout=10.0)
        if conn.dropped.is_set():
            return
        self.stats.forwarded += 1
        peer = {conn.client: conn.upstream, conn.upstream: conn.client}
        while not conn.dropped.is_set():
            readable, _, _ = select.select(list(peer), [], [], 0.2)
            for sock in readable:
                data = sock.recv(_READ)
                if not data:
                    return
                peer[sock].sendall(data)

    def _slow_down(self, conn: _Conn) -> None:
        """Read one request, answer it ``503 SlowDown`` and close (the body of a PUT is
        not read: ``Connection: close`` makes that harmless)."""
        head = b""
        while b"\r\n\r\n" not in head and len(head) < _READ:
            chunk = conn.client.recv(_READ)
            if not chunk or conn.dropped.is_set():
                return
            head += chunk
        body = b"" if head.startswith(b"HEAD ") else SLOW_DOWN_BODY
        self.stats.slowed += 1
        conn.client.sendall(
            b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
            + f"Content-Length: {len(SLOW_DOWN_BODY)}\r\n".encode()
            + b"x-amz-request-id: s3-front\r\nConnection: close\r\n\r\n"
            + body
        )
