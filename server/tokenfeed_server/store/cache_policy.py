"""The piece cache's policy: what to keep, what to evict, what to fetch next.

Pure: no threads, no files, no clock (times are passed in), so every rule is unit-tested
on its own (``tests/test_store_cache_policy.py``); :mod:`~tokenfeed_server.store.cache`
is the mechanism that applies it under its lock.

The rules:

* **Eviction order** (:class:`EvictionOrder`): pieces the prefetch plan does not want go
  first (those it has just stopped wanting before all others, then the least recently
  read), then pieces it wants (least recently read first). A pinned piece (a request
  waits for it) or a protected one (the request being admitted needs it) never goes.
* **Making room** (:func:`choose_victims`): queued prefetches (room reserved, no file
  yet) are cancelled before any file is evicted; nothing is chosen unless the whole
  request then fits (admission is all or nothing).
* **What to fetch next** (:func:`prefetch_step`): wanted pieces in plan order, skipping
  those here or on their way and those found missing or damaged within the last few
  seconds (:class:`FailureMemory`; unreachable storage is never remembered: its fetch is
  still going, or gave up with nobody waiting).
* **How big a request may be** (:func:`rows_per_request`).
"""

from __future__ import annotations

import collections
import enum
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from tokenfeed_server.store.pieces import PieceRef

if TYPE_CHECKING:
    from tokenfeed_server.store.waiters import StorageFault, Waiter

__all__ = [
    "FETCHING",
    "IDLE",
    "QUEUED",
    "RESIDENT",
    "UNLIMITED_ROWS",
    "EvictionOrder",
    "FailureMemory",
    "PieceEntry",
    "Step",
    "choose_victims",
    "prefetch_step",
    "rows_per_request",
]

#: :func:`rows_per_request` when a request cannot outgrow the cache.
UNLIMITED_ROWS = 1 << 62

# A piece's states (plain ints: compared once per piece on the read path).
IDLE = 0  # a file found at start-up, not verified yet (or an entry dropped)
QUEUED = 1  # room reserved, waiting for a fetcher
FETCHING = 2
RESIDENT = 3  # verified, on disk


@dataclass(eq=False)
class PieceEntry:
    """What the cache knows of one piece: where it is in its life, and who needs it."""

    ref: PieceRef | None  # None: a file found at start-up (no source known)
    size: int
    digest: str
    state: int
    pins: int = 0
    demand: bool = False  # queued for a waiting request (else: prefetch)
    waiters: list[Waiter] = field(default_factory=list)
    fault: StorageFault | None = None  # its fetch retries storage that does not answer


def _drain(it: Iterable[object]) -> None:
    """Run an iterator to its end (in C)."""
    collections.deque(it, maxlen=0)


class EvictionOrder:
    """The pieces on disk that may be evicted, least recently read first, in two orders:
    those the prefetch plan does not want (evicted first) and those it wants; so making
    room never scans a cache full of wanted pieces. Sizes are kept per order."""

    def __init__(self) -> None:
        self.unwanted: collections.OrderedDict[str, PieceEntry] = collections.OrderedDict()
        self.wanted: collections.OrderedDict[str, PieceEntry] = collections.OrderedDict()
        self.unwanted_bytes = 0
        self.wanted_bytes = 0
        #: The digests the plan wants now.
        self.plan: set[str] = set()

    def __len__(self) -> int:
        return len(self.unwanted) + len(self.wanted)

    def add(self, entry: PieceEntry) -> None:
        """``entry`` is on disk and evictable: the most recently read of its order."""
        if entry.digest in self.plan:
            self.wanted[entry.digest] = entry
            self.wanted_bytes += entry.size
        else:
            self.unwanted[entry.digest] = entry
            self.unwanted_bytes += entry.size

    def remove(self, digest: str) -> None:
        """Take ``digest`` out of either order (absent: nothing)."""
        entry = self.unwanted.pop(digest, None)
        if entry is not None:
            self.unwanted_bytes -= entry.size
            return
        entry = self.wanted.pop(digest, None)
        if entry is not None:
            self.wanted_bytes -= entry.size

    def touch(self, digests: Sequence[str]) -> None:
        """The pieces ``digests`` (all in an order) were just read."""
        # Per piece, the loops run in C (map, filter, a zero-length deque draining them):
        # a request of a global shuffle touches a piece per row.
        plan = self.plan
        _drain(map(self.wanted.move_to_end, filter(plan.__contains__, digests)))
        _drain(map(self.unwanted.move_to_end, itertools.filterfalse(plan.__contains__, digests)))

    def set_plan(self, wanted: set[str]) -> None:
        """The plan now wants ``wanted``: only the pieces whose status changed move (cheap
        next to the cache). No longer wanted (a block the plan has passed) go to the front
        of the unwanted order, evicted first; newly wanted to the end of the wanted one."""
        if wanted == self.plan:
            return
        dropped, added = self.plan - wanted, wanted - self.plan
        self.plan = wanted
        for digest in dropped:
            entry = self.wanted.pop(digest, None)
            if entry is not None:
                self.unwanted[digest] = entry
                self.unwanted.move_to_end(digest, last=False)
                self.wanted_bytes -= entry.size
                self.unwanted_bytes += entry.size
        for digest in added:
            entry = self.unwanted.pop(digest, None)
            if entry is not None:
                self.wanted[digest] = entry
                self.unwanted_bytes -= entry.size
                self.wanted_bytes += entry.size

    def evictable_bytes(self, *, evict_wanted: bool) -> int:
        """Bytes of the pieces that may go (pinned ones included: an upper bound)."""
        return self.unwanted_bytes + (self.wanted_bytes if evict_wanted else 0)

    def candidates(self, *, evict_wanted: bool) -> Iterator[PieceEntry]:
        """The pieces in eviction order: every unwanted one, then (if allowed) wanted."""
        yield from self.unwanted.values()
        if evict_wanted:
            yield from self.wanted.values()


def choose_victims(
    nbytes: int,
    free: int,
    queued: Sequence[PieceEntry],
    order: EvictionOrder,
    protect: set[str],
    *,
    evict_wanted: bool,
) -> list[PieceEntry] | None:
    """The entries to drop so that ``nbytes`` more fit in ``free`` bytes: queued
    prefetches first (``queued``: room reserved, no file), then pieces in eviction order;
    never a pinned or ``protect``-ed piece, nor (unless ``evict_wanted``) a wanted one.
    None if even all of them would not make room ([] if it fits already)."""
    if nbytes <= free:
        return []
    held = sum(e.size for e in queued if e.state == QUEUED and not e.pins)
    if free + held + order.evictable_bytes(evict_wanted=evict_wanted) < nbytes:
        return None  # cannot fit even evicting everything allowed: no scan
    victims: list[PieceEntry] = []
    for entry in queued:
        if free >= nbytes:
            break
        if entry.state == QUEUED and not entry.pins and entry.digest not in protect:
            if entry.digest in order.plan and not evict_wanted:
                continue
            victims.append(entry)
            free += entry.size
    if free < nbytes:
        for entry in order.candidates(evict_wanted=evict_wanted):
            if entry.pins or entry.digest in protect:
                continue
            victims.append(entry)
            free += entry.size
            if free >= nbytes:
                break
    return victims if free >= nbytes else None


class Step(enum.Enum):
    """What the prefetcher does with the next wanted piece."""

    SKIP = "skip"  # here, on its way, or failed recently: next
    REPLACE = "replace"  # a file of another size under its digest: evict it, then decide
    VERIFY = "verify"  # a file found at start-up: hash it before first use
    FETCH = "fetch"  # not here: reserve room and queue the fetch


def prefetch_step(entry: PieceEntry | None, ref: PieceRef, *, failed_recently: bool) -> Step:
    """What to do for the wanted piece ``ref``, whose entry is ``entry`` (None: unknown)."""
    if entry is not None and entry.state != IDLE:
        return Step.SKIP
    if entry is not None:
        return Step.REPLACE if entry.size != ref.size else Step.VERIFY
    return Step.SKIP if failed_recently else Step.FETCH


E = TypeVar("E")


class FailureMemory(Generic[E]):
    """The pieces found missing or damaged within the last ``ttl_s`` seconds, and why:
    answered at once instead of fetched again (a request retried at once would only find
    them so again), yet briefly, so that a restored object is served within seconds."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._failed: dict[str, tuple[E, float]] = {}

    def __len__(self) -> int:
        return len(self._failed)

    def remember(self, digest: str, error: E, now: float) -> None:
        """``digest`` failed with ``error`` at ``now``."""
        self._failed[digest] = (error, now)

    def recent(self, digest: str, now: float) -> E | None:
        """The error of ``digest`` if it failed less than ``ttl_s`` before ``now`` (an
        older failure is forgotten)."""
        failed = self._failed.get(digest)
        if failed is None:
            return None
        if now - failed[1] < self.ttl_s:
            return failed[0]
        del self._failed[digest]
        return None


def rows_per_request(
    capacity: int, piece_bytes: int, row_bytes: int, dataset_bytes: int | None = None
) -> int:
    """The most rows of ``row_bytes`` one request may read so that its pieces (of
    ``piece_bytes``) fit in half a cache of ``capacity`` bytes at once, whatever rows it
    reads (at least 1). A dataset of ``dataset_bytes`` that fits in the cache whole allows
    any number (:data:`UNLIMITED_ROWS`): no request can need more than all its pieces, and
    admission is all or nothing, so requests of other jobs wait for room rather than fail."""
    if dataset_bytes is not None and dataset_bytes <= capacity:
        return UNLIMITED_ROWS
    # a row may start anywhere in a piece: it can touch one piece more than it fills
    per_row = (-(-row_bytes // piece_bytes) + 1) * piece_bytes
    return max(1, (capacity // 2) // per_row)
