"""One set of period tables per mixture, shared by its jobs, built off the serving thread.

A mixture's locate tables (:class:`~tokenfeed.order.locate.SegmentTables`: up to
:data:`~tokenfeed_server.store.mixing.MAX_TABLE_ROWS` rows of 16 bytes) take up to
seconds to build. :class:`SharedMixtures` keeps one object per distinct mixture while a
holder lives (a job's feed), so the jobs of one mixture share its tables and the last
holder frees them; and :meth:`SharedMixtures.ready` builds a mixture's tables on a
worker thread of their own, once however many hellos ask for it meanwhile, so the data
plane's loop never spends a turn on them: a hello for a mixture whose tables are not
built is answered with a retryable refusal and the client asks again
(:mod:`tokenfeed_server.dataplane.admission`). Tables of at most
:data:`INLINE_TABLE_ROWS` rows cost less than a retry and are built at once.

The same thread computes a new job's first block of order (a :class:`FirstBlock`: for a
mixture of many sources, 8,192 positions through every source's plan, tens of
milliseconds) into the shared window blocks before the job is admitted, so its first
request finds it cached instead of computing it on the loop.

A finished build holds its mixture until a hello takes it over (the next
:meth:`SharedMixtures.ready` that says yes: its feed holds the tables from then on, and the
job made of it frees them when it closes), or :data:`CLAIM_S` seconds when no hello comes
back for it (:meth:`SharedMixtures.sweep`).
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
import time
import weakref
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from tokenfeed.mixture import Mixture

__all__ = [
    "BUILDER_THREAD",
    "CLAIM_S",
    "INLINE_TABLE_ROWS",
    "FirstBlock",
    "SharedMixtures",
    "shared_mixtures",
    "table_bytes",
    "table_rows",
]

log = logging.getLogger(__name__)

#: Tables of at most this many rows are built on the asking thread (well under a
#: millisecond of work, less than the retry a background build costs the client).
INLINE_TABLE_ROWS = 1024
#: Seconds a finished build keeps its tables for the hello that asked for them, when no
#: job takes them over (the client gave up): then they are freed.
CLAIM_S = 60.0
#: The name of the thread that builds the tables (what ``mixture_table_builds_off_loop``
#: counts: builds on any other thread are ``mixture_table_builds_inline``).
BUILDER_THREAD = "tokenfeed-mixture-tables"


class FirstBlock(Protocol):
    """A job's first block of order, computed by the builder before the job is admitted
    (see :meth:`SharedMixtures.ready`)."""

    @property
    def key(self) -> Hashable:
        """What the block depends on: equal keys are the same block."""
        ...

    def cached(self) -> bool:
        """True when the block is in the shared cache now."""
        ...

    def compute(self) -> None:
        """Compute the block into the shared cache (the mixture's tables built)."""
        ...


def table_rows(mixture: Mixture) -> int:
    """Rows of ``mixture``'s period tables: its distinct weight vectors' periods summed."""
    return sum(sum(weights) for weights in {w for _, w in mixture.segments})


def table_bytes(mixture: Mixture) -> int:
    """What ``mixture``'s tables hold once built: per distinct weight vector one period
    of (source, rank) int64 pairs, and a few int64 per segment and source (starts,
    periods, offsets, weights and rows before each segment, the latter also as Python
    ints)."""
    segments, names = len(mixture.segments), len(mixture.names)
    per_int = sys.getsizeof(1 << 40)  # a Python int of a row count
    return 16 * table_rows(mixture) + segments * (3 * 8 + names * (2 * 8 + per_int))


class SharedMixtures:
    """The mixtures live holders read, one object per distinct mixture (equal mixtures
    map every position alike: equal names and reduced segments), with the bytes of their
    tables counted once (owner ``mixture_tables`` of the memory figures)."""

    def __init__(self, claim_s: float = CLAIM_S) -> None:
        # the shared object and how many holders it has, by mixture
        self._held: dict[Mixture, tuple[Mixture, int]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        # mixtures a build holds: None while building, else when it finished (monotonic)
        self._builds: dict[Mixture, float | None] = {}
        self._claim_s = claim_s
        self._pool: ThreadPoolExecutor | None = None
        self._counts: collections.Counter[str] = collections.Counter()
        # first blocks the builder computes: None while computing, else when it finished
        self._blocks: dict[Hashable, float | None] = {}

    def __len__(self) -> int:
        """Distinct mixtures held now."""
        return len(self._held)

    @property
    def held_bytes(self) -> int:
        """Bytes of the held mixtures' tables, each counted once (see :func:`table_bytes`)."""
        return self._bytes

    def counters(self) -> dict[str, int]:
        """``mixture_table_builds_off_loop`` (built on :data:`BUILDER_THREAD`),
        ``mixture_table_builds_inline`` (small tables, or a mixture used before it was
        made ready), ``mixture_blocks_off_loop`` and ``mixture_blocks_inline`` (blocks of
        a mixture's order computed on the builder, or on another thread: the loop, for
        the later blocks of a job or a job that starts elsewhere than block 0),
        ``mixture_tables_building`` (now) and ``mixtures_held`` (now)."""
        with self._lock:
            building = sum(1 for done in self._builds.values() if done is None)
            out = dict(self._counts)
            held = len(self._held)
        for name in _COUNTERS:
            out.setdefault(name, 0)
        return {**out, "mixture_tables_building": building, "mixtures_held": held}

    # -- holding ---------------------------------------------------------------------

    def hold(self, mixture: Mixture) -> Mixture:
        """The shared object equal to ``mixture``, held (one more holder) until
        :meth:`release_with` sees its owner go."""
        with self._lock:
            return self._take(mixture)

    def release_with(self, owner: object, shared: Mixture) -> None:
        """Release a :meth:`hold` of ``shared`` when ``owner`` is collected (a weak
        reference counts it: whatever drops the owner releases the hold)."""
        # at interpreter exit nothing needs releasing (and the lock may be gone)
        weakref.finalize(owner, self._release, shared).atexit = False

    def _take(self, mixture: Mixture) -> Mixture:
        shared, holders = self._held.get(mixture, (mixture, 0))
        if not holders:
            self._bytes += table_bytes(shared)
        self._held[shared] = (shared, holders + 1)
        return shared

    def _release(self, mixture: Mixture) -> None:
        with self._lock:
            self._drop(mixture)

    def _drop(self, mixture: Mixture) -> None:
        shared, holders = self._held[mixture]
        if holders > 1:
            self._held[mixture] = (shared, holders - 1)
            return
        del self._held[mixture]
        self._bytes -= table_bytes(mixture)

    # -- building --------------------------------------------------------------------

    def ready(self, mixture: Mixture, first: FirstBlock | None = None) -> bool:
        """True when ``mixture``'s tables are built (small ones are built now, on the
        calling thread) and ``first`` (the asking job's first block of order, if given) is
        cached or was just computed for it; else the builder thread is at work on them
        (started now unless another caller started it) and the caller should ask again
        later. A yes hands a finished build's hold to the caller's feed."""
        if not mixture.tables_built and table_rows(mixture) <= INLINE_TABLE_ROWS:
            self.note_build(mixture)
        cached = first is None or first.cached()  # (outside our lock: the cache has its own)
        with self._lock:
            if mixture.tables_built and self._first_ready(first, cached):
                if self._builds.get(mixture) is not None:  # built: the asking feed holds it
                    del self._builds[mixture]
                    self._drop(mixture)
                return True
            if mixture in self._builds or (first is not None and first.key in self._blocks):
                return False  # building, or built into another object that a feed holds
            shared = None
            if not mixture.tables_built:
                shared = self._take(mixture)  # the build holds it: the asking feed may go
                self._builds[shared] = None
            if first is not None:
                self._blocks[first.key] = None
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix=BUILDER_THREAD)
            pool = self._pool
        pool.submit(self._build, shared, first)
        return False

    def _first_ready(self, first: FirstBlock | None, cached: bool) -> bool:
        """No first block asked for, or it is ``cached``, or it was computed for this
        hello (it may have been evicted since: then the job's first request computes it)."""
        if first is None:
            return True
        if self._blocks.get(first.key, None) is not None:
            del self._blocks[first.key]
            return True
        return first.key not in self._blocks and cached

    def note_build(self, mixture: Mixture) -> None:
        """Build ``mixture``'s tables on this thread now (if not built) and count it."""
        if mixture.tables_built:
            return
        mixture.build_tables()
        self._count("mixture_table_builds")

    def note_block(self) -> None:
        """Count a block of a mixture's order computed on this thread."""
        self._count("mixture_blocks")

    def _count(self, what: str) -> None:
        on_builder = threading.current_thread().name.startswith(BUILDER_THREAD)
        with self._lock:
            self._counts[f"{what}_off_loop" if on_builder else f"{what}_inline"] += 1

    def _build(self, shared: Mixture | None, first: FirstBlock | None) -> None:
        """Build ``shared``'s tables (None: built already), then compute ``first``."""
        try:
            if shared is not None:
                self.note_build(shared)
            if first is not None and not first.cached():
                first.compute()
        except Exception:  # a bug; the next hello asks for a build again
            log.exception("building the tables of mixture %r failed", shared)
            with self._lock:
                if shared is not None:
                    del self._builds[shared]
                    self._drop(shared)
                if first is not None:
                    del self._blocks[first.key]
            return
        with self._lock:
            now = time.monotonic()
            if shared is not None:
                self._builds[shared] = now
            if first is not None:
                self._blocks[first.key] = now

    def sweep(self, now: float | None = None) -> None:
        """Let go of finished builds' holds that no hello took over for :data:`CLAIM_S`
        seconds (the client gave up), and of a job's hold taken over meanwhile. Call it
        between hellos (the data plane's housekeeping): a hello's throw-away feed must
        not count as a job's."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for shared, done in list(self._builds.items()):
                if done is None:
                    continue
                if self._held[shared][1] > 1 or now - done >= self._claim_s:
                    del self._builds[shared]
                    self._drop(shared)
            for key, done in list(self._blocks.items()):
                if done is not None and now - done >= self._claim_s:
                    del self._blocks[key]


_COUNTERS = (
    "mixture_table_builds_off_loop",
    "mixture_table_builds_inline",
    "mixture_blocks_off_loop",
    "mixture_blocks_inline",
)


#: The mixtures of every live feed (see :class:`SharedMixtures`).
shared_mixtures = SharedMixtures()
