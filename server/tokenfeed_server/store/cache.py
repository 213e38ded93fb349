"""The local cache of a remote store: verified pieces on disk, fetched in the background.

The unit is a *piece* of a shard file (see :mod:`~tokenfeed_server.store.format`: a
version-2 manifest lists the blake2b-128 digest of every piece). A piece is fetched with
one range GET by a small pool of threads, checked against its digest, written to a temp
file and renamed into place, so a file under ``pieces/`` is always a whole, verified
piece; a server killed mid-fetch leaves only temp files, removed at the next start.

The cache never holds more than ``capacity`` bytes: a piece's bytes are reserved before
its fetch starts (a temp file being written counts), and room is made by evicting pieces
that the prefetch plan does not want (those it has just stopped wanting first, then the
least recently read), then pieces it wants (least recently read first); never a piece
pinned by a request waiting for it. Eviction and reads take one lock, so a
piece is never removed while the data plane reads it.

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

import bisect
import collections
import contextlib
import errno
import fcntl
import itertools
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tokenfeed.errors import StoreError
from tokenfeed_server.config import parse_size
from tokenfeed_server.store.format import piece_digest
from tokenfeed_server.store.objects import ObjectNotFound

__all__ = [
    "CacheTooSmall",
    "NotResident",
    "PieceCache",
    "PieceRef",
    "PieceSource",
    "PieceUnreadable",
    "Waiter",
    "parse_size",
]

#: :meth:`PieceCache.rows_per_request` when a request cannot outgrow the cache.
UNLIMITED_ROWS = 1 << 62


def _drain(it: Iterable[object]) -> None:
    """Run an iterator to its end (in C)."""
    collections.deque(it, maxlen=0)


log = logging.getLogger(__name__)

_DIGEST_RE = re.compile(r"[0-9a-f]{32}")
_TEMP_SUFFIX = ".part"
#: Upper bounds (seconds) of the fetch-latency histogram's buckets.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class PieceSource(Protocol):
    """Where pieces come from: an object store's range reads."""

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of object ``key``."""
        ...


@dataclass(frozen=True)
class PieceRef:
    """One piece: its digest (the cache's key) and where to fetch it."""

    digest: str
    key: str  # object key, relative to the store's prefix
    start: int
    stop: int
    url: str  # the object's full URL, for error messages

    @property
    def size(self) -> int:
        """Bytes in the piece."""
        return self.stop - self.start


class PieceUnreadable(StoreError):
    """A piece could not be fetched intact (its object is missing, or the bucket's copy
    does not match the manifest) after the retries."""


class CacheTooSmall(StoreError):
    """One request needs more pieces at once than the whole cache holds."""


class Waiter:
    """The pieces one parked request waits for; done when all are in or one failed.

    ``error`` is set when a piece stays unreadable (or the request can never fit).
    """

    def __init__(self, refs: Sequence[PieceRef]) -> None:
        self.refs = tuple(refs)
        self.error: StoreError | None = None
        self._pending: set[str] = set()
        self._pinned: list[_Entry] = []
        self._event = threading.Event()
        self._admitted = False
        self._released = False

    @property
    def done(self) -> bool:
        """True once every piece is in, or ``error`` is set."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (for callers off the data plane's loop); False on timeout."""
        return self._event.wait(timeout)


class NotResident(Exception):
    """A read needs pieces that are not in the cache; nothing was read.

    The data plane parks the request and retries it when :attr:`waiter` is done, then
    calls :meth:`PieceCache.release` with it.
    """

    def __init__(self, cache: PieceCache, waiter: Waiter) -> None:
        super().__init__(f"waiting for {len(waiter.refs)} pieces")
        self.cache = cache
        self.waiter = waiter


# Entry states.
_IDLE = 0  # a file found at start-up, not verified yet
_QUEUED = 1
_FETCHING = 2
_RESIDENT = 3


@dataclass(eq=False)
class _Entry:
    ref: PieceRef | None  # None: a file found at start-up (no source known)
    size: int
    digest: str
    state: int
    pins: int = 0
    demand: bool = False  # queued for a waiting request (else: prefetch)
    waiters: list[Waiter] = field(default_factory=list)


@dataclass
class _Stats:
    hits: int = 0
    misses: int = 0
    fetches: int = 0
    prefetches: int = 0
    bytes_fetched: int = 0
    fetch_errors: int = 0
    checksum_mismatches: int = 0
    unreadable: int = 0
    evictions: int = 0
    verified_local: int = 0
    latency_sum: float = 0.0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    recent: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=2048))


class PieceCache:
    """Verified pieces of a remote store in ``directory``, at most ``capacity`` bytes.

    ``source`` serves range reads (an :class:`~tokenfeed_server.store.objects.ObjectStore`).
    ``fetchers`` threads fetch; a failed GET (already retried by the object store's client
    for what it knows to be transient) is tried up to ``attempts`` times in all, with
    exponential backoff from ``backoff_s`` (a missing object is not retried); a piece
    whose bytes do not match its digest is fetched again up to ``mismatch_attempts``
    times, then reported unreadable (and, for
    ``failure_ttl_s``, answered so at once instead of fetched again).

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
        self.directory = Path(directory)
        self.capacity = int(capacity)
        self.source = source
        self.attempts = max(1, attempts)
        self.mismatch_attempts = max(1, mismatch_attempts)
        self.backoff_s = backoff_s
        self.failure_ttl_s = failure_ttl_s
        self.max_open = max(16, max_open)
        #: Taken by readers around residency checks and reads, and by every change.
        self.lock = threading.Lock()
        self._work = threading.Condition(self.lock)
        self._entries: dict[str, _Entry] = {}
        # Least recently used first: pieces on disk that may be evicted when unpinned.
        # Two LRU orders: pieces the prefetch plan does not want (evicted first), and
        # pieces it wants; so making room never scans a cache full of wanted pieces.
        self._lru_u: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._lru_w: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._lru_bytes = [0, 0]  # bytes in _lru_u, _lru_w
        self._open: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._used = 0  # bytes of every entry: on disk, being written, or reserved
        self._resident_bytes = 0  # of verified pieces (kept as counts: stats() is O(1))
        self._resident_count = 0
        self._fetching = 0
        self._demand: collections.deque[_Entry] = collections.deque()
        self._prefetch: collections.deque[_Entry] = collections.deque()
        self._admission: collections.deque[Waiter] = collections.deque()
        self._completed: list[Waiter] = []
        self._failed: dict[str, tuple[PieceUnreadable, float]] = {}
        self._wanted: set[str] = set()
        self._want_list: Sequence[PieceRef] = []
        self._want_digests: list[str] = []
        self._want_cursor = 0
        self._stats = _Stats()
        self._stop = False
        self._pieces_dir = self.directory / "pieces"
        self._tmp_dir = self.directory / "tmp"
        self._lock_fd = self._take_directory()
        self.removed_at_start = 0  # temp files of a killed server, removed
        try:
            self._recover()
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._threads = [
            threading.Thread(target=self._fetch_loop, name=f"tokenfeed-fetch-{i}", daemon=True)
            for i in range(max(1, fetchers))
        ]
        for thread in self._threads:
            thread.start()

    # -- start-up --------------------------------------------------------------------

    def _take_directory(self) -> int:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._pieces_dir.mkdir(exist_ok=True)
            self._tmp_dir.mkdir(exist_ok=True)
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

    def _recover(self) -> None:
        """Remove temp files (a fetch cut short) and take over verified-by-name pieces.

        A piece file found here is not trusted yet: it is hashed before its first use.
        """
        for path in self._tmp_dir.iterdir():
            _unlink(path)
            self.removed_at_start += 1
        found: list[tuple[float, str, int]] = []
        for path in self._pieces_dir.iterdir():
            try:
                st = path.stat()
            except OSError:
                continue
            if not _DIGEST_RE.fullmatch(path.name) or not path.is_file():
                _unlink(path)
                continue
            found.append((st.st_mtime, path.name, st.st_size))
        found.sort()
        for _, digest, size in found:
            entry = _Entry(None, size, digest, _IDLE)
            self._entries[digest] = entry
            self._lru_add(entry)
            self._used += size
        while self._used > self.capacity and self._lru_u:  # the size was lowered since
            self._evict(next(iter(self._lru_u.values())))
        if self.removed_at_start:
            log.info(
                "cache %s: removed %d temp files of an interrupted fetch",
                self.directory,
                self.removed_at_start,
            )

    def rows_per_request(
        self, piece_bytes: int, row_bytes: int, dataset_bytes: int | None = None
    ) -> int:
        """The most rows of ``row_bytes`` one request may read so that its pieces (of
        ``piece_bytes``) fit in half the cache at once, whatever rows it reads (at least
        1): what a job's ``max_count`` times its batch size should not exceed, or a
        request could need more room than the cache has (:class:`CacheTooSmall`). A
        dataset of ``dataset_bytes`` that fits in the cache whole allows any number: no
        request can need more than all its pieces, and admission is all or nothing, so
        requests of other jobs wait for room rather than fail."""
        if dataset_bytes is not None and dataset_bytes <= self.capacity:
            return UNLIMITED_ROWS
        per_row = (-(-row_bytes // piece_bytes) + 1) * piece_bytes
        return max(1, (self.capacity // 2) // per_row)

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
        missing = False
        for digest in digests:
            entry = entries.get(digest)
            if entry is None or entry.state != _RESIDENT:
                missing = True
                break
        if missing:
            resident = sum(
                1
                for digest in digests
                if (e := entries.get(digest)) is not None and e.state == _RESIDENT
            )
            self._stats.hits += resident
            self._stats.misses += len(digests) - resident
            waiter = Waiter(_unique(refs()))
            self._request(waiter)
            raise NotResident(self, waiter)
        refs_count = len(digests)
        self._stats.hits += refs_count
        wanted, opened = self._wanted, self._open
        # Per piece, the loops run in C (map, filter, a zero-length deque draining them):
        # a request of a global shuffle touches a piece per row.
        _drain(map(self._lru_w.move_to_end, filter(wanted.__contains__, digests)))
        _drain(map(self._lru_u.move_to_end, itertools.filterfalse(wanted.__contains__, digests)))
        fds: list[int | None] = list(map(opened.get, digests))
        if None in fds:
            for i, digest in enumerate(digests):
                if fds[i] is None:
                    # looked up again: one digest may come twice (identical pieces)
                    fd = opened.get(digest)
                    if fd is None:
                        fd = opened[digest] = self._open_file(digest)
                    fds[i] = fd
        _drain(map(opened.move_to_end, digests))
        # Descriptors of pieces read least recently go first (never one just returned:
        # they were moved to the end).
        excess = len(opened) - max(self.max_open, refs_count)
        while excess > 0:
            _, fd = opened.popitem(last=False)
            os.close(fd)
            excess -= 1
        return fds  # type: ignore[return-value]  # every None was replaced above

    def _open_file(self, digest: str) -> int:
        try:
            return os.open(self._pieces_dir / digest, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise StoreError(
                f"cache file {self._pieces_dir / digest} is unreadable: {exc.strerror or exc}; "
                "something else changed the cache directory: restart the server"
            ) from exc

    def release(self, waiter: Waiter) -> None:
        """Unpin the pieces of a waiter whose request was retried (or dropped); safe to
        call twice."""
        with self.lock:
            if waiter._released:
                return
            waiter._released = True
            if not waiter._admitted:
                with contextlib.suppress(ValueError):
                    self._admission.remove(waiter)
            for entry in waiter._pinned:
                entry.pins -= 1
            waiter._pinned = []
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
            if wanted != self._wanted:
                # Only the pieces whose status changed move (cheap next to the cache): no
                # longer wanted (a block the plan has passed) to the front of the not-
                # wanted order, evicted first; newly wanted to the end of the wanted one.
                dropped, added = self._wanted - wanted, wanted - self._wanted
                self._wanted = wanted
                for digest in dropped:
                    entry = self._lru_w.pop(digest, None)
                    if entry is not None:
                        self._lru_u[digest] = entry
                        self._lru_u.move_to_end(digest, last=False)
                        self._lru_bytes[1] -= entry.size
                        self._lru_bytes[0] += entry.size
                for digest in added:
                    entry = self._lru_u.pop(digest, None)
                    if entry is not None:
                        self._lru_w[digest] = entry
                        self._lru_bytes[0] -= entry.size
                        self._lru_bytes[1] += entry.size
            self._want_cursor = 0
            # Queued prefetches no longer wanted give their room back.
            for entry in [e for e in self._prefetch if e.digest not in self._wanted]:
                if entry.state == _QUEUED and not entry.pins:
                    self._drop_entry(entry)
            self._prefetch = collections.deque(e for e in self._prefetch if e.state == _QUEUED)
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
            entry = self._entries.get(digest)
            return entry is not None and entry.state == _RESIDENT

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
            failed = self._failed.get(ref.digest)
            if failed is not None:
                if now - failed[1] < self.failure_ttl_s:
                    waiter.error = failed[0]
                    self._complete(waiter)
                    return
                del self._failed[ref.digest]
        if self._admission or not self._admit(waiter):
            self._admission.append(waiter)

    def _admit(self, waiter: Waiter) -> bool:
        """Pin every piece of ``waiter`` and queue the missing ones, if room allows."""
        refs = waiter.refs
        for ref in refs:  # a file found at start-up of another size cannot be the piece
            stale = self._entries.get(ref.digest)
            if stale is not None and stale.state == _IDLE and stale.size != ref.size:
                self._evict(stale)
        new = sum(r.size for r in refs if r.digest not in self._entries)
        protect = {r.digest for r in refs}
        if not self._make_room(new, protect, evict_wanted=True):
            return False
        waiter._admitted = True
        for ref in refs:
            entry = self._entries.get(ref.digest)
            if entry is None:
                entry = _Entry(ref, ref.size, ref.digest, _QUEUED, demand=True)
                self._entries[ref.digest] = entry
                self._used += entry.size
                self._demand.append(entry)
            elif entry.state == _IDLE:
                entry.ref = ref
                entry.state = _QUEUED
                entry.demand = True
                self._lru_pop(entry.digest)
                self._demand.append(entry)
            elif entry.state == _QUEUED and not entry.demand:
                entry.demand = True  # a prefetch becomes urgent
                self._demand.append(entry)
            entry.pins += 1
            waiter._pinned.append(entry)
            if entry.state != _RESIDENT:
                waiter._pending.add(entry.digest)
                entry.waiters.append(waiter)
        if not waiter._pending:
            self._complete(waiter)
        self._work.notify_all()
        return True

    def _admit_waiting(self) -> None:
        while self._admission and not self._stop:
            if not self._admit(self._admission[0]):
                return
            self._admission.popleft()

    def _make_room(self, nbytes: int, protect: set[str], *, evict_wanted: bool) -> bool:
        """Evict until ``nbytes`` more fit; False (nothing evicted) if they cannot."""
        free = self.capacity - self._used
        if nbytes <= free:
            return True
        queued = sum(e.size for e in self._prefetch if e.state == _QUEUED and not e.pins)
        if free + queued + self._lru_bytes[0] + evict_wanted * self._lru_bytes[1] < nbytes:
            return False  # cannot fit even evicting everything allowed: no scan
        victims: list[_Entry] = []
        # Queued prefetches hold room but no file: cancelled first.
        for entry in self._prefetch:
            if free >= nbytes:
                break
            if entry.state == _QUEUED and not entry.pins and entry.digest not in protect:
                if entry.digest in self._wanted and not evict_wanted:
                    continue
                victims.append(entry)
                free += entry.size
        for lru in (self._lru_u, self._lru_w) if evict_wanted else (self._lru_u,):
            if free >= nbytes:
                break
            for digest, entry in lru.items():
                if free >= nbytes:
                    break
                if entry.pins or digest in protect:
                    continue
                victims.append(entry)
                free += entry.size
        if free < nbytes:
            return False
        for entry in victims:
            if entry.state == _QUEUED:
                self._drop_entry(entry)
            else:
                self._evict(entry)
        return True

    def _drop_entry(self, entry: _Entry) -> None:
        if self._entries.get(entry.digest) is entry:
            del self._entries[entry.digest]
            self._used -= entry.size
        entry.state = _IDLE  # a queued copy in a deque is skipped

    def _lru_add(self, entry: _Entry) -> None:
        wanted = entry.digest in self._wanted
        (self._lru_w if wanted else self._lru_u)[entry.digest] = entry
        self._lru_bytes[wanted] += entry.size

    def _lru_pop(self, digest: str) -> None:
        for i, lru in enumerate((self._lru_u, self._lru_w)):
            entry = lru.pop(digest, None)
            if entry is not None:
                self._lru_bytes[i] -= entry.size
                return

    def _evict(self, entry: _Entry) -> None:
        self._lru_pop(entry.digest)
        fd = self._open.pop(entry.digest, None)
        if fd is not None:
            os.close(fd)
        _unlink(self._pieces_dir / entry.digest)
        if self._entries.get(entry.digest) is entry:
            del self._entries[entry.digest]
            self._used -= entry.size
            if entry.state == _RESIDENT:
                self._resident_bytes -= entry.size
                self._resident_count -= 1
        entry.state = _IDLE
        self._stats.evictions += 1

    def _schedule_prefetch(self) -> None:
        """Queue wanted pieces not here yet, in order, while room allows without evicting
        anything the plan wants (and at most a few ahead of the fetchers)."""
        if self._stop:
            return
        limit = 2 * len(self._threads) if hasattr(self, "_threads") else 8
        queued = sum(1 for e in self._prefetch if e.state == _QUEUED)
        wants, digests = self._want_list, self._want_digests
        now = time.monotonic()
        while self._want_cursor < len(digests) and queued < limit:
            digest = digests[self._want_cursor]
            entry = self._entries.get(digest)
            if entry is not None and entry.state != _IDLE:
                self._want_cursor += 1  # here or on its way: no ref needed
                continue
            ref = wants[self._want_cursor]
            if entry is not None and entry.size != ref.size:
                self._evict(entry)
                entry = None
            if entry is not None:
                if entry.state == _IDLE:  # found at start-up: verify it now
                    entry.ref, entry.state = ref, _QUEUED
                    self._lru_pop(entry.digest)
                    self._prefetch.append(entry)
                    queued += 1
                self._want_cursor += 1
                continue
            failed = self._failed.get(ref.digest)
            if failed is not None and now - failed[1] < self.failure_ttl_s:
                self._want_cursor += 1
                continue
            if not self._make_room(ref.size, {ref.digest}, evict_wanted=False):
                return  # the cache is full of wanted or pinned pieces: wait for room
            entry = _Entry(ref, ref.size, ref.digest, _QUEUED)
            self._entries[ref.digest] = entry
            self._used += entry.size
            self._prefetch.append(entry)
            queued += 1
            self._want_cursor += 1
        if queued:
            self._work.notify_all()

    def _complete(self, waiter: Waiter) -> None:
        waiter._event.set()
        self._completed.append(waiter)
        if self._wake_w < 0:
            return  # closed
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, InterruptedError):
            pass  # the pipe is full: the loop is already due to wake
        except (OSError, AttributeError):
            pass  # closed, or during start-up

    # -- fetching (worker threads) -----------------------------------------------------

    def _next_task(self) -> _Entry | None:
        """The next queued entry, demand first; None when stopping (lock held)."""
        while not self._stop:
            for queue in (self._demand, self._prefetch):
                while queue:
                    entry = queue.popleft()
                    if entry.state == _QUEUED and self._entries.get(entry.digest) is entry:
                        entry.state = _FETCHING
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
        final = self._pieces_dir / ref.digest
        if final.exists():  # left by an earlier run: trusted only if it hashes right
            try:
                data = final.read_bytes()
            except OSError:
                data = b""
            if len(data) == ref.size and piece_digest(data) == ref.digest:
                with self.lock:
                    self._stats.verified_local += 1
                return 0
            _unlink(final)
        mismatches = 0
        failures = 0
        fetched = 0
        while True:
            if self._stop:
                raise PieceUnreadable(f"{ref.url}: the server is stopping")
            try:
                data = self.source.get_range(ref.key, ref.start, ref.stop)
            except Exception as exc:
                failures += 1
                with self.lock:
                    self._stats.fetch_errors += 1
                # A missing object stays missing (S3 is strongly consistent): no retry.
                if failures >= self.attempts or isinstance(exc, ObjectNotFound):
                    raise PieceUnreadable(
                        f"cannot fetch {ref.url} bytes [{ref.start}, {ref.stop}) after "
                        f"{failures} attempts: {exc}; check the bucket and the credentials "
                        "(the dataset may have been deleted: re-run prepare)"
                    ) from exc
                time.sleep(self.backoff_s * (2 ** (failures - 1)))
                continue
            fetched += len(data)
            actual = piece_digest(data) if len(data) == ref.size else f"{len(data)} bytes"
            if actual == ref.digest:
                break
            mismatches += 1
            with self.lock:
                self._stats.checksum_mismatches += 1
            log.warning(
                "%s bytes [%d, %d): got %s, the manifest says %s (fetch %d of %d)",
                ref.url,
                ref.start,
                ref.stop,
                actual,
                ref.digest,
                mismatches,
                self.mismatch_attempts,
            )
            if mismatches >= self.mismatch_attempts:
                raise PieceUnreadable(
                    f"{ref.url} bytes [{ref.start}, {ref.stop}) do not match the manifest "
                    f"(blake2b-128 {actual} != {ref.digest}) in {mismatches} fetches: the "
                    "bucket copy itself is bad; re-run tokenfeed-server prepare ... "
                    "--overwrite into the bucket"
                )
            time.sleep(self.backoff_s * (2 ** (mismatches - 1)))
        temp = self._tmp_dir / f"{ref.digest}.{uuid.uuid4().hex[:8]}{_TEMP_SUFFIX}"
        try:
            with open(temp, "wb") as f:
                f.write(data)
            os.rename(temp, final)
        except OSError as exc:
            _unlink(temp)
            raise PieceUnreadable(
                f"cannot write a piece of {ref.url} to the cache {self.directory}: "
                f"{exc.strerror or exc}; check the disk under --cache-dir"
            ) from exc
        return fetched

    def _finish(
        self,
        entry: _Entry,
        error: PieceUnreadable | None,
        fetched: int,
        elapsed: float,
        demand: bool,
    ) -> None:
        stats = self._stats
        self._fetching -= 1
        if fetched:
            stats.fetches += 1
            stats.prefetches += 0 if demand else 1
            stats.bytes_fetched += fetched
            stats.latency_sum += elapsed
            stats.latency_buckets[bisect.bisect_left(LATENCY_BUCKETS, elapsed)] += 1
            stats.recent.append(elapsed)
        waiters, entry.waiters = entry.waiters, []
        if error is None:
            entry.state = _RESIDENT
            if self._entries.get(entry.digest) is entry:
                self._lru_add(entry)
                self._resident_bytes += entry.size
                self._resident_count += 1
            for waiter in waiters:
                waiter._pending.discard(entry.digest)
                if not waiter._pending and not waiter.done:
                    self._complete(waiter)
        else:
            stats.unreadable += 1
            log.error("%s", error)
            self._failed[entry.digest] = (error, time.monotonic())
            if self._entries.get(entry.digest) is entry:
                del self._entries[entry.digest]
                self._used -= entry.size
            entry.state = _IDLE
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
            s = self._stats
            recent = sorted(s.recent)
            return {
                "dir": str(self.directory),
                "capacity_bytes": self.capacity,
                "size_bytes": self._resident_bytes,
                "reserved_bytes": self._used,
                "pieces": self._resident_count,
                "fetching": self._fetching,
                "admission_queue": len(self._admission),
                "wanted_pieces": len(self._wanted),
                "hits": s.hits,
                "misses": s.misses,
                "fetches": s.fetches,
                "prefetches": s.prefetches,
                "bytes_fetched": s.bytes_fetched,
                "fetch_errors": s.fetch_errors,
                "checksum_mismatches": s.checksum_mismatches,
                "unreadable": s.unreadable,
                "evictions": s.evictions,
                "verified_local": s.verified_local,
                "fetch_latency_p50_s": _quantile(recent, 0.5),
                "fetch_latency_p99_s": _quantile(recent, 0.99),
                "fetch_latency_sum_s": s.latency_sum,
                "fetch_latency_buckets": list(zip(LATENCY_BUCKETS, _cumulative(s), strict=True)),
            }

    def disk_bytes(self) -> int:
        """Bytes of every file under the cache directory now (temp files included)."""
        total = 0
        for sub in (self._pieces_dir, self._tmp_dir):
            for path in sub.iterdir():
                with contextlib.suppress(OSError):
                    total += path.stat().st_size
        return total

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
            for fd in self._open.values():
                os.close(fd)
            self._open.clear()
            for waiter in list(self._admission):
                waiter.error = StoreError("the server is stopping")
                waiter._event.set()
            self._admission.clear()
        with self.lock:  # a fetcher finishing late must not write to a reused descriptor
            fds = (self._wake_r, self._wake_w, self._lock_fd)
            self._wake_r = self._wake_w = -1
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _cumulative(s: _Stats) -> list[int]:
    out, total = [], 0
    for count in s.latency_buckets[:-1]:
        total += count
        out.append(total)
    return out


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(q * len(values)))], 6)


def _unique(refs: Iterable[PieceRef]) -> list[PieceRef]:
    seen: dict[str, PieceRef] = {}
    for ref in refs:
        seen.setdefault(ref.digest, ref)
    return list(seen.values())


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.warning("cannot remove %s: %s", path, exc)
