"""The catalog of a store in object storage: which version of each dataset is current.

``_tokenfeed/catalog.json`` under the store prefix (:data:`~.versions.CATALOG_KEY`)::

    {"format": 1, "datasets": {"NAME": {"fingerprint": "<32 hex>", "published": <unix time>}}}

Why it exists: a server must notice new and replaced datasets. Listing the bucket prefix
for every ``NAME/manifest.json`` costs a request per thousand objects, every few seconds,
on every server; the catalog is one conditional GET per poll (If-None-Match: nothing
comes back while nothing changed), whatever the number of datasets.

``prepare`` updates it last, after ``NAME/manifest.json`` (see
:mod:`~tokenfeed_server.store.publish`), with a read-modify-write that only lands if the
catalog is unchanged since it was read (If-Match), retried when another publish won. In
each attempt the current manifest is read *after* the catalog, so the write that lands
last names the manifest that is current then: two publishes finishing in either order
leave the catalog agreeing with ``manifest.json``. The first publish into a store
without a catalog (written before it existed) seeds it with every dataset found there.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from tokenfeed.errors import StoreError
from tokenfeed_server.store.format import MANIFEST_NAME
from tokenfeed_server.store.manifest import Manifest
from tokenfeed_server.store.objects import (
    ConditionalWritesUnsupported,
    ObjectNotFound,
    ObjectStore,
    PreconditionFailed,
)
from tokenfeed_server.store.reader import is_dataset_name
from tokenfeed_server.store.versions import CATALOG_KEY, is_fingerprint

__all__ = [
    "CATALOG_FORMAT",
    "Catalog",
    "CatalogEntry",
    "CatalogError",
    "poll_catalog",
    "read_catalog",
    "record_current",
    "warn_unconditional",
]

log = logging.getLogger(__name__)

CATALOG_FORMAT = 1
_ATTEMPTS = 20  # concurrent publishes each win one round: plenty for a handful at once
_unconditional_warned: set[str] = set()
_warn_lock = threading.Lock()


class CatalogError(StoreError):
    """The catalog object exists but is not a catalog this tokenfeed reads."""


@dataclass(frozen=True)
class CatalogEntry:
    """One dataset's current version: its fingerprint, and when it was published."""

    fingerprint: str
    published: float


@dataclass(frozen=True)
class Catalog:
    """The parsed catalog and the ETag it was read with ("" when not read from a store)."""

    datasets: Mapping[str, CatalogEntry]
    etag: str = ""

    def to_json(self) -> bytes:
        """The catalog as stored: sorted, so equal catalogs are equal bytes."""
        body = {
            "format": CATALOG_FORMAT,
            "datasets": {
                name: {"fingerprint": e.fingerprint, "published": e.published}
                for name, e in sorted(self.datasets.items())
            },
        }
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, etag: str = "", *, where: str = CATALOG_KEY) -> Catalog:
        """Parse a catalog (CatalogError naming ``where`` and what is wrong)."""
        try:
            raw = json.loads(data)
        except ValueError as exc:
            raise CatalogError(f"{where}: not JSON ({exc})") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("datasets"), dict):
            raise CatalogError(f"{where}: not a tokenfeed catalog (no 'datasets' table)")
        if raw.get("format") != CATALOG_FORMAT:
            raise CatalogError(
                f"{where}: catalog format {raw.get('format')!r}, this tokenfeed reads "
                f"{CATALOG_FORMAT}; upgrade tokenfeed"
            )
        entries: dict[str, CatalogEntry] = {}
        for name, entry in raw["datasets"].items():
            fp = entry.get("fingerprint") if isinstance(entry, dict) else None
            published = entry.get("published", 0) if isinstance(entry, dict) else 0
            if not is_dataset_name(name) or not is_fingerprint(fp):
                raise CatalogError(f"{where}: bad entry {name!r}: {entry!r}")
            if not isinstance(published, int | float):
                raise CatalogError(f"{where}: bad 'published' of {name!r}: {published!r}")
            entries[name] = CatalogEntry(str(fp), float(published))
        return cls(entries, etag)

    def with_entry(self, name: str, fingerprint: str, published: float) -> Catalog:
        """This catalog with ``name`` at ``fingerprint`` (same ETag: the one to match)."""
        return Catalog({**self.datasets, name: CatalogEntry(fingerprint, published)}, self.etag)


def read_catalog(store: ObjectStore) -> Catalog | None:
    """The store's catalog, or None when it has none (a store from before catalogs)."""
    try:
        got = store.get_if_changed(CATALOG_KEY, None)
    except ObjectNotFound:
        return None
    assert got is not None
    return Catalog.from_json(got[0], got[1], where=store.url(CATALOG_KEY))


def poll_catalog(store: ObjectStore, known: Catalog | None) -> Catalog | None:
    """The catalog if it changed since ``known`` was read (``known`` itself, the same
    object, if not), or None if the store has none: one request.

    Raises CatalogError for a catalog that cannot be parsed, the ObjectStoreError of a
    request that failed.
    """
    try:
        got = store.get_if_changed(CATALOG_KEY, known.etag if known is not None else None)
    except ObjectNotFound:
        return None
    if got is None:
        return known
    return Catalog.from_json(got[0], got[1], where=store.url(CATALOG_KEY))


def record_current(store: ObjectStore, name: str) -> Catalog:
    """Set ``name``'s catalog entry to the fingerprint of its current ``manifest.json``;
    return the catalog as written (or as found, when it already said so).

    Read-modify-write with If-Match, retried (with a short random wait) when another
    publish changed the catalog meanwhile. Raises the ObjectStoreError of a failed
    request, or StoreError when the catalog kept changing through every attempt.
    """
    for _ in range(_ATTEMPTS):
        try:
            catalog = read_catalog(store)
        except CatalogError as exc:  # rewritten whole: the catalog is derived data
            log.warning("%s; writing a new catalog", exc)
            catalog = None
        fresh = catalog is None
        if catalog is None:
            catalog = _seed(store, skip=name)
        # After the catalog was read: see the module's docstring.
        current = Manifest.from_json(store.get(f"{name}/{MANIFEST_NAME}")).fingerprint
        entry = catalog.datasets.get(name)
        if entry is not None and entry.fingerprint == current:
            return catalog
        updated = catalog.with_entry(name, current, round(time.time(), 3))
        try:
            etag = _put(store, updated.to_json(), None if fresh else catalog.etag)
        except PreconditionFailed:
            time.sleep(random.uniform(0.01, 0.2))
            continue
        return Catalog(updated.datasets, etag)
    raise StoreError(
        f"{store.url(CATALOG_KEY)}: the catalog kept changing under {_ATTEMPTS} attempts to "
        f"record dataset {name!r} (many publishes at once?); re-run the prepare: its "
        "objects are all uploaded already"
    )


def _put(store: ObjectStore, data: bytes, etag: str | None) -> str:
    """Write the catalog if it is still at ``etag`` (None: if there is none)."""
    try:
        return store.put_bytes(CATALOG_KEY, data, if_match=etag, if_none_match=etag is None)
    except ConditionalWritesUnsupported as exc:
        warn_unconditional(store, exc)
        return store.put_bytes(CATALOG_KEY, data)


def warn_unconditional(store: ObjectStore, exc: BaseException) -> None:
    """Log once per endpoint that writes there cannot be conditional (races possible)."""
    with _warn_lock:
        if store.endpoint in _unconditional_warned:
            return
        _unconditional_warned.add(store.endpoint)
    log.warning(
        "%s; writing without conditions: two prepare runs publishing the same dataset at "
        "the same moment could then overwrite one another's manifest (each version object "
        "is still kept)",
        exc,
    )


def _seed(store: ObjectStore, *, skip: str) -> Catalog:
    """A catalog of every dataset the store holds now (but ``skip``, the caller's): what a
    store written before catalogs gets once, at its first publish with one."""
    entries: dict[str, CatalogEntry] = {}
    for info in store.list():
        dataset, sep, rest = info.key.partition("/")
        if not sep or rest != MANIFEST_NAME or not is_dataset_name(dataset) or dataset == skip:
            continue
        try:
            fp = Manifest.from_json(store.get(info.key)).fingerprint
        except (StoreError, ValueError) as exc:
            log.warning(
                "catalog: dataset %s left out: its manifest is unreadable: %s", dataset, exc
            )
            continue
        entries[dataset] = CatalogEntry(fp, info.modified.timestamp())
    if entries:
        log.info("catalog: recorded %d dataset(s) published before catalogs", len(entries))
    return Catalog(entries)
