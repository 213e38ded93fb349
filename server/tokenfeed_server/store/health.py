"""What object storage did for each dataset lately: ``ok``, ``degraded``, ``unavailable``.

The piece cache's fetchers write here (a transient fault being retried, an object found
missing or damaged, a fetch that succeeded); the HTTP side reads it for ``/v1/datasets``,
``/readyz``, the console and ``/metrics``. A dataset is

* ``ok``: nothing failed since its last success;
* ``degraded``: a transient fault (refused, reset, timeout, 5xx, throttling) is being
  retried; ``error`` is the last one and ``since`` when the trouble began. Jobs wait;
* ``unavailable``: an object it needs is missing or fails its checksum, or storage did not
  answer within the retry budget; ``objects`` names them. Its jobs fail with an error that
  says what to run.

It returns to ``ok`` by itself: a successful fetch clears ``degraded`` and the object it
read; :meth:`StorageHealth.recovered` clears an object found whole again by a re-check.
Thread-safe; nothing here does I/O.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["DatasetHealth", "FaultKind", "HealthState", "StorageHealth"]

HealthState = Literal["ok", "degraded", "unavailable"]
#: ``unreachable``: transient, retried; ``missing`` / ``damaged``: an object; ``exhausted``:
#: the retry budget ran out.
FaultKind = Literal["unreachable", "missing", "damaged", "exhausted"]


@dataclass(frozen=True)
class DatasetHealth:
    """One dataset's storage health as of :meth:`StorageHealth.of`."""

    state: HealthState = "ok"
    #: the last error, "" when ok
    error: str = ""
    #: unix time the current trouble began (None when ok)
    since: float | None = None
    #: object URL -> "missing" or "damaged" (unavailable datasets)
    objects: dict[str, str] = field(default_factory=dict)


@dataclass
class _Record:
    error: str = ""
    since: float | None = None
    retrying: bool = False
    exhausted: bool = False
    objects: dict[str, str] = field(default_factory=dict)

    def view(self) -> DatasetHealth:
        if self.objects or self.exhausted:
            state: HealthState = "unavailable"
        elif self.retrying:
            state = "degraded"
        else:
            return DatasetHealth()
        return DatasetHealth(state, self.error, self.since, dict(self.objects))


class StorageHealth:
    """Per-dataset storage health and the counters ``/metrics`` shows (see module doc)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._records: dict[str, _Record] = {}
        #: faults seen, by kind (every failed attempt counts, retried or not)
        self.errors: dict[FaultKind, int] = {
            "unreachable": 0,
            "missing": 0,
            "damaged": 0,
            "exhausted": 0,
        }
        #: attempts made again after a transient fault
        self.retries = 0
        #: seconds requests spent waiting for object storage, summed over requests
        self.wait_s = 0.0

    def _record(self, dataset: str) -> _Record:
        record = self._records.get(dataset)
        if record is None:
            record = self._records[dataset] = _Record()
        return record

    def _trouble(self, record: _Record, error: str) -> None:
        record.error = error
        if record.since is None:
            record.since = self._clock()

    def retrying(self, dataset: str, error: str) -> None:
        """A transient fault on ``dataset``'s storage; the fetch will be tried again."""
        with self._lock:
            self.errors["unreachable"] += 1
            self.retries += 1
            record = self._record(dataset)
            record.retrying = True
            self._trouble(record, error)

    def failed(self, dataset: str, kind: FaultKind, error: str, url: str | None = None) -> None:
        """A fetch for ``dataset`` gave up: object ``url`` is ``missing`` or ``damaged``,
        or (``exhausted``) storage did not answer within the retry budget."""
        with self._lock:
            self.errors[kind] += 1
            record = self._record(dataset)
            record.retrying = False
            if kind == "exhausted":
                record.exhausted = True
            elif url is not None and kind in ("missing", "damaged"):
                record.objects[url] = kind
            self._trouble(record, error)

    def fetched(self, dataset: str, url: str | None = None) -> None:
        """A fetch for ``dataset`` succeeded (of object ``url``): storage answers again."""
        with self._lock:
            record = self._records.get(dataset)
            if record is None:
                return
            record.retrying = record.exhausted = False
            if url is not None:
                record.objects.pop(url, None)
            self._settle(dataset, record)

    def recovered(self, dataset: str, url: str) -> None:
        """Object ``url`` was found whole again (a re-check, a new version)."""
        with self._lock:
            record = self._records.get(dataset)
            if record is not None:
                record.objects.pop(url, None)
                self._settle(dataset, record)

    def forget(self, dataset: str) -> None:
        """Drop what is known of ``dataset`` (it was removed, or replaced by a new build)."""
        with self._lock:
            self._records.pop(dataset, None)

    def waited(self, seconds: float) -> None:
        """A request waited ``seconds`` for object storage."""
        with self._lock:
            self.wait_s += max(0.0, seconds)

    def _settle(self, dataset: str, record: _Record) -> None:
        if not (record.retrying or record.exhausted or record.objects):
            del self._records[dataset]

    def of(self, dataset: str) -> DatasetHealth:
        """``dataset``'s health now (``ok`` if nothing is known against it)."""
        with self._lock:
            record = self._records.get(dataset)
            return record.view() if record is not None else DatasetHealth()

    def snapshot(self) -> dict[str, DatasetHealth]:
        """Every dataset that is not ``ok``, by name."""
        with self._lock:
            return {name: record.view() for name, record in self._records.items()}
