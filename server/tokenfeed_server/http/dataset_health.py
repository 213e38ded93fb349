"""Each dataset's health as the HTTP side shows it: ``ok``, ``degraded`` or ``unavailable``.

Two sources, joined here so that ``/v1/datasets``, ``/readyz``, ``/metrics`` and the
console say the same thing:

* the store's listing (:meth:`~tokenfeed_server.store.Store.summaries`): a dataset that
  fails to open is ``unavailable`` with its error (and, when the error is a missing or
  damaged shard object, that object named);
* what object storage did lately for each opened dataset, kept by the piece cache
  (:class:`~tokenfeed_server.store.health.StorageHealth`; a local store has none, and its
  opened datasets are all ``ok``).

A dataset with objects named missing or damaged also gets the command that repairs it
(``inspect ... --verify --repair --source DIR``), whatever the error message it came with.

A dataset that fails to open has no health record to say since when; this view remembers
when it first saw each such error (the server reads its listing at start-up and every
probe of ``/readyz`` reads it again, so that is close to when it began).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tokenfeed_server.store import Store
from tokenfeed_server.store.errors import DamagedShardObject, MissingShardObject
from tokenfeed_server.store.health import DatasetHealth, HealthState
from tokenfeed_server.store.verify import repair_command

__all__ = ["DatasetEntry", "DatasetHealthView"]


@dataclass(frozen=True)
class DatasetEntry:
    """One dataset of the store with its health (see the module doc)."""

    name: str
    #: the store's summary: the manifest's (``ok`` True) or ``{name, ok: False, error}``
    summary: dict[str, Any]
    status: HealthState = "ok"
    error: str | None = None
    since: float | None = None
    #: object URL -> "missing" | "damaged"
    objects: dict[str, str] = field(default_factory=dict)
    #: what to run to make the named objects whole (None: nothing named, or a local store)
    fix: str | None = None

    @property
    def opened(self) -> bool:
        """True if the store opened the dataset (it has a manifest summary)."""
        return bool(self.summary.get("ok"))

    @property
    def serves(self) -> bool:
        """True unless ``unavailable``: a degraded dataset's jobs wait, they do not fail."""
        return self.status != "unavailable"


class DatasetHealthView:
    """The store's datasets with their health, read when asked (memory only: cheap enough
    for every probe of ``/readyz``)."""

    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._clock = clock
        self._lock = threading.Lock()  # handlers run in a thread pool
        #: name -> (the error it fails to open with, when this view first saw it)
        self._broken_since: dict[str, tuple[str, float]] = {}

    def entries(self) -> list[DatasetEntry]:
        """Every dataset of the store, sorted by name, with its health."""
        cache = self._store.cache
        troubled = cache.health.snapshot() if cache is not None else {}
        summaries = self._store.summaries()
        out = [self._with_fix(self._entry(s, troubled.get(s["name"]))) for s in summaries]
        with self._lock:  # forget the datasets that open again, or are gone
            broken = {e.name for e in out if not e.opened}
            for name in set(self._broken_since) - broken:
                del self._broken_since[name]
        return out

    def entry(self, name: str) -> DatasetEntry | None:
        """Dataset ``name`` with its health; None if the store does not list it."""
        for entry in self.entries():
            if entry.name == name:
                return entry
        return None

    def _entry(self, summary: dict[str, Any], health: DatasetHealth | None) -> DatasetEntry:
        name = str(summary["name"])
        if summary.get("ok"):
            if health is None or health.state == "ok":
                return DatasetEntry(name, summary)
            return DatasetEntry(
                name, summary, health.state, health.error or None, health.since,
                dict(health.objects),
            )  # fmt: skip
        error = str(summary.get("error", ""))
        objects = self._open_error_objects(name)
        since = None
        if health is not None and health.state != "ok":
            objects = {**health.objects, **objects}
            since = health.since
        return DatasetEntry(
            name, summary, "unavailable", error, since or self._first_seen(name, error), objects
        )

    def _with_fix(self, entry: DatasetEntry) -> DatasetEntry:
        objects = self._store.objects
        if not entry.objects or objects is None:
            return entry
        return replace(entry, fix=repair_command(objects.url(), entry.name))

    def _first_seen(self, name: str, error: str) -> float:
        with self._lock:
            seen = self._broken_since.get(name)
            if seen is None or seen[0] != error:
                seen = self._broken_since[name] = (error, self._clock())
            return seen[1]

    def _open_error_objects(self, name: str) -> dict[str, str]:
        """The shard object a dataset's open error names, if it is a missing or damaged
        object (the store keeps the exception; its message starts with the object's URL)."""
        try:
            self._store.get(name)
        except MissingShardObject as exc:
            return _named_object(exc, "missing")
        except DamagedShardObject as exc:
            return _named_object(exc, "damaged")
        except Exception:  # any other reason not to open: the error says it
            return {}
        return {}  # opened meanwhile: the next look-up shows it


def _named_object(exc: Exception, kind: str) -> dict[str, str]:
    url = getattr(exc, "url", None)
    if not isinstance(url, str):
        head = str(exc).split(": ", 1)[0]
        url = head if head.startswith("s3://") and " " not in head else None
    return {url: kind} if url else {}
