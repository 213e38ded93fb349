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

Headers are capped in size by h11 (``h11_max_incomplete_event_size``, set with it), and
the API takes no request bodies. Why not a proxy-grade server: these two rules are what
a proxy would add here, and a subclass of the protocol uvicorn already runs keeps one
server, one event loop and no new dependency.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["MAX_HEADER_BYTES", "guarded_h11"]

log = logging.getLogger(__name__)

#: the largest request line and headers accepted (h11 answers 400 beyond it)
MAX_HEADER_BYTES = 16 * 1024


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap."""

    def __init__(
        self, *args: Any, header_timeout_s: float, max_connections: int, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
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
        super().connection_lost(exc)

    def _arm(self) -> None:
        """Start the deadline while the client owes a request's headers; stop it once a
        request has begun (its body and the response are the app's business)."""
        if self.conn.their_state is not h11.IDLE:
            self._disarm()
        elif self._deadline is None and not self.transport.is_closing():
            self._deadline = self.loop.call_later(self._header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            # Idle between requests or a request still unfinished: either way the client
            # had its time (a keep-alive client just opens a new connection).
            self.transport.close()


def guarded_h11(header_timeout_s: float, max_connections: int) -> Any:
    """A protocol factory for ``uvicorn.Config(http=...)`` (see the module doc)."""
    return functools.partial(
        _GuardedH11, header_timeout_s=header_timeout_s, max_connections=max_connections
    )
