"""``tokenfeed-server gc``: delete the objects no current manifest references.

Publishing never deletes (:mod:`~tokenfeed_server.store.publish`): ``--overwrite`` leaves
the previous build's shards, and an interrupted publish leaves the files it uploaded.
``gc`` lists each dataset prefix ``PREFIX/NAME/``, reads its current manifest and deletes
the objects that the manifest does not name, once both the object and the manifest are
older than the grace period (default an hour): a server that opened the previous build
may read its shards until it notices the new manifest (so the clock starts when the
manifest replaced it), and a publish in progress has uploaded files its manifest does not
name yet (so the clock starts at the upload). A prefix without a manifest (a first
publish that never finished) is all unreferenced. A manifest that cannot be read stops gc
for that dataset: it deletes nothing it cannot prove unreferenced. Only objects named as
publish names them (``shard-<id>.bin``, ``<stem>-<hash>.<suffix>``) right under a prefix
with a valid dataset name are ever deleted: anything else sharing the store prefix is
counted as foreign and left alone.

Local stores need no gc for this (a replaced dataset directory is deleted by the writer
once swapped out); there gc removes the temp directories of writers that died.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

from tokenfeed.errors import StoreError, TokenFeedError
from tokenfeed_server.store.format import MANIFEST_NAME, TEMP_PREFIX
from tokenfeed_server.store.manifest import Manifest
from tokenfeed_server.store.objects import ObjectInfo, ObjectStore
from tokenfeed_server.store.reader import validate_dataset_name
from tokenfeed_server.store.writer import clean_stale_temp_dirs

__all__ = ["DEFAULT_GRACE_S", "GcResult", "gc_local", "gc_objects"]

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 3600.0
# shard-<content id>.bin, <stem>-<blake2b-128>[.suffix] (see store.publish)
_CONTENT_NAME = re.compile(r"shard-[0-9a-f]{32}\.bin|[^/]+-[0-9a-f]{32}(\.[^/]+)?")


@dataclass
class GcResult:
    """What gc found under one dataset prefix."""

    dataset: str
    has_manifest: bool = False
    referenced: int = 0
    #: unreferenced and older than the grace period: deleted (or, dry run, to delete)
    deleted: list[ObjectInfo] = field(default_factory=list)
    #: unreferenced but younger than the grace period: kept this time
    young: list[ObjectInfo] = field(default_factory=list)
    #: not named like a file publish writes: never deleted
    foreign: list[ObjectInfo] = field(default_factory=list)
    #: why nothing was deleted here ("" when gc ran)
    error: str = ""

    @property
    def deleted_bytes(self) -> int:
        """The bytes of the deleted objects."""
        return sum(o.size for o in self.deleted)


def gc_objects(
    store: ObjectStore,
    *,
    name: str | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
    now: datetime | None = None,
) -> list[GcResult]:
    """Delete unreferenced objects older than ``grace_s`` under each dataset prefix of
    ``store`` (only ``name``'s with ``name``); ``dry_run`` deletes nothing."""
    if grace_s < 0:
        raise TokenFeedError(f"--grace must be >= 0 seconds, got {grace_s}")
    if name is not None:
        validate_dataset_name(name)
    store.check_bucket()
    groups: dict[str, list[ObjectInfo]] = {}
    for info in store.list(f"{name}/" if name is not None else ""):
        dataset, sep, _ = info.key.partition("/")
        if sep:  # objects right under the prefix belong to no dataset: never touched
            groups.setdefault(dataset, []).append(info)
    results: list[GcResult] = []
    for dataset in sorted(groups):
        cutoff = (now or datetime.now(timezone.utc)) - timedelta(seconds=grace_s)
        results.append(_gc_dataset(store, dataset, groups[dataset], cutoff, dry_run))
    return results


def _gc_dataset(
    store: ObjectStore, dataset: str, objects: list[ObjectInfo], cutoff: datetime, dry_run: bool
) -> GcResult:
    result = GcResult(dataset)
    manifest_key = f"{dataset}/{MANIFEST_NAME}"
    referenced = {manifest_key}
    manifest_time: datetime | None = None
    if any(o.key == manifest_key for o in objects):
        result.has_manifest = True
        # Read after the listing; its time is looked up after reading it, so the time is
        # never older than the content read (a manifest replaced meanwhile only makes gc
        # wait longer). An object listed for a newer manifest is younger than the grace.
        try:
            manifest = Manifest.from_json(store.get(manifest_key))
            info = store.head(manifest_key)
        except StoreError as exc:
            result.error = f"manifest unreadable, nothing deleted: {exc}"
            log.warning("gc %s: %s", store.url(dataset), result.error)
            return result
        manifest_time = info.modified if info is not None else datetime.now(timezone.utc)
        referenced |= {f"{dataset}/{s.name}" for s in manifest.shards}
        referenced |= {f"{dataset}/{f}" for f in manifest.extra_files}
    result.referenced = sum(1 for o in objects if o.key in referenced)
    for info in objects:
        if info.key in referenced:
            continue
        if not _ours(dataset, info.key):
            result.foreign.append(info)
            continue
        old = info.modified < cutoff and (manifest_time is None or manifest_time < cutoff)
        (result.deleted if old else result.young).append(info)
    if result.deleted and not dry_run:
        # Checked again just before deleting: a publish that reused an object touched it.
        fresh = [
            o for o in result.deleted if (h := store.head(o.key)) is None or h.modified < cutoff
        ]
        result.young += [o for o in result.deleted if o not in fresh]
        result.deleted = fresh
        store.delete(o.key for o in fresh)
        log.info("gc %s: deleted %d object(s)", store.url(dataset), len(fresh))
    return result


def _ours(dataset: str, key: str) -> bool:
    """True for ``DATASET/FILE`` with FILE named the way publish names files (by content):
    gc never deletes anything else, whatever else shares the prefix."""
    name = key[len(dataset) + 1 :]
    return _is_dataset_name(dataset) and _CONTENT_NAME.fullmatch(name) is not None


def _is_dataset_name(name: str) -> bool:
    try:
        validate_dataset_name(name)
    except StoreError:
        return False
    return True


def gc_local(store: Path, *, dry_run: bool = False) -> list[Path]:
    """A local store's gc: the temp directories of dead writers (removed unless
    ``dry_run``; then every temp directory is listed, a live writer's included)."""
    if not store.is_dir():
        raise StoreError(f"store {store} is not a directory")
    if dry_run:
        return sorted(p for p in store.iterdir() if p.name.startswith(TEMP_PREFIX))
    return sorted(clean_stale_temp_dirs(store))
