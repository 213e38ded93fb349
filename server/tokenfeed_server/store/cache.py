"""The local cache of a remote store: verified pieces on disk, fetched in the background.

This module is the mechanism (the lock, the fetch threads, the files, the pins); what to
keep, evict and fetch next is decided by the pure rules of
:mod:`~tokenfeed_server.store.cache_policy`, the files are
:mod:`~tokenfeed_server.store.piece_files`' and one verified fetch is
:mod:`~tokenfeed_server.store.piece_fetch`'s.

The unit is a *piece* of a shard file (:class:`~tokenfeed_server.store.pieces.PieceRef`).
A piece is fetched with one range GET by a small pool of threads, checked against its
digest, written to a temp file and renamed into place.

The cache never holds more than ``capacity`` bytes: a piece's bytes are reserved before
its fetch starts (a temp file being written counts), and room is made by evicting pieces
in the policy's order; never a piece pinned by a request waiting for it. Eviction and
reads take one lock, so a piece is never removed while the data plane reads it.

The data plane's loop never waits on object storage: a read that needs a piece not here
raises :class:`NotResident` before reading anything. The exception carries a
:class:`Waiter`; the cache fetches the missing pieces, pins them, and when the last one
arrives (or one stays unreadable) hands the waiter back through :meth:`PieceCache.completed`
and makes :attr:`PieceCache.wake_fd` readable, so the loop retries the request at once.

A request's pieces are admitted all together or not at all (first come, first served):
an admitted request always completes, so two requests can never each hold half the room
the other needs. Its pins hold until the data plane releases the waiter, after the retried
request was served (:mod:`~tokenfeed_server.dataplane.serving`): under pressure a piece
in place is never evicted before the request that waited for it has read it.

Object storage that does not answer delays requests, never fails them before the budget
(``--storage-retry-s``) is spent: a fetch keeps retrying, its waiters carry the fault
(:mod:`~tokenfeed_server.store.cache_faults`), and no such fault is remembered once the
fetch ends; only missing and damaged pieces are, for ``failure_ttl_s`` (a few seconds).
Disk chores (unlinking evicted files, fitting the cache to a filling disk) run off the
loop (:mod:`~tokenfeed_server.store.cache_disk`). :meth:`PieceCache.close` answers every
waiting request (the server stops: retryable).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tokenfeed.errors import StoreError
from tokenfeed_server.store.cache_disk import DiskKeeper, DiskUsage
from tokenfeed_server.store.cache_faults import Faults, failure_key, reroute
from tokenfeed_server.store.cache_fetch import FetchPool
from tokenfeed_server.store.cache_ledger import FetchLedger
from tokenfeed_server.store.cache_policy import (
    FETCHING,
    IDLE,
    QUEUED,
    RESIDENT,
    UNLIMITED_ROWS,
    FailureMemory,
    PieceEntry,
    Step,
    prefetch_step,
    request_too_big,
    rows_per_request,
    unique_refs,
)
from tokenfeed_server.store.cache_rounds import DEFAULT_MAX_PARTIAL_READ_BYTES
from tokenfeed_server.store.errors import (
    CacheClosed,
    CacheTooSmall,
    PieceDamaged,
    PieceMissing,
    PieceUnreadable,
)
from tokenfeed_server.store.health import StorageHealth
from tokenfeed_server.store.piece_fetch import FetchAbandoned, RetryPolicy
from tokenfeed_server.store.piece_files import PieceDirectory
from tokenfeed_server.store.piece_index import PieceIndex
from tokenfeed_server.store.pieces import PieceRef, PieceSource
from tokenfeed_server.store.waiters import Completions, NotResident, StorageFault, Waiter

__all__ = [
    "UNLIMITED_ROWS",
    "CacheTooSmall",
    "NotResident",
    "PieceCache",
    "PieceRef",
    "PieceSource",
    "PieceUnreadable",
    "StorageFault",
    "Waiter",
]

log = logging.getLogger(__name__)

assert FETCHING > QUEUED  # the states' order is the policy's; FETCHING is set here


class PieceCache:
    """Verified pieces of a remote store in ``directory``, at most ``capacity`` bytes.

    ``source`` serves range reads (an :class:`~tokenfeed_server.store.objects.ObjectStore`).
    ``fetchers`` threads fetch (see :mod:`~tokenfeed_server.store.piece_fetch`): storage
    that does not answer is retried with backoff from ``backoff_s`` for ``retry_s``
    seconds; a missing object is not retried; a piece whose bytes do not match its digest
    is fetched again up to ``mismatch_attempts`` times; any other error ends after
    ``attempts`` GETs. A piece found missing or damaged is answered so at once for
    ``failure_ttl_s`` instead of fetched again. At most ``max_open`` piece files stay
    open; ``max_partial_read_bytes`` bounds the rows kept for reads in rounds. The server
    takes these from its settings (:class:`~tokenfeed_server.config.CacheSettings`,
    ``StorageSettings``); ``disk_usage`` is for tests (a disk that fills).

    Only one process may use a directory (a lock file says so at start).
    """

    def __init__(
        self,
        directory: Path,
        capacity: int,
        source: PieceSource,
        *,
        fetchers: int = 16,
        attempts: int = 3,
        mismatch_attempts: int = 3,
        backoff_s: float = 0.1,
        failure_ttl_s: float = 5.0,
        max_open: int = 1024,
        max_partial_read_bytes: int = DEFAULT_MAX_PARTIAL_READ_BYTES,
        retry_s: float = 900.0,
        disk_usage: Callable[[Path], DiskUsage] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 byte, got {capacity}")
        self.capacity = int(capacity)
        self.max_partial_read_bytes = max_partial_read_bytes  # for the datasets' Rounds
        self.source = source
        self.retry = RetryPolicy(max(1, attempts), max(1, mismatch_attempts), backoff_s, retry_s)
        #: What object storage did for each dataset lately (read by the HTTP side).
        self.health = StorageHealth()
        self.faults = Faults(self.health)
        #: Taken by readers around residency checks and reads, and by every change.
        self.lock = threading.Lock()
        self._work = threading.Condition(self.lock)
        self._init_state(failure_ttl_s)
        self.files = PieceDirectory(directory)
        self.directory = self.files.directory
        self._index = PieceIndex(self.capacity, self.files, max(16, max_open), self._evicted)
        self._entries = self._index.entries  # the same dict: looked up on every read
        self._order = self._index.order
        self._stats = self._index.stats
        self._disk = DiskKeeper(
            self.lock, self._index, self.files, queued=self._queued_prefetches,
            grown=self._room_came_back, disk_usage=disk_usage,
        )  # fmt: skip
        try:
            with self.lock:
                self.removed_at_start = self._index.recover()
            if self.removed_at_start:
                log.info(
                    "cache %s: removed %d temp files of an interrupted fetch",
                    self.directory,
                    self.removed_at_start,
                )
            self._done = Completions()
        except BaseException:
            self.files.release()
            raise
        self._pool = FetchPool(
            self.lock, next_task=self._next_task, finish=self._finish, source=source,
            policy=self.retry, files=self.files, disk=self._disk, faults=self.faults,
            health=self.health, stats=self._stats, fetchers=fetchers,
        )  # fmt: skip
        self._pool.start()
        self._disk.start()

    def _init_state(self, failure_ttl_s: float) -> None:
        self._fetching = 0
        self._demand: collections.deque[PieceEntry] = collections.deque()
        self._prefetch: collections.deque[PieceEntry] = collections.deque()
        self._admission: collections.deque[Waiter] = collections.deque()
        self._failed: FailureMemory[PieceUnreadable] = FailureMemory(failure_ttl_s)
        self._want_list: Sequence[PieceRef] = []
        self._want_digests: list[str] = []
        self._want_cursor = 0
        self._stop = False
        #: bytes fetched per job (the data plane names the job it reads for)
        self.ledger = FetchLedger()

    @property
    def mismatch_attempts(self) -> int:
        """Fetches of bytes failing their digest before the bucket copy is reported bad."""
        return self.retry.mismatch_attempts

    @property
    def failure_ttl_s(self) -> float:
        """Seconds a missing or damaged piece is answered so at once, not fetched again."""
        return self._failed.ttl_s

    # -- start-up --------------------------------------------------------------------

    def rows_per_request(
        self,
        piece_bytes: int,
        row_bytes: int,
        dataset_bytes: int | None = None,
        *,
        span_pieces: int | None = None,
    ) -> int:
        """The most rows of ``row_bytes`` one request should read (see
        :func:`~tokenfeed_server.store.cache_policy.rows_per_request`)."""
        return rows_per_request(
            self.capacity, piece_bytes, row_bytes, dataset_bytes, span_pieces=span_pieces
        )

    # -- the loop's side ---------------------------------------------------------------

    @property
    def wake_fd(self) -> int:
        """A descriptor that turns readable when a waiter is done (poll it; see
        :meth:`completed`)."""
        return self._done.fd

    def completed(self) -> list[Waiter]:
        """The waiters done since the last call (clears the wake descriptor)."""
        if not self._done.clear_wake():
            return []  # closed
        with self.lock:
            return self._done.take()

    def acquire_locked(
        self, digests: Sequence[str], refs: Callable[[], Sequence[PieceRef]]
    ) -> list[int]:
        """Descriptors of the cache files of the pieces ``digests``, in order; the caller
        holds :attr:`lock` and reads them before releasing it.

        Raises :class:`NotResident` (nothing read, the missing pieces on their way) if
        any is not in the cache; ``refs()`` then says where each piece comes from (made
        only then: the common case, every piece here, needs only the digests).
        """
        entries = self._entries
        for digest in digests:
            entry = entries.get(digest)
            if entry is None or entry.state != RESIDENT:
                self._missing(digests, refs)
        self._stats.hits += len(digests)
        self._order.touch(digests)
        return self._index.descriptors(digests)

    def _missing(self, digests: Sequence[str], refs: Callable[[], Sequence[PieceRef]]) -> None:
        """Count a read that misses, ask for its pieces, raise NotResident."""
        resident = sum(map(self._index.is_resident, digests))
        self._stats.hits += resident
        self._stats.misses += len(digests) - resident
        waiter = Waiter(unique_refs(refs()))
        self._request(waiter)
        raise NotResident(self, waiter)

    def release(self, waiter: Waiter) -> None:
        """Unpin the pieces of a waiter whose request was retried (or dropped); safe to
        call twice."""
        with self.lock:
            if waiter.released:
                return
            waiter.released = True
            if not waiter.admitted:
                with contextlib.suppress(ValueError):
                    self._admission.remove(waiter)
            for entry in waiter.pinned:
                entry.pins -= 1
                if entry.digest in waiter.pending:
                    # gone: a fetch nobody waits for any more may give up (see Faults)
                    with contextlib.suppress(ValueError):
                        entry.waiters.remove(waiter)
            waiter.pinned = []
            self._admit_waiting()
            self._schedule_prefetch()

    def fetch_all_blocking(self, refs: Sequence[PieceRef], timeout: float | None = None) -> None:
        """Bring ``refs`` in, blocking (for tools and tests, never the data plane)."""
        waiter = Waiter(unique_refs(refs))
        with self.lock:
            self._request(waiter)
        try:
            if not waiter.wait(timeout):
                raise StoreError(f"timed out fetching {len(refs)} pieces")
            if waiter.error is not None:
                raise waiter.error
        finally:
            self.release(waiter)

    def want(
        self,
        refs: Sequence[PieceRef],
        digests: Sequence[str] | None = None,
        owners: Sequence[tuple[int, str]] = (),
    ) -> None:
        """The pieces the prefetch plan wants, most urgent first (replaces the last call):
        fetched ahead into free room, and evicted after the pieces it does not want.

        ``digests``, if given, are the pieces' digests in the same order: then ``refs``
        may be a lazy sequence (a piece's ref is made only if it must be fetched).
        ``owners``: ``(count, job)`` per stretch of the list, charged its fetches.
        """
        want_digests = list(digests) if digests is not None else [r.digest for r in refs]
        wanted = set(want_digests)
        with self.lock:
            self._want_list = refs
            self._want_digests = want_digests
            self.ledger.set_plan_owners(owners)
            self._order.set_plan(wanted)
            self._want_cursor = 0
            # Queued prefetches no longer wanted give their room back.
            for entry in [e for e in self._prefetch if e.digest not in wanted]:
                if entry.state == QUEUED and not entry.pins:
                    self._index.drop(entry)
            self._prefetch = collections.deque(e for e in self._prefetch if e.state == QUEUED)
            self._schedule_prefetch()

    def refresh_wanted(self) -> None:
        """Look over the wanted pieces again (those evicted for requests since are
        fetched again), without handing a new list."""
        with self.lock:
            self._want_cursor = 0
            self._schedule_prefetch()

    def resident(self, digest: str) -> bool:
        """True if the piece ``digest`` is in the cache, verified."""
        with self.lock:
            return self._index.is_resident(digest)

    def resident_many(self, digests: Sequence[str]) -> list[bool]:
        """:meth:`resident` of each of ``digests``, under one lock."""
        with self.lock:
            return list(map(self._index.is_resident, digests))

    # -- admission (lock held) ---------------------------------------------------------

    def _request(self, waiter: Waiter) -> None:
        need = sum(r.size for r in waiter.refs)
        if need > self.capacity:
            waiter.error = CacheTooSmall(request_too_big(len(waiter.refs), need, self.capacity))
            self._complete(waiter)
            return
        now = time.monotonic()
        for ref in waiter.refs:
            error = self._failed.recent(failure_key(ref), now)
            if error is not None:
                waiter.error = error
                self._complete(waiter)
                return
        if self._admission or not self._admit(waiter):
            self._admission.append(waiter)

    def _admit(self, waiter: Waiter) -> bool:
        """Pin every piece of ``waiter`` and queue the missing ones, if room allows."""
        refs = waiter.refs
        for ref in refs:  # a file found at start-up of another size cannot be the piece
            stale = self._entries.get(ref.digest)
            if stale is not None and stale.state == IDLE and stale.size != ref.size:
                self._index.evict(stale)
        new = sum(r.size for r in refs if r.digest not in self._entries)
        protect = {r.digest for r in refs}
        if not self._index.make_room(new, self._prefetch, protect, evict_wanted=True):
            return False
        waiter.admitted = True
        for ref in refs:
            entry = self._demand_entry(ref)
            entry.pins += 1
            waiter.pinned.append(entry)
            if entry.state != RESIDENT:
                waiter.pending.add(entry.digest)
                entry.waiters.append(waiter)
                self.faults.attach(waiter, entry)
        if not waiter.pending:
            self._complete(waiter)
        self._work.notify_all()
        return True

    def _demand_entry(self, ref: PieceRef) -> PieceEntry:
        """The entry of ``ref``, queued for fetching first unless here or on its way."""
        entry = self._entries.get(ref.digest)
        if entry is None:
            entry = self._index.reserve(ref, demand=True)
            entry.owner = self.ledger.owner
            self._demand.append(entry)
        elif entry.state == IDLE:
            entry.ref = ref
            entry.state = QUEUED
            entry.demand = True
            self._order.remove(entry.digest)
            self._demand.append(entry)
        elif entry.state == QUEUED and not entry.demand:
            entry.demand = True  # a prefetch becomes urgent
            self._demand.append(entry)
        return entry

    def _admit_waiting(self) -> None:
        while self._admission and not self._stop:
            if not self._admit(self._admission[0]):
                return
            self._admission.popleft()

    def _schedule_prefetch(self) -> None:
        """Queue wanted pieces not here yet, in order, while room allows without evicting
        anything the plan wants (and at most a few ahead of the fetchers); none while
        object storage does not answer (the fetchers are for requests then)."""
        now = time.monotonic()
        if self._stop or self.faults.prefetch_paused(now):
            return
        limit = 2 * len(self._pool.threads)
        queued = sum(1 for e in self._prefetch if e.state == QUEUED)
        wants, digests = self._want_list, self._want_digests
        while self._want_cursor < len(digests) and queued < limit:
            entry = self._entries.get(digests[self._want_cursor])
            if entry is not None and entry.state != IDLE:
                self._want_cursor += 1  # here or on its way: no ref needed
                continue
            ref = wants[self._want_cursor]
            failed = self._failed.recent(failure_key(ref), now) is not None
            step = prefetch_step(entry, ref, failed_recently=failed)
            if step is Step.REPLACE:
                assert entry is not None
                self._index.evict(entry)
                entry, step = None, prefetch_step(None, ref, failed_recently=failed)
            if step is Step.FETCH:
                room = self._index.make_room(
                    ref.size, self._prefetch, {ref.digest}, evict_wanted=False
                )
                if not room:
                    return  # the cache is full of wanted or pinned pieces: wait for room
                entry = self._index.reserve(ref, demand=False)
                entry.owner = self.ledger.plan_owner(self._want_cursor)
            elif step is Step.VERIFY:  # found at start-up: verify it now
                assert entry is not None
                entry.ref, entry.state = ref, QUEUED
                self._order.remove(entry.digest)
            if step is not Step.SKIP:
                assert entry is not None
                self._prefetch.append(entry)
                queued += 1
            self._want_cursor += 1
        if queued:
            self._work.notify_all()

    def _complete(self, waiter: Waiter) -> None:
        self._done.complete(waiter)

    # -- fetching (the pool's threads, lock held) ---------------------------------------

    def _next_task(self) -> PieceEntry | None:
        """The next queued entry, demand first; None when stopping (lock held)."""
        while not self._stop:
            for queue in (self._demand, self._prefetch):
                while queue:
                    entry = queue.popleft()
                    if entry.state == QUEUED and self._entries.get(entry.digest) is entry:
                        entry.state = FETCHING
                        self._fetching += 1
                        return entry
            self._work.wait()
        return None

    def _finish(
        self,
        entry: PieceEntry,
        error: PieceUnreadable | None,
        fetched: int,
        elapsed: float,
        demand: bool,
    ) -> None:
        self._fetching -= 1
        if fetched:
            self._stats.record_fetch(fetched, elapsed, demand=demand)
            self.ledger.charge(entry.owner, fetched)
        if self.faults.cleared(entry):
            self._want_cursor = 0  # storage answers: look over what the plan wants again
        if isinstance(error, FetchAbandoned) and entry.waiters and not self._stop:
            # Nobody waited when it gave up, somebody does now: fetch it for them.
            entry.state, entry.demand = QUEUED, True
            self._demand.append(entry)
            self._work.notify_all()
            return
        waiters, entry.waiters = entry.waiters, []
        if error is None:
            self._index.arrived(entry)
            for waiter in waiters:
                waiter.pending.discard(entry.digest)
                if not waiter.pending and not waiter.done:
                    self._complete(waiter)
                else:
                    self.faults.refresh(waiter)
        else:
            self._failed_piece(entry, error, waiters)
        self._admit_waiting()
        self._schedule_prefetch()

    def _failed_piece(
        self, entry: PieceEntry, error: PieceUnreadable, waiters: list[Waiter]
    ) -> None:
        """A fetch ended without the piece: its room back, its waiters told. Only a
        missing or damaged piece is remembered (a fault of the service is not: the next
        request fetches afresh)."""
        if not isinstance(error, FetchAbandoned):  # abandoned: nobody waits, no verdict
            self._stats.unreadable += 1
            log.error("%s", error)
        if isinstance(error, PieceMissing | PieceDamaged) and entry.ref is not None:
            self._failed.remember(failure_key(entry.ref), error, time.monotonic())
            waiters = reroute(entry, error, waiters, self._failed, self._demand)
            self._work.notify_all()  # if rerouted: the same bytes from another dataset's object
        if entry.state != QUEUED:
            self._index.drop(entry)
        for waiter in waiters:
            if not waiter.done:
                waiter.error = waiter.error or error
                self._complete(waiter)

    # -- the disk's side (lock held) ----------------------------------------------------

    def _evicted(self) -> None:
        self._disk.evicted()

    def _queued_prefetches(self) -> Sequence[PieceEntry]:
        return self._prefetch

    def _room_came_back(self) -> None:
        self._admit_waiting()
        self._schedule_prefetch()

    # -- status ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Size, capacity, counters and fetch latency (for /v1/status and /metrics)."""
        with self.lock:
            return {
                "dir": str(self.directory),
                "capacity_bytes": self.capacity,
                "size_bytes": self._index.resident_bytes,
                "reserved_bytes": self._index.used,
                "pieces": self._index.resident_count,
                "fetching": self._fetching,
                "admission_queue": len(self._admission),
                "wanted_pieces": len(self._order.plan),
                "capacity_effective_bytes": self._index.capacity,
                "retrying": self.faults.retrying_pieces,
                **self._stats.as_dict(),
            }

    def take_fetched(self) -> dict[str, int]:
        """Bytes fetched per job since the last call (see :class:`FetchLedger`)."""
        with self.lock:
            return self.ledger.take()

    def fault_of(self, waiter: Waiter) -> StorageFault | None:
        """Why ``waiter`` still waits, if object storage does not answer (the loop reads
        it without the lock; see :meth:`Faults.of <.cache_faults.Faults.of>`)."""
        return self.faults.of(waiter)

    def disk_bytes(self) -> int:
        """Bytes of every file under the cache directory now (temp files and evicted ones
        not unlinked yet included), for tests and tools. The scan holds the lock: it never
        adds a file unlinked for one reservation to a file written for it afterwards."""
        with self.lock:
            return self.files.disk_bytes()

    def close(self) -> None:
        """Stop the fetchers, close every file; every waiting request is answered with
        :class:`CacheClosed` (retryable: the server stops)."""
        with self.lock:
            if self._stop:
                return
            self._stop = True
            self._pool.stopped.set()
            self._work.notify_all()
            stopping = CacheClosed("the server is stopping; ask again (it or another replica)")
            for waiter in self._waiting():
                waiter.error = stopping
                self._complete(waiter)
            self._admission.clear()
        self._pool.stop()
        self._disk.stop()
        with self.lock:
            self._index.close_files()
            self._done.close()  # a fetcher finishing late must not write to a reused fd
        self.files.release()

    def _waiting(self) -> Iterator[Waiter]:
        """Every waiter not done: waiting for room, or for pieces (lock held)."""
        seen: set[int] = set()
        waiters = itertools.chain(
            self._admission, (w for e in self._entries.values() for w in e.waiters)
        )
        for waiter in waiters:
            if not waiter.done and id(waiter) not in seen:
                seen.add(id(waiter))
                yield waiter
