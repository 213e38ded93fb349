"""Plan-driven prefetch: the pieces each active job will read next, fetched ahead.

A plan is a pure function of the stream position, so the server knows what a job reads
next without being told: :meth:`Plan.block_spans <tokenfeed.plan.Plan.block_spans>`
gives the token spans of the block being served and of the next one. Their pieces are
handed to the cache as *wanted* (:meth:`PieceCache.want
<tokenfeed_server.store.cache.PieceCache.want>`): fetched ahead into free room, and
evicted only after every piece no plan wants. So a trainer warmed up on a block shuffle
never waits on object storage: the next block is in before it is read.

With the global shuffle any stretch of the stream reads the whole dataset: it is wanted
whole when it fits in the cache (fetched at the job's start, then served from disk),
else not at all (read on demand, piece by piece).

The data plane calls :meth:`Prefetcher.update` from its housekeeping, a few times a
second, on its own thread; it only computes spans and hands a list to the cache.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Protocol

from tokenfeed.plan import Plan
from tokenfeed_server.store.cache import PieceCache
from tokenfeed_server.store.pieces import PieceRange, WantedPieces
from tokenfeed_server.store.reader import Dataset
from tokenfeed_server.store.remote import RemoteDataset

__all__ = ["ACTIVE_S", "REFRESH_S", "PrefetchJob", "Prefetcher", "most_that_fit", "wanted_ranges"]

#: Default of ``active_s``: a job that asked nothing for this long is not prefetched for.
ACTIVE_S = 120.0
#: Default of ``refresh_s``: the wanted pieces are handed again at least this often, so
#: that wanted pieces evicted meanwhile (room made for a request) are fetched again.
REFRESH_S = 5.0


class _Source(Protocol):
    @property
    def dataset(self) -> Dataset: ...

    @property
    def plan(self) -> Plan: ...


class _Feed(Protocol):
    @property
    def sources(self) -> Sequence[_Source]: ...

    def source_positions(self, position: int) -> list[int]: ...


class PrefetchJob(Protocol):
    """What the prefetcher reads of a data-plane job."""

    @property
    def feed(self) -> _Feed: ...

    position: int
    last_active: float


def wanted_ranges(
    dataset: Dataset, plan: Plan, position: int, capacity: int, *, blocks: int = 2
) -> list[PieceRange]:
    """The piece ranges of ``dataset`` that ``plan`` reads from stream ``position`` on:
    the current block's first, then the next ``blocks - 1``; for the global shuffle the
    whole dataset if it fits in ``capacity`` bytes, else nothing."""
    if not isinstance(dataset, RemoteDataset) or not dataset.digests_ready():
        return []  # (version 3: its digests are on their way; planned once here)
    if plan.shuffle == "global":
        if dataset.nbytes <= capacity:
            return [(dataset, 0, len(dataset.pieces))]
        return []
    out: list[PieceRange] = []
    seen: set[tuple[int, int]] = set()
    for n in range(1, blocks + 1):  # a span of block 1 comes again in blocks 1..2: once
        for start, stop in plan.block_spans(position, n):
            first, end = dataset.piece_range(start, stop)
            if (first, end) not in seen and end > first:
                seen.add((first, end))
                out.append((dataset, first, end))
    return out


def most_that_fit(ds: RemoteDataset, first: int, top: int, room: int) -> int:
    """The largest ``hi`` in ``[first, top]`` whose pieces ``[first, hi)`` take at most
    ``room`` bytes (a binary search: the bytes grow with ``hi``)."""
    lo, hi = first, top
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ds.range_bytes(first, mid) <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _subtract(first: int, end: int, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[first, end)`` less the ``covered`` ranges."""
    parts = [(first, end)]
    for lo, hi in covered:
        parts = [
            piece
            for a, b in parts
            for piece in ((a, min(b, lo)), (max(a, hi), b))
            if piece[1] > piece[0]
        ]
    return parts


class Prefetcher:
    """Tells ``cache`` which pieces the active jobs read next (see the module docstring).

    At most ``share`` of the cache is wanted at once, so pieces that requests wait for
    always find room without evicting what the next block needs. The server takes the
    knobs from its settings (:class:`~tokenfeed_server.config.CacheSettings`).
    """

    def __init__(
        self,
        cache: PieceCache,
        *,
        blocks: int = 2,
        share: float = 0.75,
        active_s: float = ACTIVE_S,
        refresh_s: float = REFRESH_S,
    ) -> None:
        self.cache = cache
        self.blocks = blocks
        self.budget = int(cache.capacity * share)
        self.active_s = active_s
        self.refresh_s = refresh_s
        self._last: list[tuple[int, int, int]] | None = None
        self._last_sent = 0.0

    def update(self, jobs: Iterable[PrefetchJob], now: float | None = None) -> None:
        """Recompute the wanted pieces; hand them to the cache when they changed."""
        now = time.monotonic() if now is None else now
        ranges: list[PieceRange] = []
        owners: list[str] = []  # the job of each range (its fetches are charged to it)
        for job in jobs:
            if now - job.last_active > self.active_s:
                continue
            feed = job.feed
            for source, pos in zip(feed.sources, feed.source_positions(job.position), strict=True):
                found = wanted_ranges(
                    source.dataset, source.plan, pos, self.cache.capacity, blocks=self.blocks
                )
                ranges.extend(found)
                # charged to the job by id (a view without one: to nobody)
                owners.extend([str(getattr(job, "id", ""))] * len(found))
        key = [(id(ds), a, b) for ds, a, b in ranges]
        if key == self._last:
            if now - self._last_sent >= self.refresh_s:
                self._last_sent = now
                self.cache.refresh_wanted()
            return
        self._last, self._last_sent = key, now
        # Disjoint ranges (two jobs on one dataset want it once), most urgent first, within
        # the budget (the pieces' exact sizes: a shard smaller than a piece is one short one).
        chosen: list[PieceRange] = []
        chosen_owners: list[tuple[int, str]] = []
        covered: dict[int, list[tuple[int, int]]] = {}
        total = 0
        for (ds, first, end), owner in zip(ranges, owners, strict=True):
            for lo, top in _subtract(first, end, covered.get(id(ds), [])):
                hi = top
                if total + ds.range_bytes(lo, hi) > self.budget:
                    hi = most_that_fit(ds, lo, top, self.budget - total)
                if hi <= lo:
                    continue
                chosen.append((ds, lo, hi))
                chosen_owners.append((hi - lo, owner))
                covered.setdefault(id(ds), []).append((lo, hi))
                total += ds.range_bytes(lo, hi)
        wanted = WantedPieces(chosen)
        self.cache.want(wanted, wanted.digests(), chosen_owners)
