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
the other needs.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenfeed.errors import StoreError
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
    rows_per_request,
)
from tokenfeed_server.store.errors import CacheTooSmall, PieceUnreadable
from tokenfeed_server.store.health import StorageHealth
from tokenfeed_server.store.piece_fetch import FetchCounters, RetryPolicy, fetch_piece
from tokenfeed_server.store.piece_files import PieceDirectory
from tokenfeed_server.store.piece_index import PieceIndex
from tokenfeed_server.store.pieces import PieceRef, PieceSource
from tokenfeed_server.store.waiters import NotResident, Waiter

__all__ = [
    "UNLIMITED_ROWS",
    "CacheTooSmall",
    "NotResident",
    "PieceCache",
    "PieceRef",
    "PieceSource",
    "PieceUnreadable",
    "Waiter",
]

log = logging.getLogger(__name__)

assert FETCHING > QUEUED  # the states' order is the policy's; FETCHING is set here


class PieceCache:
    """Verified pieces of a remote store in ``directory``, at most ``capacity`` bytes.

    ``source`` serves range reads (an :class:`~tokenfeed_server.store.objects.ObjectStore`).
    ``fetchers`` threads fetch; a failed GET (already retried by the object store's client
    for what it knows to be transient) is tried up to ``attempts`` times in all, with
    exponential backoff from ``backoff_s`` (a missing object is not retried); a piece
    whose bytes do not match its digest is fetched again up to ``mismatch_attempts``
    times, then reported unreadable (and, for ``failure_ttl_s``, answered so at once
    instead of fetched again). At most ``max_open`` piece files stay open. The server
    takes these from its settings (:class:`~tokenfeed_server.config.CacheSettings`).

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
        failure_ttl_s: float = 30.0,
        max_open: int = 1024,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 byte, got {capacity}")
        self.capacity = int(capacity)
        self.source = source
        self.retry = RetryPolicy(max(1, attempts), max(1, mismatch_attempts), backoff_s)
        #: What object storage did for each dataset lately (read by the HTTP side).
        self.health = StorageHealth()
        #: Taken by readers around residency checks and reads, and by every change.
        self.lock = threading.Lock()
        self._work = threading.Condition(self.lock)
        self._init_state(failure_ttl_s)
        self.files = PieceDirectory(directory)
        self.directory = self.files.directory
        self._index = PieceIndex(self.capacity, self.files, max(16, max_open))
        self._entries = self._index.entries  # the same dict: looked up on every read
        self._order = self._index.order
        self._stats = self._index.stats
        try:
            self.removed_at_start = self._index.recover()
            if self.removed_at_start:
                log.info(
                    "cache %s: removed %d temp files of an interrupted fetch",
                    self.directory,
                    self.removed_at_start,
                )
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)
        except BaseException:
            self.files.release()
            raise
        self._threads += [
            threading.Thread(target=self._fetch_loop, name=f"tokenfeed-fetch-{i}", daemon=True)
            for i in range(max(1, fetchers))
        ]
        for thread in self._threads:
            thread.start()

    def _init_state(self, failure_ttl_s: float) -> None:
        self._fetching = 0
        self._demand: collections.deque[PieceEntry] = collections.deque()
        self._prefetch: collections.deque[PieceEntry] = collections.deque()
        self._admission: collections.deque[Waiter] = collections.deque()
        self._completed: list[Waiter] = []
        self._failed: FailureMemory[PieceUnreadable] = FailureMemory(failure_ttl_s)
        self._want_list: Sequence[PieceRef] = []
        self._want_digests: list[str] = []
        self._want_cursor = 0
        self._counters = FetchCounters(self._count_fetch_error, self._count_mismatch)
        self._stop = False
        self._wake_r = self._wake_w = -1
        self._threads: list[threading.Thread] = []

    @property
    def attempts(self) -> int:
        """GETs in all per piece before it is reported unreadable."""
        return self.retry.attempts

    @property
    def mismatch_attempts(self) -> int:
        """Fetches of bytes failing their digest before the bucket copy is reported bad."""
        return self.retry.mismatch_attempts

    @property
    def backoff_s(self) -> float:
        """Seconds before the first retry (doubled at each)."""
        return self.retry.backoff_s

    @property
    def failure_ttl_s(self) -> float:
        """Seconds an unreadable piece is answered so at once instead of fetched again."""
        return self._failed.ttl_s

    # -- start-up --------------------------------------------------------------------

    def rows_per_request(
        self, piece_bytes: int, row_bytes: int, dataset_bytes: int | None = None
    ) -> int:
        """The most rows of ``row_bytes`` one request may read: see
        :func:`~tokenfeed_server.store.cache_policy.rows_per_request` (what a job's
        ``max_count`` times its batch size should not exceed, or a request could need
        more room than the cache has: :class:`CacheTooSmall`)."""
        return rows_per_request(self.capacity, piece_bytes, row_bytes, dataset_bytes)

    # -- the loop's side ---------------------------------------------------------------

    @property
    def wake_fd(self) -> int:
        """A descriptor that turns readable when a waiter is done (poll it; see
        :meth:`completed`)."""
        return self._wake_r

    def completed(self) -> list[Waiter]:
        """The waiters done since the last call (clears the wake descriptor)."""
        if self._wake_r < 0:
            return []
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:  # closed: the cache was closed
            return []
        with self.lock:
            done, self._completed = self._completed, []
        return done

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
        waiter = Waiter(_unique(refs()))
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
            waiter.pinned = []
            self._admit_waiting()
            self._schedule_prefetch()

    def fetch_all_blocking(self, refs: Sequence[PieceRef], timeout: float | None = None) -> None:
        """Bring ``refs`` in, blocking (for tools and tests, never the data plane)."""
        waiter = Waiter(_unique(refs))
        with self.lock:
            self._request(waiter)
        try:
            if not waiter.wait(timeout):
                raise StoreError(f"timed out fetching {len(refs)} pieces")
            if waiter.error is not None:
                raise waiter.error
        finally:
            self.release(waiter)

    def want(self, refs: Sequence[PieceRef], digests: Sequence[str] | None = None) -> None:
        """The pieces the prefetch plan wants, most urgent first (replaces the last call):
        fetched ahead into free room, and evicted after the pieces it does not want.

        ``digests``, if given, are the pieces' digests in the same order: then ``refs``
        may be a lazy sequence (a piece's ref is made only if it must be fetched).
        """
        want_digests = list(digests) if digests is not None else [r.digest for r in refs]
        wanted = set(want_digests)
        with self.lock:
            self._want_list = refs
            self._want_digests = want_digests
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

    # -- admission (lock held) ---------------------------------------------------------

    def _request(self, waiter: Waiter) -> None:
        need = sum(r.size for r in waiter.refs)
        if need > self.capacity:
            waiter.error = CacheTooSmall(
                f"one request needs {len(waiter.refs)} pieces ({need} bytes) in the cache at "
                f"once, more than --cache-size={self.capacity} bytes; raise --cache-size, or "
                "ask smaller chunks (fewer rows per request), or use shuffle='block'"
            )
            self._complete(waiter)
            return
        now = time.monotonic()
        for ref in waiter.refs:
            error = self._failed.recent(ref.digest, now)
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
        if not waiter.pending:
            self._complete(waiter)
        self._work.notify_all()
        return True

    def _demand_entry(self, ref: PieceRef) -> PieceEntry:
        """The entry of ``ref``, queued for fetching first unless here or on its way."""
        entry = self._entries.get(ref.digest)
        if entry is None:
            entry = self._index.reserve(ref, demand=True)
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
        anything the plan wants (and at most a few ahead of the fetchers)."""
        if self._stop:
            return
        limit = 2 * len(self._threads) if self._threads else 8
        queued = sum(1 for e in self._prefetch if e.state == QUEUED)
        wants, digests = self._want_list, self._want_digests
        now = time.monotonic()
        while self._want_cursor < len(digests) and queued < limit:
            entry = self._entries.get(digests[self._want_cursor])
            if entry is not None and entry.state != IDLE:
                self._want_cursor += 1  # here or on its way: no ref needed
                continue
            ref = wants[self._want_cursor]
            failed = self._failed.recent(ref.digest, now) is not None
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
        waiter.finish()
        self._completed.append(waiter)
        if self._wake_w < 0:
            return  # closed
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, InterruptedError):
            pass  # the pipe is full: the loop is already due to wake
        except OSError:
            pass  # closed

    # -- fetching (worker threads) -----------------------------------------------------

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

    def _fetch_loop(self) -> None:
        while True:
            with self.lock:
                entry = self._next_task()
                if entry is None:
                    return
                ref = entry.ref
                demand = entry.demand
            assert ref is not None
            started = time.monotonic()
            error: PieceUnreadable | None = None
            fetched = 0
            try:
                fetched = self._fetch(ref)
            except PieceUnreadable as exc:
                error = exc
            except Exception as exc:  # a bug must fail this piece, not the thread
                log.exception("fetching %s failed", ref.url)
                error = PieceUnreadable(f"{ref.url}: cannot fetch a piece: {exc}")
            elapsed = time.monotonic() - started
            with self.lock:
                self._finish(entry, error, fetched, elapsed, demand)

    def _fetch(self, ref: PieceRef) -> int:
        """Put the verified piece at its place; return the bytes fetched (0: found here)."""
        if self.files.verify(ref):  # left by an earlier run: trusted only if it hashes right
            with self.lock:
                self._stats.verified_local += 1
            return 0
        data, fetched = fetch_piece(self.source, ref, self.retry, self._counters, self._stopping)
        self.files.install(ref, data)
        return fetched

    def _stopping(self) -> bool:
        return self._stop

    def _count_fetch_error(self) -> None:
        with self.lock:
            self._stats.fetch_errors += 1

    def _count_mismatch(self) -> None:
        with self.lock:
            self._stats.checksum_mismatches += 1

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
        waiters, entry.waiters = entry.waiters, []
        if error is None:
            self._index.arrived(entry)
            for waiter in waiters:
                waiter.pending.discard(entry.digest)
                if not waiter.pending and not waiter.done:
                    self._complete(waiter)
        else:
            self._stats.unreadable += 1
            log.error("%s", error)
            self._failed.remember(entry.digest, error, time.monotonic())
            self._index.drop(entry)
            for waiter in waiters:
                if not waiter.done:
                    waiter.error = error
                    self._complete(waiter)
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
                **self._stats.as_dict(),
            }

    def disk_bytes(self) -> int:
        """Bytes of every file under the cache directory now (temp files included)."""
        return self.files.disk_bytes()

    def close(self) -> None:
        """Stop the fetchers, close every file; waiting requests get an error."""
        with self.lock:
            if self._stop:
                return
            self._stop = True
            self._work.notify_all()
        # A fetcher inside a slow GET is a daemon thread: the stop does not wait it out.
        deadline = time.monotonic() + 5.0
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self.lock:
            self._index.close_files()
            for waiter in list(self._admission):
                waiter.error = StoreError("the server is stopping")
                waiter.finish()
            self._admission.clear()
        with self.lock:  # a fetcher finishing late must not write to a reused descriptor
            fds = (self._wake_r, self._wake_w)
            self._wake_r = self._wake_w = -1
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.files.release()


def _unique(refs: Iterable[PieceRef]) -> list[PieceRef]:
    seen: dict[str, PieceRef] = {}
    for ref in refs:
        seen.setdefault(ref.digest, ref)
    return list(seen.values())
