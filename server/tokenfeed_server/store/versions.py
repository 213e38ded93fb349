"""Where a dataset's versions live: the layout shared by publish, serving, the writer and gc.

A dataset is a series of immutable versions; a version's id is its build's
:attr:`~tokenfeed_server.store.manifest.Manifest.fingerprint` (a 32-hex blake2b-128 of the
content), so a job pinned to a fingerprint (its checkpoint, its welcome) names its
version without any new field.

* **Object storage** (``s3://BUCKET/PREFIX``): ``NAME/manifest.json`` stays the current
  version (servers from before versions keep working). Every publish first writes the
  immutable ``NAME/versions/<fingerprint>.json`` (the same bytes), then
  ``NAME/manifest.json``, then the catalog :data:`CATALOG_KEY` (see
  :mod:`~tokenfeed_server.store.catalog`). Shards are content-addressed objects right
  under ``NAME/``, shared by every version that names them.
* **Local** (a directory): ``STORE/NAME/`` is the current version; an overwrite moves the
  previous build to ``STORE/_tokenfeed/versions/NAME/<fingerprint>/`` (its directory's
  mtime set to the moment it was retired) instead of deleting it; a build of content
  kept already goes inside that directory (:data:`COPY_PREFIX`): jobs may be reading it.

A store written before this layout has no ``versions/`` and no catalog: its current
manifest is then its only version. ``_tokenfeed`` can never be a dataset name (names start
with a letter or digit), so the reserved prefix never collides with a dataset. Pruning
old versions is gc's job, which reads this layout through :func:`list_versions`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from tokenfeed.errors import StoreError
from tokenfeed_server.store.format import MANIFEST_NAME
from tokenfeed_server.store.manifest import Manifest
from tokenfeed_server.store.reader import validate_dataset_name

if TYPE_CHECKING:
    from tokenfeed_server.store.objects import ObjectStore

__all__ = [
    "CATALOG_KEY",
    "COPY_PREFIX",
    "RESERVED_PREFIX",
    "VERSIONS_DIR",
    "VersionRef",
    "build_fingerprint",
    "is_fingerprint",
    "list_versions",
    "local_version_dir",
    "local_versions_root",
    "parse_version_key",
    "retire_local_build",
    "version_key",
]

#: The store-level prefix (a key prefix, or a directory) for tokenfeed's own objects.
RESERVED_PREFIX = "_tokenfeed"
#: The catalog object of a remote store, relative to the store prefix.
CATALOG_KEY = f"{RESERVED_PREFIX}/catalog.json"
#: The folder of a dataset's version manifests (remote: ``NAME/versions/``).
VERSIONS_DIR = "versions"

_FINGERPRINT = re.compile(r"[0-9a-f]{32}")
#: The name prefix of a further copy of a kept local version, inside its directory.
COPY_PREFIX = ".copy-"
#: Renames tried to keep a replaced build while gc removes its version meanwhile.
_RETIRE_TRIES = 5

log = logging.getLogger(__name__)


def is_fingerprint(text: object) -> bool:
    """Whether ``text`` looks like a fingerprint (32 lowercase hex digits): the only
    thing ever put into a version's key or path, so a client cannot name a path."""
    return isinstance(text, str) and _FINGERPRINT.fullmatch(text) is not None


def _check_fingerprint(fingerprint: str) -> str:
    if not is_fingerprint(fingerprint):
        raise ValueError(f"{fingerprint!r} is not a dataset fingerprint (32 hex digits)")
    return fingerprint


def version_key(name: str, fingerprint: str) -> str:
    """``NAME/versions/<fingerprint>.json``: a version's manifest, relative to the store."""
    validate_dataset_name(name)
    return f"{name}/{VERSIONS_DIR}/{_check_fingerprint(fingerprint)}.json"


def parse_version_key(key: str) -> tuple[str, str] | None:
    """``(name, fingerprint)`` of a key :func:`version_key` makes; None for any other."""
    parts = key.split("/")
    if len(parts) != 3 or parts[1] != VERSIONS_DIR or not parts[2].endswith(".json"):
        return None
    fingerprint = parts[2][: -len(".json")]
    try:
        validate_dataset_name(parts[0])
    except Exception:
        return None
    return (parts[0], fingerprint) if is_fingerprint(fingerprint) else None


def local_versions_root(store: str | os.PathLike[str], name: str) -> Path:
    """``STORE/_tokenfeed/versions/NAME``: where a local dataset's older builds are kept."""
    return Path(store) / RESERVED_PREFIX / VERSIONS_DIR / validate_dataset_name(name)


def local_version_dir(store: str | os.PathLike[str], name: str, fingerprint: str) -> Path:
    """``STORE/_tokenfeed/versions/NAME/<fingerprint>``: one kept older local build."""
    return local_versions_root(store, name) / _check_fingerprint(fingerprint)


@dataclass(frozen=True)
class VersionRef:
    """One kept version of a dataset.

    ``location``: the key of its version manifest (remote, relative to the store prefix)
    or its directory (local). ``modified``: when it was published (remote) or retired
    from current (local), which orders versions for "keep the last K".
    """

    name: str
    fingerprint: str
    location: str
    modified: datetime


def list_versions(store: Path | ObjectStore, name: str) -> list[VersionRef]:
    """The kept versions of dataset ``name``, newest first.

    Remote: every ``NAME/versions/<fp>.json`` (the current one included, since a publish
    writes its version object first; a dataset published before versions has none: its
    ``manifest.json`` is its only version). Local: the retired builds under
    :func:`local_versions_root` (the current build is ``STORE/NAME`` itself and is not
    listed).
    """
    validate_dataset_name(name)
    found: list[VersionRef] = []
    if isinstance(store, Path):
        root = local_versions_root(store, name)
        entries = list(root.iterdir()) if root.is_dir() else []
        for entry in entries:
            if not is_fingerprint(entry.name) or not entry.is_dir():
                continue
            mtime = datetime.fromtimestamp(entry.stat().st_mtime, timezone.utc)
            found.append(VersionRef(name, entry.name, str(entry), mtime))
    else:
        for info in store.list(f"{name}/{VERSIONS_DIR}/"):
            parsed = parse_version_key(info.key)
            if parsed is not None and parsed[0] == name:
                found.append(VersionRef(name, parsed[1], info.key, info.modified))
    found.sort(key=lambda v: (v.modified, v.fingerprint), reverse=True)
    return found


def build_fingerprint(directory: Path) -> str | None:
    """The fingerprint of the local build in ``directory`` (None: no readable manifest)."""
    try:
        return Manifest.from_json((directory / MANIFEST_NAME).read_bytes()).fingerprint
    except (OSError, StoreError):
        return None


def retire_local_build(store: Path, name: str, old: Path, fingerprint: str | None) -> None:
    """Keep the build just swapped out of ``STORE/NAME`` (now at ``old``) as a version.

    It moves to :func:`local_version_dir` (same file system: one rename), its mtime set to
    now (the moment it stopped being current). A job reading it reopens its shard files by
    name in the directory it opened, wherever that moved
    (:mod:`~tokenfeed_server.store.handles`), so a build with a fingerprint is never
    deleted here: when that version is kept already (the same content built again, e.g. a
    same-content ``prepare --overwrite``), ``old`` goes inside it as ``.copy-<random>``,
    which gc removes with the version (both are judged by the one fingerprint). Without a
    fingerprint (no readable manifest: no server could open it) ``old`` is deleted.
    """
    if fingerprint is None or not is_fingerprint(fingerprint):
        shutil.rmtree(old, ignore_errors=True)
        return
    target = local_version_dir(store, name, fingerprint)
    try:
        _keep(old, target)
    except OSError as exc:  # the new build is published: this one is dropped, said so
        log.warning("dataset %s: replaced build %s not kept (%s); removed", name, old, exc)
        shutil.rmtree(old, ignore_errors=True)
        return
    now = time.time()
    with contextlib.suppress(OSError):  # gone already (another writer's gc): nothing to date
        os.utime(target, (now, now))


def _keep(old: Path, target: Path) -> None:
    """Rename ``old`` to ``target``, or into it when that version is kept already."""
    for _ in range(_RETIRE_TRIES):
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(old, target)
            return
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        try:  # kept already (or a racing writer retired the same content first)
            os.rename(old, target / f"{COPY_PREFIX}{secrets.token_hex(8)}")
            return
        except FileNotFoundError:  # that version removed meanwhile (by gc): keep it anew
            continue
    raise OSError(errno.ENOENT, f"its version was removed {_RETIRE_TRIES} times meanwhile")
