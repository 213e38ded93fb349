"""Going back to this client's own replica once it answers again.

After a failover a client reads from another replica (:mod:`tokenfeed.transport.replicas`).
Without more, it stays there until that one fails too, so a replica that was paused or
restarted gets no workers back and the others carry its load. :class:`HomeProbe` asks
the client's own replica again, every ``return_after`` seconds, with a ``hello`` on a
socket of its own while the stream goes on over the one in use; nothing waits for it.
Once it is welcomed, :class:`~tokenfeed.transport.client.FeedClient` stops sending new
requests, takes the answers of those in flight (a request boundary: nothing asked twice,
nothing dropped), says ``bye`` to the replica in use and carries on over the probe's
socket, as after a failover: requests are pure functions of their fields, so any replica
over the same store answers the rest of the stream identically.

The probe's hello is the client's, so it may hold optional fields the client's own
replica refuses (a replica of an older release, mid-upgrade, that the client never met:
it was down when the client started). Such a refusal is handled as ``hello`` handles it
(:mod:`tokenfeed.transport.older`): the client leaves those fields out from then on and
the probe asks again at once, on the same socket.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from tokenfeed import protocol
from tokenfeed.errors import TokenFeedError
from tokenfeed.transport.connection import Connection
from tokenfeed.transport.options import ClientOptions
from tokenfeed.transport.replicas import Replicas

__all__ = ["HomeProbe"]

log = logging.getLogger("tokenfeed")


class HomeProbe:
    """A ``hello`` to the client's own replica while it reads from another one.

    Args:
        replicas: the client's replicas (which one is its own, whether it is away).
        options: credentials and ``return_after``, ``request_timeout`` (how long a
            probe waits for its welcome before it is given up until the next one).
        stop: the client's stop event, for the probe's socket.
        older: the client's judge of a refusal (the hello refused, the ``err``, the
            address): True when it refused optional fields the client now leaves out.
    """

    def __init__(
        self,
        replicas: Replicas,
        options: ClientOptions,
        stop: threading.Event | None,
        older: Callable[[protocol.Hello, protocol.Err, str], bool] | None = None,
    ) -> None:
        self._replicas = replicas
        self._options = options
        self._stop = stop
        self._older = older
        self._conn: Connection | None = None
        self._hello: protocol.Hello | None = None  # the hello the probe sent last
        self._sent_at = 0.0
        # not before return_after seconds away: a replica that just failed is not asked
        self._next = 0.0
        #: the welcome of the client's own replica, once it answered (the switch is due)
        self.welcome: protocol.Welcome | None = None

    def poll(self, hello: Callable[[], protocol.Hello], current: str) -> protocol.Welcome | None:
        """Move the probe on without waiting: start one when due, read its answer.

        ``hello`` makes the client's hello; ``current`` is the address in use. Returns
        the welcome once the client's own replica answered (then :meth:`take` hands
        over its socket), else None.
        """
        if self.welcome is not None:
            return self.welcome
        now = time.monotonic()
        if self._conn is None:
            if not self._replicas.away:
                self._next = now + self._options.return_after
                return None
            if now < self._next:
                return None
            home = self._replicas.home()
            if home is None or home == current:
                self._next = now + self._options.return_after
                return None
            self._start(home, hello(), now)
            return None
        try:
            received = self._conn.recv(0.0)
        except TokenFeedError as exc:  # a handshake verdict: not a replica to go back to
            log.debug("probe of %s failed: %s", self._conn.endpoint, exc)
            received = None
            self._conn.broken = True
        if received is not None and isinstance(received[0], protocol.Welcome):
            self.welcome = received[0]
            return self.welcome
        if received is not None and self._refused_older(received[0]):
            self._send(hello(), now)  # without the fields it refused: ask again at once
            return None
        late = now - self._sent_at > self._options.request_timeout
        if received is not None or self._conn.broken or late:
            self.drop()  # refused or silent: still away; ask again later
        return None

    def _start(self, address: str, hello: protocol.Hello, now: float) -> None:
        conn = Connection(address, self._options, self._stop)
        try:
            conn.open(address)
        except (TokenFeedError, OSError):
            conn.terminate()
            self._next = now + self._options.return_after
            return
        self._conn = conn
        self._send(hello, now)

    def _send(self, hello: protocol.Hello, now: float) -> None:
        assert self._conn is not None
        try:
            self._conn.send(hello)
        except (zmq.ZMQError, OSError):
            self.drop()
            return
        self._hello, self._sent_at = hello, now

    def _refused_older(self, msg: protocol.Message) -> bool:
        """True when ``msg`` refuses optional fields of the probe's hello that the
        client leaves out from now on (an older release: see the module docstring)."""
        if not isinstance(msg, protocol.Err) or self._older is None or self._hello is None:
            return False
        assert self._conn is not None
        return self._older(self._hello, msg, self._conn.endpoint)

    def take(self) -> Connection:
        """The probe's socket, welcomed by the client's own replica; the probe is reset."""
        conn = self._conn
        assert conn is not None and self.welcome is not None
        self._conn, self.welcome = None, None
        self._next = time.monotonic() + self._options.return_after
        return conn

    def drop(self) -> None:
        """Give up the probe under way, if any (its socket closed); ask again later."""
        conn, welcomed = self._conn, self.welcome is not None
        self._conn, self.welcome = None, None
        self._next = time.monotonic() + self._options.return_after
        if conn is not None:
            try:
                # welcomed: free the connection slot it holds there now, not at a timeout
                conn.close(protocol.Bye() if welcomed else None)
            except zmq.ZMQError:
                pass  # the bye is a courtesy
            finally:
                conn.terminate()
