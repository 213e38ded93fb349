"""What object storage is doing to the piece cache's fetches now, and what it did lately.

The cache's half of "an outage is a delay, never a lost job": a fetch that meets
unreachable storage keeps trying (:mod:`~tokenfeed_server.store.piece_fetch`) and, before
each retry, :meth:`Faults.retrying` records a :class:`~tokenfeed_server.store.waiters.
StorageFault` on its entry and on every waiter of that entry, which the data plane turns
into a notice to the waiting trainers (:meth:`Faults.of`). A fetch nobody waits for (a
prefetch) gives up instead, and prefetching pauses while storage does not answer: the
fetchers stay free for requests. Every outcome is recorded in the shared
:class:`~tokenfeed_server.store.health.StorageHealth` (:meth:`Faults.record`).

State changes happen under the cache's lock (the caller holds it); :meth:`Faults.of` is
read by the loop without it (a stale answer only delays a notice by a turn); health is
recorded without the cache's lock (it has its own).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from tokenfeed_server.store.cache_policy import QUEUED, FailureMemory, PieceEntry
from tokenfeed_server.store.errors import (
    PieceDamaged,
    PieceMissing,
    PieceUnreadable,
    StorageExhausted,
)
from tokenfeed_server.store.health import StorageHealth
from tokenfeed_server.store.pieces import PieceRef
from tokenfeed_server.store.waiters import StorageFault, Waiter

__all__ = ["PREFETCH_PAUSE_S", "Faults", "failure_key", "reroute"]

log = logging.getLogger(__name__)

#: Seconds prefetching pauses after a prefetch met unreachable storage.
PREFETCH_PAUSE_S = 5.0


class Faults:
    """The cache's storage faults: pieces being retried, the outage they make, and the
    damaged pieces whose objects stay marked in ``health`` until they are whole again."""

    def __init__(self, health: StorageHealth) -> None:
        self.health = health
        #: entries whose fetch retries storage that does not answer
        self.retrying_pieces = 0
        #: the latest of their faults (None: storage answers)
        self.outage: StorageFault | None = None
        #: no prefetch before this time (``time.monotonic``): storage did not answer one
        self.prefetch_paused_until = 0.0
        self._outage_began = 0.0
        self._damaged: dict[str, str] = {}  # digest -> object URL
        self._damaged_lock = threading.Lock()  # fetch threads record outcomes together

    # -- under the cache's lock ----------------------------------------------------------

    def retrying(self, entry: PieceEntry, error: str, since: float, left: float) -> bool:
        """The fetch of ``entry`` will retry unreachable storage for up to ``left`` more
        seconds: record it on the entry and its waiters. False if nobody waits for the
        piece: the fetch gives up, and prefetching pauses for a while."""
        now = time.monotonic()
        if not entry.waiters:
            self.prefetch_paused_until = now + PREFETCH_PAUSE_S
            return False
        assert entry.ref is not None
        fault = StorageFault(entry.ref.url, error, since, now + left)
        if entry.fault is None:
            self.retrying_pieces += 1
        entry.fault = fault
        if self.outage is None:
            self._outage_began = since
            log.warning(
                "object storage does not answer (%s): retrying with backoff for up to %.0f s "
                "(--storage-retry-s) while the requests that need it wait",
                error, left,
            )  # fmt: skip
        self.outage = fault
        for waiter in entry.waiters:
            waiter.fault = fault
        return True

    def cleared(self, entry: PieceEntry) -> bool:
        """``entry``'s fetch is over (whatever its outcome): no fault on it any more.
        True when that ended the outage (no piece retries any more)."""
        if entry.fault is None:
            return False
        entry.fault = None
        self.retrying_pieces -= 1
        if self.retrying_pieces:
            return False
        log.warning(
            "object storage answers again (after %.0f s)",
            time.monotonic() - self._outage_began,
        )
        self.outage = None
        return True

    @staticmethod
    def attach(waiter: Waiter, entry: PieceEntry) -> None:
        """``waiter`` waits for ``entry`` from now on (it learns of the entry's fault)."""
        if entry.fault is not None:
            waiter.fault = entry.fault

    @staticmethod
    def refresh(waiter: Waiter) -> None:
        """One of ``waiter``'s pieces is in: its fault is that of another piece it still
        waits for, if any."""
        waiter.fault = next(
            (e.fault for e in waiter.pinned if e.fault is not None and e.digest in waiter.pending),
            None,
        )

    def prefetch_paused(self, now: float) -> bool:
        """True while no prefetch should start: storage does not answer."""
        return self.retrying_pieces > 0 or now < self.prefetch_paused_until

    # -- the loop, without the lock -------------------------------------------------------

    def of(self, waiter: Waiter) -> StorageFault | None:
        """Why ``waiter`` still waits, if object storage does not answer: the fault of one
        of its pieces, else the outage (its pieces wait for a fetcher busy retrying)."""
        if waiter.done:
            return None
        return waiter.fault or self.outage

    # -- the fetch threads, without the cache's lock ----------------------------------------

    def record(self, ref: PieceRef, error: PieceUnreadable | None) -> None:
        """Record the outcome of a fetch of ``ref`` in the health of its dataset."""
        name, url = ref.dataset_name, ref.url
        if error is None:
            with self._damaged_lock:
                self._damaged.pop(ref.digest, None)
                # a whole piece does not clear an object another piece of which is damaged
                still_bad = url in self._damaged.values()
            self.health.fetched(name, None if still_bad else url)
        elif isinstance(error, StorageExhausted):
            self.health.failed(name, "exhausted", str(error), url)
        elif isinstance(error, PieceMissing):
            self.health.failed(name, "missing", str(error), url)
        elif isinstance(error, PieceDamaged):
            with self._damaged_lock:
                self._damaged[ref.digest] = url
            self.health.failed(name, "damaged", str(error), url)


# -- a failure belongs to its object -----------------------------------------------------


def failure_key(ref: PieceRef) -> str:
    """The key a missing or damaged piece is remembered under: its content *and* the
    object it was read from. Pieces are shared by content (two datasets holding the same
    bytes share one cached copy), but a failure is the failing object's own: another
    dataset's object with the same content is fetched before that dataset fails."""
    return f"{ref.digest}@{ref.key}"


def reroute(
    entry: PieceEntry,
    error: PieceUnreadable,
    waiters: list[Waiter],
    failed: FailureMemory[PieceUnreadable],
    demand: deque[PieceEntry],
) -> list[Waiter]:
    """The fetch of ``entry`` from its object failed with ``error`` (remembered in
    ``failed`` under :func:`failure_key`): return the waiters that fail (each with its
    ``error`` set: that of its own object). Waiters that read the same content from
    another object (another dataset), not failed lately, wait on: ``entry`` is queued
    again (on ``demand``, the cache's queue, for its fetchers) with that object's ref,
    so that one dataset's missing object never fails another's."""
    assert entry.ref is not None
    now = time.monotonic()
    fail, others = [], []
    for waiter in waiters:
        own = next((r for r in waiter.refs if r.digest == entry.digest), entry.ref)
        own_error = error if own.key == entry.ref.key else failed.recent(failure_key(own), now)
        if own_error is not None:
            waiter.error = own_error
            fail.append(waiter)
        else:
            others.append((waiter, own))
    if others:
        entry.ref, entry.state, entry.demand = others[0][1], QUEUED, True
        entry.waiters = [waiter for waiter, _ in others]
        demand.append(entry)
    return fail
