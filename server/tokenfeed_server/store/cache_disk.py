"""The piece cache's disk chores, off the data plane's loop: unlinking evicted pieces, and
shrinking the cache when the real disk fills.

Evictions happen under the cache's lock, often on the loop thread (a request's admission
makes room); unlinking a file can take long (a big file's blocks freed, a slow or
networked disk), so the index only names the evicted pieces
(:attr:`~tokenfeed_server.store.piece_index.PieceIndex.doomed`) and :class:`DiskKeeper`
unlinks them on its own thread. A fetcher drains what is left before it checks or writes
a piece (:meth:`DiskKeeper.drain`), so a piece evicted and fetched again is never unlinked
after its new file is in place, and the files on disk never exceed the bytes accounted.

``--cache-size`` is a promise the disk may not keep (other files fill it). Every few
seconds, and whenever a piece cannot be written for lack of space (ENOSPC, EDQUOT), the
cache's effective capacity becomes at most what it holds plus the free space less a small
reserve: unpinned pieces are evicted down to it, requests wait for room instead of
failing, and the capacity comes back by itself when space does. Logged once per episode.
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from tokenfeed_server.store.cache_policy import PieceEntry
from tokenfeed_server.store.errors import CacheDiskFull
from tokenfeed_server.store.piece_files import PieceDirectory
from tokenfeed_server.store.piece_index import PieceIndex
from tokenfeed_server.store.pieces import PieceRef

__all__ = ["CHECK_S", "RESERVE_BYTES", "DiskKeeper", "DiskUsage"]

log = logging.getLogger(__name__)

#: Seconds between two looks at the disk's free space.
CHECK_S = 2.0
#: The free space kept on the cache's disk: this, or a fiftieth of a smaller disk.
RESERVE_BYTES = 256 << 20
_INSTALL_TRIES = 3


class DiskUsage(NamedTuple):
    """What :func:`shutil.disk_usage` says (injectable for tests)."""

    total: int
    used: int
    free: int


class DiskKeeper:
    """Unlinks evicted pieces and fits the cache to its disk (see the module docstring).

    ``lock`` is the cache's; ``index`` and ``files`` its accounting and directory;
    ``queued`` returns the queued prefetches (dropped first when shrinking) and
    ``grown`` is called (lock held) when room came back, so waiting requests are admitted.
    """

    def __init__(
        self,
        lock: threading.Lock,
        index: PieceIndex,
        files: PieceDirectory,
        *,
        queued: Callable[[], Sequence[PieceEntry]],
        grown: Callable[[], None],
        disk_usage: Callable[[Path], DiskUsage] | None = None,
        check_s: float = CHECK_S,
    ) -> None:
        self.lock, self.index, self.files = lock, index, files
        self._queued, self._grown = queued, grown
        self._usage = disk_usage or _disk_usage
        self.check_s = check_s
        self._unlinked = threading.Condition(lock)
        self._unlinking = 0
        self._pending = threading.Event()
        self._stop = threading.Event()
        self._shrunk = False
        self._thread = threading.Thread(target=self._run, name="tokenfeed-cache-disk", daemon=True)

    def start(self) -> DiskKeeper:
        """Start the background thread."""
        self._thread.start()
        return self

    def evicted(self) -> None:
        """A piece was evicted: its file is to be unlinked soon (no lock needed)."""
        self._pending.set()

    def stop(self) -> None:
        """Stop the thread (after one last drain)."""
        self._stop.set()
        self._pending.set()
        self._thread.join(5.0)
        self.drain()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._pending.wait(self.check_s)
            self._pending.clear()
            try:
                self.drain()
                if not self._stop.is_set():
                    self.check()
            except Exception:  # a bug must not end the chores
                log.exception("cache %s: disk chores failed", self.files.directory)

    # -- unlinking ---------------------------------------------------------------------

    def drain(self) -> None:
        """Unlink every evicted piece's file, and wait for those another thread unlinks."""
        with self.lock:
            batch = self.index.take_doomed()
            self._unlinking += len(batch)
        for digest in batch:
            self.files.remove(digest)
        with self.lock:
            self._unlinking -= len(batch)
            if not self._unlinking:
                self._unlinked.notify_all()
            while self._unlinking:
                self._unlinked.wait()

    # -- space -------------------------------------------------------------------------

    def install(self, ref: PieceRef, data: bytes) -> None:
        """Write a verified piece into place; on a full disk shrink the cache and try
        again (CacheDiskFull when nothing more can go)."""
        for attempt in range(1, _INSTALL_TRIES + 1):
            try:
                self.files.install(ref, data)
                return
            except CacheDiskFull:
                if attempt == _INSTALL_TRIES:
                    raise
                self.check(need=len(data))

    def check(self, need: int = 0) -> None:
        """Fit the effective capacity to the disk: what the cache holds plus the free
        space less the reserve (and ``need`` bytes less than now, after a write that
        failed for lack of space); unlink what that evicts."""
        try:
            usage = self._usage(self.files.directory)
        except OSError as exc:
            log.debug("cache %s: disk usage unknown: %s", self.files.directory, exc)
            return
        reserve = min(RESERVE_BYTES, usage.total // 50)
        with self.lock:
            index = self.index
            fits = index.resident_bytes + usage.free - reserve
            if need:
                fits = min(fits, index.used - need)
            target = max(0, min(index.limit, fits))
            if target < index.capacity:
                index.shrink(target, self._queued())
                self._log_shrunk(usage.free, target)
            elif target > index.capacity:
                index.capacity = target
                self._grown()
                if target == index.limit and self._shrunk:
                    self._shrunk = False
                    log.warning(
                        "cache %s: the disk has room again: the cache may hold its "
                        "--cache-size of %d bytes again", self.files.directory, index.limit,
                    )  # fmt: skip
        if index.doomed:
            self.drain()

    def _log_shrunk(self, free: int, target: int) -> None:
        if self._shrunk:
            return
        self._shrunk = True
        log.warning(
            "cache %s: the disk is nearly full (%d bytes free): the cache holds at most %d "
            "bytes instead of its --cache-size of %d until space comes back (requests wait "
            "for room meanwhile); free space on that disk, or lower --cache-size",
            self.files.directory, free, target, self.index.limit,
        )  # fmt: skip


def _disk_usage(path: Path) -> DiskUsage:
    total, used, free = shutil.disk_usage(path)
    return DiskUsage(total, used, free)
