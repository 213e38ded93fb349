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
* **How big a request may be** (:func:`rows_per_request`, counting the distinct pieces
  a request really needs), the one refusal a small cache makes (:func:`one_row_fits`),
  and what a global shuffle through a cache smaller than its dataset costs
  (:func:`read_amplification`, :func:`amplification_refusal`).
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
    "amplification_refusal",
    "choose_victims",
    "one_row_fits",
    "prefetch_step",
    "read_amplification",
    "request_too_big",
    "row_pieces_worst",
    "rows_per_request",
    "span_pieces",
    "unique_refs",
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
    owner: str = ""  # the job its fetch is charged to (see cache_ledger)


def unique_refs(refs: Iterable[PieceRef]) -> list[PieceRef]:
    """``refs`` without repeats (by digest), in first-seen order."""
    seen: dict[str, PieceRef] = {}
    for ref in refs:
        seen.setdefault(ref.digest, ref)
    return list(seen.values())


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
    capacity: int,
    piece_bytes: int,
    row_bytes: int,
    dataset_bytes: int | None = None,
    *,
    span_pieces: int | None = None,
) -> int:
    """The most rows of ``row_bytes`` one request should read so that the pieces (of
    ``piece_bytes``) it really needs fit in half a cache of ``capacity`` bytes (at least
    1). A dataset of ``dataset_bytes`` that fits in the cache whole allows any number
    (:data:`UNLIMITED_ROWS`): no request can need more than all its pieces, and
    admission is all or nothing, so requests of other jobs wait for room rather than fail.

    The count is of distinct pieces, as a request needs them: a row needs one piece, or
    two for the few that start near a piece's end (``1 + (row_bytes - 1) / piece_bytes``
    on average, not two each), and rows that share a piece share it. ``span_pieces``, when
    given, bounds the pieces the rows of one request can fall in (a block shuffle's
    request reads within two blocks): if they fit, any number of rows does.
    A request that needs more than this anyway (bad luck) is read in rounds that fit
    (:mod:`~tokenfeed_server.store.cache_rounds`): never refused, never different data.
    """
    if dataset_bytes is not None and dataset_bytes <= capacity:
        return UNLIMITED_ROWS
    budget = capacity // 2
    if span_pieces is not None and span_pieces * piece_bytes <= budget:
        return UNLIMITED_ROWS
    per_row = 1.0 + (max(1, row_bytes) - 1) / piece_bytes
    return max(1, int((budget // piece_bytes) / per_row))


def request_too_big(pieces: int, need: int, capacity: int) -> str:
    """Why a read of ``pieces`` pieces (``need`` bytes) cannot be admitted at once."""
    return (
        f"one read needs {pieces} pieces ({need} bytes) in the cache at once, more than "
        f"--cache-size={capacity} bytes; raise --cache-size"
    )


def span_pieces(span_bytes: int, piece_bytes: int) -> int:
    """Pieces that ``span_bytes`` of consecutive file bytes can touch (one more than they
    fill: the span may start anywhere in a piece)."""
    return -(-span_bytes // piece_bytes) + 1


def row_pieces_worst(row_bytes: int, piece_bytes: int) -> int:
    """The most pieces one row of ``row_bytes`` within one shard can need at once (it may
    start anywhere in a piece). A row across a shard's end may need one more: checked
    when it is read (:mod:`~tokenfeed_server.store.cache_rounds`), not refused ahead for
    a case that rare."""
    return span_pieces(row_bytes, piece_bytes)


def one_row_fits(capacity: int, piece_bytes: int, row_bytes: int) -> str | None:
    """None if the pieces of any one row fit in a cache of ``capacity`` bytes; else why
    not, naming the setting (the one case a small cache must refuse: a row is read whole,
    from pieces all in the cache at once)."""
    need = row_pieces_worst(row_bytes, piece_bytes)
    if need * piece_bytes <= capacity:
        return None
    return (
        f"one row of {row_bytes} bytes can need {need} pieces of {piece_bytes} bytes in the "
        f"cache at once ({need * piece_bytes} bytes), more than the whole cache "
        f"(--cache-size={capacity} bytes); raise --cache-size to at least "
        f"{need * piece_bytes}, or use a shorter seq_len"
    )


def read_amplification(
    dataset_bytes: int, capacity: int, piece_bytes: int, row_bytes: int
) -> float:
    """Bytes fetched from object storage per byte served, expected for a global shuffle
    over a dataset of ``dataset_bytes`` through a cache of ``capacity`` bytes: a row is in
    the cache with the chance ``capacity / dataset_bytes``; otherwise its pieces (one, or
    two near a piece's end) are fetched whole for its ``row_bytes``."""
    if dataset_bytes <= capacity:
        return 1.0  # every piece fetched once, then served from the cache
    miss = 1.0 - capacity / dataset_bytes
    per_row = 1.0 + (max(1, row_bytes) - 1) / piece_bytes
    return max(1.0, miss * per_row * piece_bytes / max(1, row_bytes))


def amplification_refusal(
    dataset: str, dataset_bytes: int, capacity: int, piece_bytes: int, row_bytes: int
) -> str | None:
    """Why a global shuffle of remote ``dataset`` is refused (None: its cache holds it):
    the numbers, and the two fixes, and how to ask for it anyway."""
    if dataset_bytes <= capacity:
        return None
    amp = read_amplification(dataset_bytes, capacity, piece_bytes, row_bytes)
    return (
        f"a global shuffle of {dataset!r} ({dataset_bytes} bytes in object storage) through "
        f"the server's cache of {capacity} bytes (--cache-size) would fetch about "
        f"{amp:.0f} bytes from storage per byte served (each {row_bytes}-byte row misses "
        f"the cache with chance {1 - capacity / dataset_bytes:.2f} and then brings a "
        f"{piece_bytes}-byte piece): use shuffle='block' (reads the dataset in cached "
        f"blocks, about 1x), or ask the operator for --cache-size of at least "
        f"{dataset_bytes}; to accept the amplification, pass "
        "allow_read_amplification=True to TokenFeedDataset"
    )
