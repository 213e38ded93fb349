"""The piece cache's fetch threads: take a queued piece, fetch it verified, put it in place.

The threads take their work from the cache and hand the outcome back to it (both under
its lock: :class:`FetchPool` is given the two callbacks); between the two they hold no
lock. One fetch (:func:`~tokenfeed_server.store.piece_fetch.fetch_piece`) retries
unreachable storage for its budget; before each retry the cache records the fault on the
piece's waiters (:class:`~tokenfeed_server.store.cache_faults.Faults`), or the fetch gives
up when nobody waits for it. A sleep between retries ends at once when the cache closes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable

from tokenfeed_server.store.cache_disk import DiskKeeper
from tokenfeed_server.store.cache_faults import Faults
from tokenfeed_server.store.cache_policy import PieceEntry
from tokenfeed_server.store.cache_stats import CacheStats
from tokenfeed_server.store.errors import PieceUnreadable
from tokenfeed_server.store.health import StorageHealth
from tokenfeed_server.store.piece_fetch import FetchHooks, RetryPolicy, fetch_piece, last_error
from tokenfeed_server.store.piece_files import PieceDirectory
from tokenfeed_server.store.pieces import PieceSource

__all__ = ["FetchPool", "Finish"]

log = logging.getLogger(__name__)

#: The cache's end of a fetch (lock held): the entry, the error (None: in place), the
#: bytes fetched, the seconds it took, and whether it was for a request (not a prefetch).
Finish = Callable[[PieceEntry, PieceUnreadable | None, int, float, bool], None]


class FetchPool:
    """``fetchers`` threads fetching for the cache whose lock is ``lock``: ``next_task``
    (lock held) blocks for the next entry, None when stopping; ``finish`` (lock held)
    takes the outcome. The rest are the cache's parts a fetch uses."""

    def __init__(
        self,
        lock: threading.Lock,
        *,
        next_task: Callable[[], PieceEntry | None],
        finish: Finish,
        source: PieceSource,
        policy: RetryPolicy,
        files: PieceDirectory,
        disk: DiskKeeper,
        faults: Faults,
        health: StorageHealth,
        stats: CacheStats,
        fetchers: int,
    ) -> None:
        self.lock = lock
        self._next_task, self._finish = next_task, finish
        self.source, self.policy, self.files, self.disk = source, policy, files, disk
        self.faults, self.health, self._stats = faults, health, stats
        self.stopped = threading.Event()
        self._hooks = FetchHooks(
            fetch_error=self._count_fetch_error, mismatch=self._count_mismatch,
            stopping=self.stopped.is_set, sleep=self._sleep,
        )  # fmt: skip
        self.threads = [
            threading.Thread(target=self._loop, name=f"tokenfeed-fetch-{i}", daemon=True)
            for i in range(max(1, fetchers))
        ]

    def start(self) -> None:
        """Start the threads."""
        for thread in self.threads:
            thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Wake every sleeping fetch and wait (bounded) for the threads; a fetcher inside
        a slow GET is a daemon thread: the stop does not wait it out. The cache has woken
        the threads waiting for work (its condition) already."""
        self.stopped.set()
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _loop(self) -> None:
        while True:
            with self.lock:
                entry = self._next_task()
                if entry is None:
                    return
                ref, demand = entry.ref, entry.demand
            assert ref is not None
            started = time.monotonic()
            error: PieceUnreadable | None = None
            fetched = 0
            try:
                fetched = self._fetch(entry)
            except PieceUnreadable as exc:
                error = exc
            except Exception as exc:  # a bug must fail this piece, not the thread
                log.exception("fetching %s failed", ref.url)
                error = PieceUnreadable(f"{ref.url}: cannot fetch a piece: {exc}")
            elapsed = time.monotonic() - started
            self.faults.record(ref, error)  # before the waiters hear of it
            with self.lock:
                self._finish(entry, error, fetched, elapsed, demand)

    def _fetch(self, entry: PieceEntry) -> int:
        """Put the verified piece at its place; return the bytes fetched (0: found here)."""
        ref = entry.ref
        assert ref is not None
        # Evicted files go first: one of them may be this piece's (evicted, wanted again),
        # and the bytes on disk stay within the capacity.
        self.disk.drain()
        if self.files.verify(ref):  # left by an earlier run: trusted only if it hashes right
            with self.lock:
                self._stats.verified_local += 1
            return 0
        hooks = dataclasses.replace(self._hooks, retrying=functools.partial(self._retrying, entry))
        data, fetched = fetch_piece(self.source, ref, self.policy, hooks)
        self.disk.install(ref, data)  # on a full disk the cache shrinks, then writes
        return fetched

    def _retrying(self, entry: PieceEntry, exc: Exception, since: float, left: float) -> bool:
        """A fetch meets unreachable storage: go on (its waiters told), or give up."""
        ref = entry.ref
        assert ref is not None
        with self.lock:
            if self.stopped.is_set():
                return False
            if not self.faults.retrying(entry, last_error(ref, exc), since, left):
                return False
        self.health.retrying(ref.dataset_name, str(exc))
        return True

    def _sleep(self, seconds: float) -> bool:
        """Wait between retries; False at once when the cache closes."""
        return not self.stopped.wait(seconds)

    def _count_fetch_error(self) -> None:
        with self.lock:
            self._stats.fetch_errors += 1

    def _count_mismatch(self) -> None:
        with self.lock:
            self._stats.checksum_mismatches += 1
