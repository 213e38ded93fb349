"""The trainer's side of a shared-memory ring (see ``tokenfeed_server.dataplane.rings``).

When the server runs on this host, its welcome offers a ring: the path of its ring door
(a Unix socket) and a one-time nonce. :func:`attach` trades the nonce for the ring's
descriptor, maps it and marks it attached; from then on the server may put a chunk's
tokens in the ring instead of on the socket, and :meth:`ClientRing.borrow` lends them out
without a copy, releasing their space once the consumer is done with them. Anything that
goes wrong (no such socket: the server is on another host; a refused nonce) leaves the
connection on TCP, said once in the log.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import mmap
import os
import socket
import struct
import threading
import weakref
from contextlib import suppress
from typing import Any

import numpy as np

__all__ = ["ClientRing", "attach", "is_local_endpoint"]

log = logging.getLogger(__name__)

_HEADER_BYTES = 4096
_MAGIC = 0x474E4952_4446_4B54
_ATTACHED_AT, _RELEASED_AT = 8, 16
_TIMEOUT_S = 2.0


class ClientRing:
    """A mapped ring: lend chunks out as read-only views, release them in ring order.

    A chunk's tokens are not copied out: :meth:`borrow` returns a view of the ring, and
    its space is released when the last array over it is gone (a finalizer on the view:
    conversions copy, so that is when the consumer has converted the chunk's batches).
    The server writes only into released space, so nothing a view shows changes while it
    lives; a consumer that keeps chunks fills the ring and the server sends over TCP.
    Space is released in the order it was written (``released`` is one counter): a chunk
    returned early waits for those written before it.
    """

    def __init__(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)  # the mapping keeps the memory
        if size <= _HEADER_BYTES or struct.unpack_from("<Q", self._map, 0)[0] != _MAGIC:
            self._map.close()
            raise ValueError("the descriptor the server sent is not a tokenfeed ring")
        self.size = size
        self._lock = threading.Lock()  # views die on the consumer's thread
        self._lent: collections.deque[list[Any]] = collections.deque()  # [end, returned]
        self._closed = False
        struct.pack_into("<Q", self._map, _ATTACHED_AT, 1)

    def borrow(self, offset: int, end: int, nbytes: int) -> np.ndarray:
        """The ``nbytes`` at ``offset`` as a read-only view; its space (up to ``end``) is
        released once the view and every array made from it are gone."""
        if not (offset >= _HEADER_BYTES and offset + nbytes <= self.size):
            raise ValueError(f"tokens at {offset}+{nbytes} lie outside the ring ({self.size})")
        view = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=offset)
        view.flags.writeable = False
        entry: list[Any] = [end, False]
        with self._lock:
            self._lent.append(entry)
        weakref.finalize(view, self._returned, entry)
        return view

    def take(self, offset: int, end: int, nbytes: int) -> np.ndarray:
        """The ``nbytes`` at ``offset`` copied out, their space released at once."""
        out: np.ndarray = self.borrow(offset, end, nbytes).copy()
        return out

    def _returned(self, entry: list[Any]) -> None:
        with self._lock:
            entry[1] = True
            released = None
            while self._lent and self._lent[0][1]:
                released = self._lent.popleft()[0]
            if released is not None and not self._closed:
                struct.pack_into("<Q", self._map, _RELEASED_AT, released)

    def close(self) -> None:
        """Unmap (the server then sends over TCP: it sees the ring no more released); a
        view still alive keeps the mapping until it is gone."""
        with self._lock:
            self._closed = True
        with suppress(BufferError, ValueError):
            struct.pack_into("<Q", self._map, _ATTACHED_AT, 0)
            self._map.close()


def attach(path: str, key: str) -> ClientRing | None:
    """Trade the welcome's ``key`` for the ring at the door ``path``: send its first
    half, expect the second half back (only the server that sent the welcome knows it:
    a socket someone else put at that path cannot pass a ring of theirs for the
    server's). None, logged, when anything fails: the connection stays on TCP."""
    nonce, proof = key[:32], key[32:]
    fds: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(_TIMEOUT_S)
            sock.connect(path)
            sock.sendall(nonce.encode("ascii"))
            msg, fds, _, _ = socket.recv_fds(sock, 64, 1)
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        log.info("tokenfeed: shared-memory ring unavailable (%s: %s); using TCP", path, exc)
        return None
    if msg != b"ok" + proof.encode("ascii") or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        log.warning("tokenfeed: the server's ring door refused this connection; using TCP")
        return None
    try:
        return ClientRing(fds[0])
    except (OSError, ValueError) as exc:
        log.warning("tokenfeed: cannot map the server's ring (%s); using TCP", exc)
        return None


def is_local_endpoint(endpoint: str) -> bool:
    """True when ``endpoint`` (``tcp://host:port`` or ``ipc://...``) is on this host:
    an ipc path, or a host whose every address this host can bind (loopback or one of
    its own interfaces); a name that does not resolve is not."""
    if endpoint.startswith("ipc://"):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    try:
        addrs = {str(i[4][0]) for i in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return False
    return bool(addrs) and all(_can_bind(a) for a in addrs)


def _can_bind(addr: str) -> bool:
    ip = ipaddress.ip_address(addr.split("%", 1)[0])
    if ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((addr, 0))
        except OSError:
            return False
    return True
