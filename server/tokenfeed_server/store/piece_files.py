"""The piece cache's directory: verified piece files under ``pieces/``, named by digest.

A piece is written to a temp file under ``tmp/`` and renamed into place, so a file under
``pieces/`` is always a whole piece; a server killed mid-fetch leaves only temp files,
removed at the next start (:meth:`PieceDirectory.recover`). A file found at start-up is
not trusted: it is hashed before its first use (:meth:`PieceDirectory.verify`). A lock
file keeps a second server off the directory (two would overrun the cache's size).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import uuid
from pathlib import Path

from tokenfeed.errors import StoreError
from tokenfeed_server.store.errors import CacheDiskFull, CacheOutOfDescriptors, PieceUnreadable
from tokenfeed_server.store.format import piece_digest
from tokenfeed_server.store.pieces import PieceRef

__all__ = ["OUT_OF_DESCRIPTORS", "PieceDirectory"]

log = logging.getLogger(__name__)

_DIGEST_RE = re.compile(r"[0-9a-f]{32}")
_TEMP_SUFFIX = ".part"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NO_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)
#: What a server out of file descriptors should do (the words trainers and the log see).
OUT_OF_DESCRIPTORS = "too many open files: raise the limit or lower --cache-max-open"


class PieceDirectory:
    """The files of one cache directory, taken for this process (StoreError if another
    holds it, or it cannot be written)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.pieces = self.directory / "pieces"
        self.tmp = self.directory / "tmp"
        self._lock_fd = self._take()

    def _take(self) -> int:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.pieces.mkdir(exist_ok=True)
            self.tmp.mkdir(exist_ok=True)
            fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StoreError(
                f"cannot use cache directory {self.directory}: {exc.strerror or exc}; "
                "give --cache-dir a directory this server may write"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StoreError(
                f"cache directory {self.directory} is in use by another server; give each "
                "server its own --cache-dir (two would overrun --cache-size)"
            ) from None
        return fd

    def recover(self) -> tuple[int, list[tuple[str, int]]]:
        """Remove temp files (a fetch cut short) and anything not named by a digest:
        (temp files removed, ``(digest, size)`` of the piece files, oldest first)."""
        removed = 0
        for path in self.tmp.iterdir():
            _unlink(path)
            removed += 1
        found: list[tuple[float, str, int]] = []
        for path in self.pieces.iterdir():
            try:
                st = path.stat()
            except OSError:
                continue
            if not _DIGEST_RE.fullmatch(path.name) or not path.is_file():
                _unlink(path)
                continue
            found.append((st.st_mtime, path.name, st.st_size))
        found.sort()
        return removed, [(digest, size) for _, digest, size in found]

    def verify(self, ref: PieceRef) -> bool:
        """True if the file of ``ref`` is here and hashes right; a bad one is removed."""
        final = self.pieces / ref.digest
        if not final.exists():
            return False
        try:
            data = final.read_bytes()
        except OSError:
            data = b""
        if len(data) == ref.size and piece_digest(data) == ref.digest:
            return True
        _unlink(final)
        return False

    def install(self, ref: PieceRef, data: bytes) -> None:
        """Write the verified bytes of ``ref`` into place: CacheDiskFull if the disk has
        no room, PieceUnreadable if it refuses otherwise (the message a trainer may see
        names no path: the log does)."""
        temp = self.tmp / f"{ref.digest}.{uuid.uuid4().hex[:8]}{_TEMP_SUFFIX}"
        try:
            with open(temp, "wb") as f:
                f.write(data)
            os.rename(temp, self.pieces / ref.digest)
        except OSError as exc:
            _unlink(temp)
            log.error("cannot write %s to the cache %s: %s", ref.url, self.directory, exc)
            kind = CacheDiskFull if exc.errno in _NO_SPACE else PieceUnreadable
            raise kind(
                f"cannot write a piece of {ref.url} to the server's cache: "
                f"{exc.strerror or exc}; the operator should check the disk under --cache-dir"
            ) from exc

    def open(self, digest: str) -> int:
        """A read-only descriptor of the piece file ``digest`` (the errors name no path:
        the log does)."""
        path = self.pieces / digest
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            log.error("cannot open the cached piece %s: %s", path, exc)
            if exc.errno in _NO_DESCRIPTORS:
                raise CacheOutOfDescriptors(
                    f"the server cannot open a cached piece: {OUT_OF_DESCRIPTORS}"
                ) from exc
            raise StoreError(
                f"the cached piece {digest} is unreadable: {exc.strerror or exc}; something "
                "else changed the server's cache directory: the operator should restart it"
            ) from exc

    def remove(self, digest: str) -> None:
        """Delete the piece file ``digest`` (absent: nothing)."""
        _unlink(self.pieces / digest)

    def disk_bytes(self) -> int:
        """Bytes of every file under the directory now (temp files included)."""
        total = 0
        for sub in (self.pieces, self.tmp):
            for path in sub.iterdir():
                with contextlib.suppress(OSError):
                    total += path.stat().st_size
        return total

    def release(self) -> None:
        """Give the directory up (another server may take it)."""
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.warning("cannot remove %s: %s", path, exc)
