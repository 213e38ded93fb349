"""The HTTP port's guard: a deadline for a request's headers and a cap on connections.

uvicorn (0.55) times out an idle keep-alive connection, but not one that never finishes
its request line and headers: 3,000 half-sent requests stayed open, each holding a file
descriptor, until the server ran out and stopped answering everyone (``/healthz``
included). :func:`guarded_h11` returns uvicorn's own h11 protocol with two additions:

* a request's headers must be complete within ``header_timeout_s`` of the connection
  opening, or of the previous response (then the connection is closed);
* beyond ``max_connections`` open at once, a new connection is closed at once (an ``accept``
  that frees its descriptor), so the descriptors stay bounded and the server answers those
  it has.

At the process's descriptor limit (EMFILE) asyncio's accept loop would log "accept() out
of system resource" for every queued connection and try again a second later, while the
descriptors stay held by connections that may never send a byte: ``/healthz`` went
unanswered and the log grew by a million lines. :class:`FdReserve` keeps one descriptor in
reserve: at EMFILE the listener (:func:`reserved_listener`) gives it up to accept the next
connection, closes the oldest connections still waiting for their headers (a health
probe sends its request at once, a flood's connections do not), and backs off quietly; it
logs once per interval, and :func:`quiet_accept_errors` keeps asyncio's own line out.

Headers are capped in size by h11 (``h11_max_incomplete_event_size``, set with it), and
the API takes no request bodies. Why not a proxy-grade server: these two rules are what
a proxy would add here, and a subclass of the protocol uvicorn already runs keeps one
server, one event loop and no new dependency.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import socket
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = [
    "MAX_HEADER_BYTES",
    "FdReserve",
    "guarded_h11",
    "quiet_accept_errors",
    "reserved_listener",
]

log = logging.getLogger(__name__)

#: the largest request line and headers accepted (h11 answers 400 beyond it)
MAX_HEADER_BYTES = 16 * 1024
#: at most one "out of descriptors" line per this many seconds
EMFILE_LOG_INTERVAL_S = 10.0
#: asyncio's own line at EMFILE, replaced by ours (see :func:`quiet_accept_errors`)
_ASYNCIO_EMFILE = "socket.accept() out of system resource"
#: after EMFILE asyncio retries in a second; accepts in between answer "nothing to accept"
_BACKOFF_S = 0.5


class FdReserve:
    """One descriptor held back for the moment the process runs out, and the connections
    still owing their headers, oldest first (those that make room at EMFILE)."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self.waiting: dict[Any, None] = {}  # insertion-ordered: the oldest first
        self.exhausted = 0  # times the limit was hit (for tests and the log)
        self.shed = 0  # connections closed to make room
        self._logged = -EMFILE_LOG_INTERVAL_S
        self._backoff_until = 0.0
        self.refill()

    def refill(self) -> None:
        """Take the reserve descriptor again if it was given up and one is free."""
        if self._fd is None:
            # still at the limit: the next ended connection tries again
            with contextlib.suppress(OSError):
                self._fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def accept(self, accept: Any) -> tuple[socket.socket, Any]:
        """Accept at the descriptor limit: make room, use the reserve, or back off."""
        now = time.monotonic()
        if now < self._backoff_until:
            raise BlockingIOError(errno.EAGAIN, "backing off after EMFILE")
        self.exhausted += 1
        self._shed_oldest()
        if now - self._logged >= EMFILE_LOG_INTERVAL_S:
            self._logged = now
            log.warning(
                "HTTP: out of file descriptors (the process limit, RLIMIT_NOFILE): closed "
                "%d connections that had not sent their headers; raise the limit (ulimit -n) "
                "or lower --http-max-connections if this repeats",
                self.shed,
            )
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            try:
                return accept()  # type: ignore[no-any-return]
            except OSError:
                self.refill()
        # Back off: EMFILE makes asyncio stop watching the socket for a second (and the
        # room made above is free by then); the rest of this turn's accepts see nothing.
        self._backoff_until = now + _BACKOFF_S
        raise OSError(errno.EMFILE, "out of file descriptors")

    def _shed_oldest(self) -> None:
        count = max(8, len(self.waiting) // 4)
        for proto in list(self.waiting)[:count]:
            self.waiting.pop(proto, None)
            self.shed += 1
            proto.transport.close()


class _ReservedListener(socket.socket):
    """A listening socket whose ``accept`` handles EMFILE with an :class:`FdReserve`."""

    reserve: FdReserve

    def accept(self) -> tuple[socket.socket, Any]:
        try:
            return super().accept()
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
        return self.reserve.accept(super().accept)


def reserved_listener(sock: socket.socket, reserve: FdReserve) -> socket.socket:
    """``sock`` (a bound, listening socket) as one that keeps answering at EMFILE."""
    listener = _ReservedListener(sock.family, sock.type, sock.proto, fileno=sock.detach())
    listener.reserve = reserve
    return listener


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Drop asyncio's per-attempt EMFILE line: :class:`FdReserve` logs once per interval."""

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != _ASYNCIO_EMFILE:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap."""

    def __init__(
        self,
        *args: Any,
        header_timeout_s: float,
        max_connections: int,
        reserve: FdReserve,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._reserve = reserve
        self._header_timeout_s = header_timeout_s
        self._max_connections = max_connections
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._max_connections:
            log.warning(
                "HTTP: %d connections open (--http-max-connections): closing a new one",
                len(self.connections) - 1,
            )
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._reserve.refill()
        super().connection_lost(exc)

    def _arm(self) -> None:
        """Start the deadline while the client owes a request's headers; stop it once a
        request has begun (its body and the response are the app's business)."""
        if self.conn.their_state is not h11.IDLE:
            self._disarm()
        elif self._deadline is None and not self.transport.is_closing():
            self._deadline = self.loop.call_later(self._header_timeout_s, self._expire)
            self._reserve.waiting[self] = None

    def _disarm(self) -> None:
        self._reserve.waiting.pop(self, None)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        self._reserve.waiting.pop(self, None)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            # Idle between requests or a request still unfinished: either way the client
            # had its time (a keep-alive client just opens a new connection).
            self.transport.close()


def guarded_h11(
    header_timeout_s: float, max_connections: int, reserve: FdReserve | None = None
) -> Any:
    """A protocol factory for ``uvicorn.Config(http=...)`` (see the module doc); give the
    ``reserve`` of the :func:`reserved_listener` so that EMFILE sheds waiting connections."""
    return functools.partial(
        _GuardedH11,
        header_timeout_s=header_timeout_s,
        max_connections=max_connections,
        reserve=reserve or FdReserve(),
    )
