"""What the piece cache holds: one entry per piece here, on its way or reserved, the
bytes they take, the eviction order and the open descriptors.

The accounting half of the cache's mechanism (:mod:`~tokenfeed_server.store.cache` has
the threads, the pins and the waiting requests). Not thread-safe: the cache's lock
guards every call. Every byte of an entry counts from the moment its room is reserved
until it is dropped or evicted, so :attr:`PieceIndex.used` never exceeds the capacity.

Nothing here touches the disk's directory: an evicted piece's file is only named in
:attr:`PieceIndex.doomed`, and unlinked by a background thread
(:mod:`~tokenfeed_server.store.cache_disk`), since evictions happen on the data plane's
loop thread, which must not wait on the file system. The capacity is the effective one:
:attr:`PieceIndex.limit` (``--cache-size``) or less while the disk is nearly full.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Callable, Sequence

from tokenfeed_server.store.cache_policy import (
    IDLE,
    QUEUED,
    RESIDENT,
    EvictionOrder,
    PieceEntry,
    choose_victims,
)
from tokenfeed_server.store.cache_stats import CacheStats
from tokenfeed_server.store.piece_files import PieceDirectory
from tokenfeed_server.store.pieces import PieceRef

__all__ = ["PieceIndex"]


class PieceIndex:
    """The entries of a cache of ``capacity`` bytes over the files ``files``; at most
    ``max_open`` piece files stay open (more while one read needs them). ``on_evict`` is
    called (lock held) when a file is to be unlinked (:attr:`doomed`)."""

    def __init__(
        self,
        capacity: int,
        files: PieceDirectory,
        max_open: int,
        on_evict: Callable[[], None] = lambda: None,
    ) -> None:
        #: the most bytes the cache may hold (--cache-size)
        self.limit = capacity
        #: the most it holds now: :attr:`limit`, or less while the disk is nearly full
        self.capacity = capacity
        #: digests of evicted pieces whose files are not unlinked yet
        self.doomed: list[str] = []
        self._on_evict = on_evict
        self.files = files
        self.max_open = max_open
        self.entries: dict[str, PieceEntry] = {}
        #: Pieces on disk that may be evicted when unpinned, in the policy's order.
        self.order = EvictionOrder()
        self.open: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.used = 0  # bytes of every entry: on disk, being written, or reserved
        self.resident_bytes = 0  # of verified pieces (kept as counts: stats are O(1))
        self.resident_count = 0
        self.stats = CacheStats()

    def recover(self) -> int:
        """Take over the piece files of an earlier run (hashed before their first use),
        evicting the oldest past the capacity; the temp files removed."""
        removed, found = self.files.recover()
        for digest, size in found:
            entry = PieceEntry(None, size, digest, IDLE)
            self.entries[digest] = entry
            self.order.add(entry)
            self.used += size
        while self.used > self.capacity and self.order.unwanted:  # the size was lowered
            self.evict(next(iter(self.order.unwanted.values())))
        return removed

    def is_resident(self, digest: str) -> bool:
        """True if the piece ``digest`` is here, verified."""
        entry = self.entries.get(digest)
        return entry is not None and entry.state == RESIDENT

    def reserve(self, ref: PieceRef, *, demand: bool) -> PieceEntry:
        """A new queued entry for ``ref``, its room taken (made by the caller)."""
        entry = PieceEntry(ref, ref.size, ref.digest, QUEUED, demand=demand)
        self.entries[ref.digest] = entry
        self.used += entry.size
        return entry

    def descriptors(self, digests: Sequence[str]) -> list[int]:
        """Open descriptors of the resident pieces ``digests``, in order."""
        opened = self.open
        fds: list[int | None] = list(map(opened.get, digests))
        if None in fds:
            for i, digest in enumerate(digests):
                if fds[i] is None:
                    # looked up again: one digest may come twice (identical pieces)
                    fd = opened.get(digest)
                    if fd is None:
                        fd = opened[digest] = self.files.open(digest)
                    fds[i] = fd
        collections.deque(map(opened.move_to_end, digests), maxlen=0)  # in C
        # Descriptors of pieces read least recently go first (never one just returned:
        # they were moved to the end).
        excess = len(opened) - max(self.max_open, len(digests))
        while excess > 0:
            _, fd = opened.popitem(last=False)
            os.close(fd)
            excess -= 1
        return fds  # type: ignore[return-value]  # every None was replaced above

    def make_room(
        self, nbytes: int, queued: Sequence[PieceEntry], protect: set[str], *, evict_wanted: bool
    ) -> bool:
        """Evict until ``nbytes`` more fit; False (nothing evicted) if they cannot."""
        victims = choose_victims(
            nbytes, self.capacity - self.used, queued, self.order, protect,
            evict_wanted=evict_wanted,
        )  # fmt: skip
        if victims is None:
            return False
        for entry in victims:
            if entry.state == QUEUED:
                self.drop(entry)
            else:
                self.evict(entry)
        return True

    def drop(self, entry: PieceEntry) -> None:
        """Forget an entry that has no file (queued, or failed): its room comes back."""
        if self.entries.get(entry.digest) is entry:
            del self.entries[entry.digest]
            self.used -= entry.size
        entry.state = IDLE  # a queued copy in a deque is skipped

    def evict(self, entry: PieceEntry) -> None:
        """Remove a piece's entry; its file is unlinked later (:attr:`doomed`)."""
        self.order.remove(entry.digest)
        fd = self.open.pop(entry.digest, None)
        if fd is not None:
            os.close(fd)
        if entry.state != QUEUED:  # a queued entry has no file (make_room drops those)
            self.doomed.append(entry.digest)
            self._on_evict()
        if self.entries.get(entry.digest) is entry:
            del self.entries[entry.digest]
            self.used -= entry.size
            if entry.state == RESIDENT:
                self.resident_bytes -= entry.size
                self.resident_count -= 1
        entry.state = IDLE
        self.stats.evictions += 1

    def take_doomed(self) -> list[str]:
        """The files to unlink now (the caller unlinks them, without the lock)."""
        doomed, self.doomed = self.doomed, []
        return doomed

    def shrink(self, capacity: int, queued: Sequence[PieceEntry]) -> int:
        """Hold at most ``capacity`` bytes from now on: evict unpinned pieces (queued
        prefetches first, then in eviction order) until they fit, or nothing more may go.
        Returns the bytes still over (held by pinned pieces: admission waits for them)."""
        self.capacity = max(0, min(self.limit, capacity))
        for entry in list(queued):
            if self.used <= self.capacity:
                break
            if entry.state == QUEUED and not entry.pins:
                self.drop(entry)
        for entry in list(self.order.candidates(evict_wanted=True)):
            if self.used <= self.capacity:
                break
            if not entry.pins:
                self.evict(entry)
        return max(0, self.used - self.capacity)

    def arrived(self, entry: PieceEntry) -> None:
        """``entry``'s file is in place and verified."""
        entry.state = RESIDENT
        if self.entries.get(entry.digest) is entry:
            self.order.add(entry)
            self.resident_bytes += entry.size
            self.resident_count += 1

    def close_files(self) -> None:
        """Close every open descriptor."""
        for fd in self.open.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.open.clear()
