"""The older versions of datasets a serving Store keeps open for the jobs pinned to them.

A job reads the version it started on until it ends (see
:mod:`~tokenfeed_server.store.versions`). When a dataset is replaced, the Store's current
entry moves on and the previous :class:`~tokenfeed_server.store.reader.Dataset` lives on in
the jobs that hold it; :class:`PinnedVersions` keeps a *weak* reference to it, so that a
reconnecting worker of such a job, or a new job resumed from a checkpoint of it, finds it
by fingerprint, and it is freed (its files closed) with the last job that reads it, as
before versions.

A version no job holds any more (a resume hours later, a server restarted) is opened
again on demand. Opening does I/O, which the data plane's loop thread must never wait
for: the loop asks (:meth:`PinnedVersions.request`) and answers the client "retry"
(:class:`VersionOpening`); the Store's watcher thread opens it and keeps it here, held
strongly for :data:`PIN_S` seconds so that the client's retry finds it; by then a job
holds it. A version that is not kept any more is remembered briefly as
:class:`VersionGone`, so the workers of one job do not each cost a lookup.

Only the watcher thread changes the tables (replaced whole, never mutated: the loop
reads them without a lock); requests go through a lock.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenfeed.errors import DatasetNotFound, StoreError
from tokenfeed_server.store.errors import ObjectStoreError

if TYPE_CHECKING:
    from tokenfeed_server.store.reader import Dataset

__all__ = ["PIN_S", "PinnedVersions", "VersionGone", "VersionOpening"]

log = logging.getLogger(__name__)

#: Seconds a version opened on demand is held before only jobs hold it.
PIN_S = 120.0
#: Seconds a failed open is answered from memory: a version not kept (or damaged) costs
#: one lookup per this time, whatever the number of workers asking; object storage that
#: failed, a shorter time (it may answer at the next try).
_GONE_S = 10.0
_UNREACHABLE_S = 2.0

_Key = tuple[str, str]  # (dataset name, fingerprint)


class VersionOpening(StoreError):
    """The version a hello pins is being opened off the loop: ask again shortly."""


class VersionGone(StoreError):
    """The version a hello pins is not kept in the store any more."""


class PinnedVersions:
    """Older versions by (name, fingerprint): weakly while jobs hold them, strongly for a
    while after an on-demand open; recent failures; and the opens asked for."""

    def __init__(self, *, pin_s: float = PIN_S) -> None:
        self.pin_s = pin_s
        self._alive: dict[_Key, weakref.ref[Dataset]] = {}
        self._pinned: dict[_Key, tuple[Dataset, float]] = {}
        self._failed: dict[_Key, tuple[StoreError, float]] = {}
        self._requests: dict[_Key, None] = {}  # ordered set, under the lock
        self._lock = threading.Lock()

    # -- the loop thread -----------------------------------------------------------------

    def lookup(self, name: str, fingerprint: str) -> Dataset | None:
        """The open version, or None; raises the error of a recent failed open of it."""
        key = (name, fingerprint)
        ref = self._alive.get(key)
        ds = ref() if ref is not None else None
        if ds is not None:
            return ds
        failed = self._failed.get(key)
        if failed is not None and failed[1] > time.monotonic():
            raise failed[0]
        return None

    def request(self, name: str, fingerprint: str) -> None:
        """Ask the watcher to open this version."""
        with self._lock:
            self._requests[(name, fingerprint)] = None

    # -- the watcher thread --------------------------------------------------------------

    def take_requests(self) -> list[_Key]:
        """The opens asked for since the last call, oldest first."""
        with self._lock:
            keys, self._requests = list(self._requests), {}
        return keys

    def open_requested(
        self,
        open_version: Callable[[str, str], Dataset],
        gone: Callable[[str, str], str],
    ) -> None:
        """Open the versions asked for with ``open_version(name, fingerprint)`` (which
        raises DatasetNotFound for a version not kept: remembered as
        :class:`VersionGone` with the message ``gone(name, fingerprint)``)."""
        for name, fingerprint in self.take_requests():
            try:
                if self.lookup(name, fingerprint) is not None:
                    continue  # opened meanwhile
            except StoreError:
                continue  # failed a moment ago: answered from memory until it expires
            try:
                ds = open_version(name, fingerprint)
            except DatasetNotFound:
                self.fail(name, fingerprint, VersionGone(gone(name, fingerprint)), _GONE_S)
                log.warning("dataset %s: a job asks for version %s, not kept", name, fingerprint)
            except ObjectStoreError as exc:
                self.fail(name, fingerprint, exc, _UNREACHABLE_S)
            except StoreError as exc:
                self.fail(name, fingerprint, exc, _GONE_S)
                log.error("dataset %s: version %s cannot be opened: %s", name, fingerprint, exc)
            except Exception as exc:  # a bug: that version fails, the server goes on
                log.exception("dataset %s: version %s cannot be opened", name, fingerprint)
                error = StoreError(f"dataset {name!r} version {fingerprint}: {exc!r}")
                self.fail(name, fingerprint, error, _GONE_S)
            else:
                self.add(ds, pin=True)
                log.info("dataset %s: opened kept version %s for a job", name, fingerprint)

    def add(self, ds: Dataset, *, pin: bool) -> None:
        """Track ``ds`` (a replaced current one, or ``pin``: just opened on demand)."""
        key = (ds.name, ds.fingerprint)
        self._alive = {**self._alive, key: weakref.ref(ds)}
        if pin:
            self._pinned = {**self._pinned, key: (ds, time.monotonic() + self.pin_s)}
        if key in self._failed:
            self._failed = {k: v for k, v in self._failed.items() if k != key}

    def fail(self, name: str, fingerprint: str, error: StoreError, seconds: float) -> None:
        """Remember for ``seconds`` that opening this version failed with ``error``."""
        until = time.monotonic() + seconds
        self._failed = {**self._failed, (name, fingerprint): (error, until)}

    def prune(self) -> None:
        """Drop expired pins and failures, and the versions no job holds any more."""
        now = time.monotonic()
        if any(until <= now for _, until in self._pinned.values()):
            self._pinned = {k: v for k, v in self._pinned.items() if v[1] > now}
        if any(until <= now for _, until in self._failed.values()):
            self._failed = {k: v for k, v in self._failed.items() if v[1] > now}
        if any(ref() is None for ref in self._alive.values()):
            self._alive = {k: r for k, r in self._alive.items() if r() is not None}

    # -- any thread ----------------------------------------------------------------------

    def fingerprints(self, name: str) -> list[str]:
        """The fingerprints of ``name``'s older versions open now, sorted."""
        return sorted(fp for (n, fp), ref in self._alive.items() if n == name and ref())

    def held(self) -> dict[str, list[str]]:
        """``{name: fingerprints}`` of every older version open now."""
        out: dict[str, list[str]] = {}
        for (name, fp), ref in sorted(self._alive.items()):
            if ref() is not None:
                out.setdefault(name, []).append(fp)
        return out

    def close(self) -> None:
        """Close every version still open (the server is stopping)."""
        alive, self._alive, self._pinned = self._alive, {}, {}
        for ref in alive.values():
            ds = ref()
            if ds is not None:
                ds.close()
