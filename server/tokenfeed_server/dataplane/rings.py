"""Shared-memory rings: the bytes of a chunk for a trainer on the server's own host.

Over TCP a chunk's tokens cross the kernel twice (the server's send, the trainer's
receive) and the ZeroMQ IO threads on both sides. A trainer on the server's host can
instead read them from a ring of memory both map: the server still decides every
chunk (order, tenants, exactly-once stay in the data plane) and sends the chunk's
header over ZeroMQ as always, with ``ring_offset``/``ring_end`` saying where in the
ring its tokens are; no token bytes travel on the socket.

Security. A ring is an anonymous memory file (``memfd_create``: no name in any file
system, so no other user can open it) made per connection, after the connection
authenticated with its token and said hello. The welcome carries a one-time nonce
(128 random bits) and the path of the server's *ring door*, a Unix socket; the trainer
connects there, sends the nonce, and gets the file's descriptor (``SCM_RIGHTS``). A
descriptor is only ever handed to the holder of the nonce, which only the
authenticated connection received; the door records the peer's credentials
(``SO_PEERCRED``) for the operator and refuses wrong or reused nonces.

Flow control needs no messages: the ring's first page holds two words the trainer
writes, ``attached`` (set once it mapped the ring) and ``released`` (how many bytes of
the ring, counted from its creation, it has copied out). The server writes a chunk
only where the trainer has released space, and sends a chunk over TCP as before when
the ring is full or not attached: a slow or departed trainer never stalls the server.
A ring lives as long as its connection: the server closes its side when it forgets the
peer, and the memory goes back when the trainer's side is closed too (a dead trainer's
is closed by the kernel).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["HEADER_BYTES", "Ring", "RingDoor", "Rings", "Space", "open_rings"]

log = logging.getLogger(__name__)

#: The ring's first page: magic, attached, released (uint64 little-endian each).
HEADER_BYTES = 4096
MAGIC = 0x474E4952_4446_4B54  # b"TKFDRING" read as a little-endian uint64
_MAGIC_AT, _ATTACHED_AT, _RELEASED_AT = 0, 8, 16
ATTACHED = 1
_ALIGN = 64  # chunk starts on a cache line
_NONCE_TTL_S = 30.0  # a welcome's nonce not used within this is dropped
_DOOR_TIMEOUT_S = 2.0  # a door visitor that does not send its nonce in time is dropped


class Ring:
    """One connection's ring: the server's mapping and the descriptor to hand over."""

    def __init__(self, size: int) -> None:
        if size <= HEADER_BYTES + _ALIGN:
            raise ValueError(f"a ring needs more than {HEADER_BYTES + _ALIGN} bytes")
        self.size = size
        self.capacity = size - HEADER_BYTES
        self.fd = os.memfd_create("tokenfeed-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self._map: mmap.mmap | None = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        struct.pack_into("<Q", self._map, _MAGIC_AT, MAGIC)
        #: bytes allocated since creation (padding at the wrap included)
        self.allocated = 0
        self.written = 0  # chunks written into this ring

    @property
    def attached(self) -> bool:
        """True once the trainer mapped the ring and said so in its header."""
        m = self._map
        return m is not None and struct.unpack_from("<Q", m, _ATTACHED_AT)[0] == ATTACHED

    def reserve(self, nbytes: int) -> tuple[int, int] | None:
        """Room for ``nbytes`` in released space: ``(offset, bytes it takes)`` to fill
        and then :meth:`commit`, or None when the ring is not attached or has no room
        (send over TCP instead). Nothing changes until the commit, so a read that fails
        in between leaves the ring as it was."""
        m = self._map
        if m is None or not self.attached:
            return None
        released = struct.unpack_from("<Q", m, _RELEASED_AT)[0]
        if released > self.allocated:  # a trainer writing nonsense: stop using the ring
            self.close()
            return None
        pos = self.allocated % self.capacity
        pad = self.capacity - pos if pos + nbytes > self.capacity else 0
        need = pad + -(-nbytes // _ALIGN) * _ALIGN
        if need > self.capacity - (self.allocated - released):
            return None
        return HEADER_BYTES + (0 if pad else pos), need

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """The ring's ``nbytes`` from ``offset`` as a writable uint8 array (drop it
        before the ring closes)."""
        assert self._map is not None
        return np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=offset)

    def commit(self, offset: int, need: int) -> tuple[int, int]:
        """Mark a :meth:`reserve`-d region as written: ``(offset, end)`` for the chunk
        header (``end``: the trainer writes it as ``released`` once it copied them out)."""
        self.allocated += need
        self.written += 1
        return offset, self.allocated

    def put(self, tokens: np.ndarray) -> tuple[int, int] | None:
        """Copy ``tokens`` into released space (:meth:`reserve`, copy, :meth:`commit`);
        None when there is no room or no attached trainer."""
        room = self.reserve(tokens.nbytes)
        if room is None:
            return None
        self.view(room[0], tokens.nbytes)[:] = tokens.reshape(-1).view(np.uint8)
        return self.commit(*room)

    def close(self) -> None:
        """Unmap and close the server's side (idempotent)."""
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a live view: unmapped with it
                self._map.close()
            self._map = None
            os.close(self.fd)


@dataclass
class Space:
    """Reserved room in a ring, as the array a chunk's rows are read into."""

    ring: Ring
    offset: int
    need: int
    #: the rows' memory: the ring's own pages
    out: np.ndarray

    def commit(self) -> tuple[int, int]:
        """The rows are in: ``(offset, end)`` for the chunk header (see :meth:`Ring.commit`)."""
        return self.ring.commit(self.offset, self.need)


@dataclass
class _Offer:
    ring: Ring
    proof: bytes  # what the door answers, so the client knows it is the server's door
    expires: float
    owner: str  # the connection's client name, for the log


class RingDoor:
    """The Unix socket where a trainer trades a welcome's nonce for its ring.

    :meth:`offer` (data plane thread) files a ring under a fresh nonce; the door's
    thread hands the ring's descriptor to whoever presents that nonce, once.
    """

    def __init__(self, path: str | os.PathLike[str], *, private: bool = False) -> None:
        self.path = Path(path)
        #: the door's directory was made for it (removed with it)
        self.private = private
        self._offers: dict[str, _Offer] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        #: rings handed over and nonces refused (wrong, expired or reused)
        self.handed = 0
        self.refused = 0

    def start(self) -> RingDoor:
        """Bind the socket (replacing a stale one left by a dead server, never a live
        one: that is another server's door) and serve it."""
        if self.path.is_dir():  # a directory shared by several servers: one door each
            self.path = self.path / f"door-{socket.gethostname()}-{os.getpid()}.sock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_socket() and not _answers(self.path):
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(self.path))
        # Trainers of every user knock here; what they get depends on the nonce alone.
        os.chmod(self.path, 0o666)
        sock.listen(64)
        sock.settimeout(0.2)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="ring-door", daemon=True)
        self._thread.start()
        return self

    def offer(self, ring: Ring, owner: str) -> str:
        """File ``ring`` for the connection ``owner``; the key its welcome carries (the
        nonce the client presents, then the proof the door answers with)."""
        nonce, proof = secrets.token_hex(16), secrets.token_hex(16)
        now = time.monotonic()
        with self._lock:
            for key in [k for k, o in self._offers.items() if o.expires < now]:
                del self._offers[key]
            self._offers[nonce] = _Offer(ring, proof.encode(), now + _NONCE_TTL_S, owner)
        return nonce + proof

    def withdraw(self, ring: Ring) -> None:
        """Forget the offers of ``ring`` (its connection went away)."""
        with self._lock:
            for key in [k for k, o in self._offers.items() if o.ring is ring]:
                del self._offers[key]

    def stop(self) -> None:
        """Stop serving, remove the socket file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._sock is not None:
            self._sock.close()
        self.path.unlink(missing_ok=True)

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:  # out of descriptors: back off, keep the door
                log.warning("ring door: accept failed: %s", exc)
                self._stop.wait(0.5)
                continue
            with conn:
                try:
                    self._visit(conn)
                except OSError as exc:
                    log.info("ring door: a visitor left early: %s", exc)

    def _visit(self, conn: socket.socket) -> None:
        conn.settimeout(_DOOR_TIMEOUT_S)
        nonce = conn.recv(32).decode("ascii", "replace")
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        pid, uid, _ = struct.unpack("3i", creds)
        with self._lock:
            offer = self._offers.pop(nonce, None)
        if offer is None or offer.expires < time.monotonic() or offer.ring._map is None:
            self.refused += 1
            log.warning("ring door: refused pid %d uid %d (unknown or used nonce)", pid, uid)
            conn.sendall(b"no")
            return
        socket.send_fds(conn, [b"ok" + offer.proof], [offer.ring.fd])
        self.handed += 1
        log.debug("ring door: ring of %s handed to pid %d uid %d", offer.owner, pid, uid)


def _answers(path: Path) -> bool:
    """True when a process listens on the Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


class Rings:
    """The rings of the data plane's connections, by connection identity.

    Only the data plane's thread calls it (the door has its own thread and lock).
    """

    def __init__(self, door: RingDoor | None, size: int) -> None:
        self.door = door
        self.size = size
        self._rings: dict[bytes, Ring] = {}

    def __len__(self) -> int:
        return len(self._rings)

    @property
    def handed(self) -> int:
        """Rings handed to trainers since start."""
        return 0 if self.door is None else self.door.handed

    def offer(self, ident: bytes, owner: str) -> tuple[str, str]:
        """A new ring for connection ``ident``: ``(door path, key)`` for its welcome,
        or ``("", "")`` when this server offers no rings."""
        if self.door is None:
            return "", ""
        self.drop(ident)  # a hello again on the same socket: a fresh ring
        try:
            ring = Ring(self.size)
        except OSError as exc:  # out of memory or descriptors: TCP serves it as well
            log.warning("no shared-memory ring for %s: %s", owner, exc)
            return "", ""
        self._rings[ident] = ring
        return str(self.door.path), self.door.offer(ring, owner)

    def space(self, ident: bytes, shape: tuple[int, int], dtype: np.dtype[Any]) -> Space | None:
        """Room in ``ident``'s ring for a ``shape`` array of ``dtype`` (the server reads
        a chunk's rows straight into it: no copy of the chunk afterwards), or None: read
        into an ordinary buffer and send over TCP."""
        ring = self._rings.get(ident)
        nbytes = shape[0] * shape[1] * dtype.itemsize
        room = None if ring is None or nbytes == 0 else ring.reserve(nbytes)
        if ring is None or room is None:
            return None
        return Space(ring, room[0], room[1], ring.view(room[0], nbytes).view(dtype).reshape(shape))

    def drop(self, ident: bytes) -> None:
        """Close ``ident``'s ring, if it has one."""
        ring = self._rings.pop(ident, None)
        if ring is not None:
            if self.door is not None:
                self.door.withdraw(ring)
            ring.close()

    def sweep(self, live: Collection[bytes]) -> None:
        """Close the rings of connections the data plane has forgotten."""
        for ident in [i for i in self._rings if i not in live]:
            self.drop(ident)

    def close(self) -> None:
        """Close every ring and the door."""
        for ident in list(self._rings):
            self.drop(ident)
        if self.door is not None:
            self.door.stop()
            if self.door.private:
                shutil.rmtree(self.door.path.parent, ignore_errors=True)


def open_rings(door: str, size: int) -> Rings:
    """The rings of a server configured with ``--ring-door`` ``door`` (see
    :class:`~tokenfeed_server.config.ServerConfig`): ``off`` offers none; ``auto`` puts
    the door in a fresh private directory (others may enter it but not list or add to
    it, so nobody can put a door of their own in its place)."""
    if door == "off":
        return Rings(None, size)
    if door == "auto":
        where = Path(tempfile.mkdtemp(prefix="tokenfeed-ring-"))
        where.chmod(0o711)
        opened = RingDoor(where / "door.sock", private=True)
    else:
        opened = RingDoor(door)
    try:
        return Rings(opened.start(), size)
    except OSError as exc:
        log.warning("no shared-memory rings: cannot open the ring door %s: %s", door, exc)
        return Rings(None, size)
