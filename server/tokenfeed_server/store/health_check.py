"""The background re-check that lets a dataset return to ``ok`` without a restart.

The piece cache marks a dataset ``unavailable`` when an object it needs is missing or
damaged (:class:`~tokenfeed_server.store.health.StorageHealth`), and clears the mark when
a fetch of that object succeeds. But a job that failed does not come back by itself to
fetch again, so without a re-check the dataset would stay ``unavailable`` (and ``/readyz``
might stay 503) after the operator put the object back. Every ``recheck_s`` this thread:

* HEADs each object named *missing*: present again with the manifest's size, it is
  :meth:`~StorageHealth.recovered`;
* HEADs each object named *damaged*: once its ETag differs from the one it had when first
  seen damaged (someone re-uploaded it: ``inspect --repair``), it downloads it piece by
  piece and checks every piece against the manifest; whole, it is recovered;
* probes the bucket for a dataset whose retry budget ran out (no object named): storage
  answers again, the dataset is cleared (its next fetch will say if that was premature).

Every ``tick_s`` (memory only) it also forgets what is known of a dataset whose build
changed (a new manifest: its old objects no longer matter) or that is gone.

A local store has nothing to re-check: :meth:`HealthCheck.start` then starts no thread.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import TYPE_CHECKING

from tokenfeed.errors import StoreError
from tokenfeed_server.store.format import piece_digest
from tokenfeed_server.store.health import StorageHealth
from tokenfeed_server.store.manifest import ShardInfo

if TYPE_CHECKING:
    from tokenfeed_server.store.objects import ObjectStore
    from tokenfeed_server.store.serving import Store

__all__ = ["DEFAULT_RECHECK_S", "MAX_OBJECTS_PER_PASS", "HealthCheck"]

log = logging.getLogger(__name__)

#: Seconds between two re-checks of the objects named missing or damaged.
DEFAULT_RECHECK_S = 10.0
#: Objects looked up at most per pass (a dataset deleted whole names many; the ones left
#: wait for a later pass, or clear when a fetch reads them).
MAX_OBJECTS_PER_PASS = 256


class HealthCheck:
    """Re-checks the objects a store's datasets were found lacking (see the module doc).

    ``start()`` returns self, so a server writes ``cleanup.callback(HealthCheck(store)
    .start().stop)``; :meth:`check_now` runs one pass on the caller's thread (tests).
    """

    def __init__(
        self, store: Store, *, recheck_s: float = DEFAULT_RECHECK_S, tick_s: float = 1.0
    ) -> None:
        self.store = store
        self.recheck_s = recheck_s
        self.tick_s = min(tick_s, recheck_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: dataset -> the fingerprint it had at the last tick (None: it fails to open)
        self._builds: dict[str, str | None] = {}
        #: object URL -> its ETag when first seen damaged
        self._damaged_etags: dict[str, str] = {}
        self._cursor = 0  # where the next pass starts among the objects named

    @property
    def health(self) -> StorageHealth | None:
        """The store's health record (None for a local store)."""
        cache = self.store.cache
        return cache.health if cache is not None else None

    @property
    def running(self) -> bool:
        """True while the thread runs (never for a local store)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> HealthCheck:
        """Start the thread (none for a local store); returns self."""
        if self.health is not None and self.store.objects is not None and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name="tokenfeed-health-check", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and wait for it (a HEAD in flight ends by its own timeout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        waited = 0.0
        while not self._stop.wait(self.tick_s):
            waited += self.tick_s
            try:
                self.forget_replaced()
                if waited >= self.recheck_s:
                    waited = 0.0
                    self.check_now()
            except Exception:  # a bug must not end the re-checks: log, try again later
                log.exception("storage health re-check failed")

    # -- one pass ------------------------------------------------------------------------

    def forget_replaced(self) -> None:
        """Forget the health of datasets whose build changed or that are gone."""
        health = self.health
        if health is None:
            return
        builds = {
            str(s["name"]): (str(s["fingerprint"]) if s.get("ok") else None)
            for s in self.store.summaries()
        }
        for name, build in self._builds.items():
            if builds.get(name, "") != build:  # "": not listed any more
                health.forget(name)
        self._builds = builds

    def check_now(self) -> None:
        """Re-check the objects named missing or damaged (:data:`MAX_OBJECTS_PER_PASS` at
        most, in turns) and the datasets whose retry budget ran out; clear what is whole."""
        health, objects = self.health, self.store.objects
        if health is None or objects is None:
            return
        troubled = health.snapshot()
        exhausted = [n for n, h in troubled.items() if h.state == "unavailable" and not h.objects]
        if exhausted and self._storage_answers(objects):
            for name in exhausted:
                health.fetched(name)
                log.info("dataset %s: object storage answers again", name)
        named = [(n, url, kind) for n, st in troubled.items() for url, kind in st.objects.items()]
        # At most so many per pass, starting where the last pass stopped: all get their turn.
        start = self._cursor % len(named) if named else 0
        turn = (named[start:] + named[:start])[:MAX_OBJECTS_PER_PASS]
        self._cursor = start + len(turn)
        for name, url, kind in turn:
            if self._stop.is_set():
                return
            self._recheck(health, objects, name, url, kind)
        for url in set(self._damaged_etags) - {url for _, url, _ in named}:
            del self._damaged_etags[url]

    @staticmethod
    def _storage_answers(objects: ObjectStore) -> bool:
        try:
            objects.check_bucket()
        except Exception as exc:  # still down (or refused): stays as it is
            log.debug("%s: storage still does not answer: %s", objects.url(), exc)
            return False
        return True

    def _recheck(
        self, health: StorageHealth, objects: ObjectStore, name: str, url: str, kind: str
    ) -> None:
        key = _key_of(objects, url)
        if key is None:
            return
        shard = self._shard_of(name, key)
        try:
            info = objects.head(key)
        except Exception as exc:  # storage down: the next pass tries again
            log.debug("%s: re-check failed: %s", url, exc)
            return
        if info is None or (shard is not None and info.size != shard[1]):
            return
        if kind == "damaged":
            first = self._damaged_etags.setdefault(url, info.etag)
            if info.etag == first or shard is None or not self._whole(objects, key, *shard):
                self._damaged_etags[url] = info.etag
                return
        health.recovered(name, url)
        self._damaged_etags.pop(url, None)
        log.info("dataset %s: %s is whole again (%s before)", name, url, kind)

    def _shard_of(self, name: str, key: str) -> tuple[ShardInfo, int, int] | None:
        """The current manifest's shard stored as ``key``: (shard, size, piece size)."""
        try:
            manifest = self.store.get(name).manifest
        except Exception:  # fails to open now: no size to compare with
            return None
        for k, shard in enumerate(manifest.shards):
            if f"{name}/{shard.name}" == key:
                try:  # the one accessor: version 3 reads the sidecar once
                    pieces = manifest.shard_pieces(k)
                except StoreError:
                    return None
                found = replace(shard, pieces=pieces)
                return found, found.file_size(manifest.itemsize), manifest.piece_bytes
        return None

    def _whole(
        self, objects: ObjectStore, key: str, shard: ShardInfo, size: int, piece_bytes: int
    ) -> bool:
        """Every piece of object ``key`` matches the manifest (one GET per piece)."""
        if not shard.pieces or piece_bytes <= 0:
            return False
        for i, digest in enumerate(shard.pieces):
            if self._stop.is_set():
                return False
            start = i * piece_bytes
            try:
                data = objects.get_range(key, start, min(start + piece_bytes, size))
            except Exception:
                return False
            if piece_digest(data) != digest:
                return False
        return True


def _key_of(objects: ObjectStore, url: str) -> str | None:
    """The key (relative to the store) of object ``url``; None if it is not the store's."""
    base = objects.url().rstrip("/") + "/"
    return url[len(base) :] if url.startswith(base) else None
