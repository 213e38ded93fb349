"""One DEALER socket to one server address, with the monitor that watches its handshake.

A :class:`Connection` is what :class:`~tokenfeed.transport.client.FeedClient` opens
afresh on every attempt (Lazy Pirate): it sets up security (PLAIN with the token, or
CURVE), connects, receives one message at a time, and closes, saying ``bye`` when asked.
Every wait checks the owner's ``stop`` event, so a receiver thread can be stopped while
the server is gone.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from tokenfeed import protocol
from tokenfeed.dtypes import DTYPES
from tokenfeed.errors import ConfigError, ProtocolError
from tokenfeed.protocol.curve import curve_keypair
from tokenfeed.transport.handshake import HANDSHAKE_FAILURES, verdict
from tokenfeed.transport.options import ClientOptions
from tokenfeed.transport.ring import ClientRing

__all__ = ["Connection", "Received", "Stopped"]

# How often a wait checks the owner's stop event: a stopped client lets go within this.
_STOP_SLICE = 0.1

Received = tuple[protocol.Message, list[Any]]
"""A decoded header and the payload frames that came with it (empty but for chunks)."""


class Stopped(Exception):
    """The owner of the client set its ``stop`` event: a wait gave up (not an error)."""

    def __init__(self) -> None:
        super().__init__("the client was stopped by its owner")


class Connection:
    """The socket in use (at most one at a time) and the context it lives in.

    Args:
        endpoint: the address shown in messages until the first :meth:`open`.
        options: credentials (token, server key) for the handshake.
        stop: when set, every wait raises :class:`Stopped` within a tenth of a second.
    """

    def __init__(
        self, endpoint: str, options: ClientOptions, stop: threading.Event | None = None
    ) -> None:
        #: the address in use (or last used)
        self.endpoint = endpoint
        #: True once the socket in use closed during the handshake for a reason that is
        #: not a verdict on our credentials (see :meth:`check_handshake`)
        self.broken = False
        self.sock: zmq.Socket[bytes] | None = None
        self._options = options
        self._stop = stop
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._monitor: zmq.Socket[bytes] | None = None
        self._poller = zmq.Poller()
        #: the shared-memory ring of the socket in use, if the server gave it one (see
        #: :mod:`tokenfeed.transport.ring`); closed with the socket
        self.ring: ClientRing | None = None

    def open(self, address: str) -> zmq.Socket[bytes]:
        """Close the socket in use, if any, and connect a new one to ``address``."""
        self.close()
        self.endpoint = address
        self.broken = False
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Held in self at once: whatever fails below, close() sees it, so the context
        # never waits on a socket nobody will close.
        self.sock = sock
        if address.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)  # off by default in libzmq: no IPv6 connects
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
        self._secure(sock)
        # Handshake failures (wrong token, missing token) are invisible on the socket
        # itself: libzmq just retries. The monitor reports them so we can fail at once.
        self._monitor = sock.get_monitor_socket(HANDSHAKE_FAILURES)
        try:
            sock.connect(self.endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ConfigError(
                f"can not connect to endpoint {self.endpoint!r}: {exc.strerror}; expected "
                "tcp://host:port with a host this machine can resolve"
            ) from None
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        return sock

    def _secure(self, sock: zmq.Socket[bytes]) -> None:
        token = self._options.token
        if self._options.server_public_key is not None:
            # The key the operator issued (the options refuse a server key without one):
            # never one derived from the token, which a sniffed bearer token would give away.
            client_key = self._options.client_secret_key
            assert client_key is not None
            public, secret = curve_keypair(client_key)
            sock.curve_serverkey = self._options.server_public_key.encode()
            sock.curve_publickey = public
            sock.curve_secretkey = secret
        elif token is not None:
            sock.plain_username = b"tokenfeed"  # the token alone names the tenant
            sock.plain_password = token.encode()

    def close(self, bye: protocol.Bye | None = None) -> None:
        """Close the socket in use (none: nothing to do), sending ``bye`` first if given."""
        sock, monitor = self.sock, self._monitor
        self.sock = self._monitor = None
        if self.ring is not None:  # a ring belongs to its socket: the next one gets its own
            self.ring.close()
            self.ring = None
        try:
            if sock is not None:
                linger = 0
                if bye is not None:
                    # Frees our connection slot on the server now rather than at its timeout.
                    sock.send(bye.header(), zmq.NOBLOCK)
                    linger = 200
                sock.disable_monitor()
                sock.close(linger=linger)
        finally:
            if sock is not None and not sock.closed:
                sock.close(linger=0)
            if monitor is not None:
                monitor.close(linger=0)

    def terminate(self) -> None:
        """Close everything; the connection can not be opened again."""
        try:
            self.close()
        finally:
            self._ctx.term()

    def check_handshake(self) -> None:
        """Raise on a verdict about our credentials; note any other failed handshake
        in :attr:`broken` (see :func:`tokenfeed.transport.handshake.verdict`)."""
        mon = self._monitor
        while mon is not None and mon.poll(0):
            message = recv_monitor_message(mon)
            error = verdict(message["event"], message["value"], self.endpoint)
            if error is not None:
                raise error
            self.broken = True

    def recv(self, timeout: float) -> Received | None:
        """One message with its payload frames, or None after ``timeout`` seconds or
        once the connection was cut during the handshake (a failed attempt)."""
        sock = self.sock
        assert sock is not None
        end = time.monotonic() + timeout
        while True:
            left = max(0.0, end - time.monotonic())
            if self._stop is not None:
                left = min(left, _STOP_SLICE)
            ready = dict(self._poller.poll(int(left * 1000)))
            self.check_handshake()
            if sock in ready:
                break
            if self._stop is not None and self._stop.is_set():
                raise Stopped
            if self.broken or time.monotonic() >= end:
                return None
        frames = sock.recv_multipart(copy=False)
        msg = protocol.decode_header(frames[0].buffer)
        if isinstance(msg, protocol.Chunk) and msg.ring_offset:
            return msg, [self._from_ring(msg), *frames[2:]]
        return msg, frames[1:]

    def _from_ring(self, chunk: protocol.Chunk) -> np.ndarray:
        """The tokens of a chunk the server put in this socket's ring: a read-only view,
        their space released once the consumer has dropped every array over it (see
        :class:`~tokenfeed.transport.ring.ClientRing`)."""
        if self.ring is None:
            raise ProtocolError("the server sent a chunk in a ring this connection does not have")
        itemsize = DTYPES[chunk.dtype].itemsize if chunk.dtype in DTYPES else 0
        try:
            return self.ring.borrow(
                chunk.ring_offset, chunk.ring_end, chunk.rows * chunk.cols * itemsize
            )
        except ValueError as exc:
            raise ProtocolError(f"chunk: {exc}") from None

    def send(self, message: protocol.Message) -> None:
        """Send one message on the socket in use."""
        assert self.sock is not None
        self.sock.send(message.header())

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds``, or raise :class:`Stopped` as soon as the owner says stop."""
        if self._stop is None:
            time.sleep(seconds)
        elif self._stop.wait(seconds):
            raise Stopped
