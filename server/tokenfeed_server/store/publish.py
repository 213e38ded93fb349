"""Publish a locally written dataset to object storage: files first, the manifest last.

``s3://BUCKET/PREFIX/NAME/manifest.json`` is a dataset's only entry point, so a dataset
exists for readers exactly from the moment its manifest is uploaded (one PUT, which S3
makes visible whole). Before that every file it names is uploaded under a
content-addressed name (:mod:`~tokenfeed_server.store.format`): a shard as
``shard-<content id>.bin``, an extra file as ``<stem>-<blake2b-128>.<suffix>``. Hence:

* an interrupted publish leaves no visible dataset, only unreferenced objects that
  ``tokenfeed-server gc`` removes after its grace period;
* ``--overwrite`` replaces the manifest only; the previous build's shards stay, so a
  server still reading them is never cut off, until ``gc``;
* republishing identical files uploads nothing again: an object of the same name and
  size is reused (and touched, so that a concurrent ``gc`` sees it as fresh).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path, PurePosixPath

from tokenfeed.errors import DatasetExists, DatasetNotFound, ManifestError
from tokenfeed_server.store.format import MANIFEST_NAME, shard_content_id
from tokenfeed_server.store.manifest import Manifest
from tokenfeed_server.store.objects import BucketNotFound, ObjectNotFound, ObjectStore
from tokenfeed_server.store.reader import validate_dataset_name

__all__ = [
    "content_name",
    "publish_dataset",
    "published_names",
    "read_published",
]

log = logging.getLogger(__name__)
_HASH_CHUNK = 1 << 22
_FILES_AT_ONCE = 4
_MAX_COPY = 5 << 30


def content_name(name: str, path: Path) -> str:
    """``tokenizer.json`` -> ``tokenizer-<blake2b-128 of the file>.json``."""
    hasher = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            hasher.update(chunk)
    pure = PurePosixPath(name)
    return f"{pure.stem}-{hasher.hexdigest()}{pure.suffix}"


def published_names(manifest: Manifest) -> list[str]:
    """The content-addressed name of each shard of a version-2 manifest, in order."""
    if manifest.format_version < 2:
        raise ManifestError(
            f"dataset {manifest.name!r} has a version-{manifest.format_version} manifest "
            "without piece checksums; re-run tokenfeed-server prepare to publish it"
        )
    return [
        f"shard-{shard_content_id(manifest.piece_bytes, s.pieces)}.bin" for s in manifest.shards
    ]


def publish_dataset(
    local_dir: Path,
    store: ObjectStore,
    name: str,
    *,
    overwrite: bool = False,
    on_upload: Callable[[str, int], None] | None = None,
) -> Manifest:
    """Upload the dataset in ``local_dir`` as ``NAME`` of ``store``; return its manifest
    as published (content-addressed names; same fingerprint as the local one).

    Raises DatasetExists if ``NAME`` has a manifest and not ``overwrite``, and the
    ObjectStoreError of a request that failed after retries (nothing visible changed
    then). ``on_upload(key, bytes)`` is called after each upload (progress, tests).
    """
    validate_dataset_name(name)
    local = Manifest.from_json((local_dir / MANIFEST_NAME).read_bytes())
    store.check_bucket()
    manifest_key = f"{name}/{MANIFEST_NAME}"
    if not overwrite and store.head(manifest_key) is not None:
        raise DatasetExists(
            f"dataset {name!r} already exists at {store.url(name)}; pass --overwrite to "
            "replace it (its old shards stay until tokenfeed-server gc)"
        )
    shard_names = published_names(local)
    files: dict[str, Path] = {}  # key -> local file; equal shards share one object
    for shard, remote in zip(local.shards, shard_names, strict=True):
        files.setdefault(f"{name}/{remote}", local_dir / shard.name)
    extra_names: dict[str, str] = {}
    for extra in local.extra_files:
        remote = content_name(extra, local_dir / extra)
        extra_names[extra] = remote
        files[f"{name}/{remote}"] = local_dir / extra
    uploaded = _upload_all(store, files, on_upload)
    published = local.with_names(shard_names, extra_names)
    published = Manifest.from_json(published.to_json())  # what readers will parse
    if not overwrite and store.head(manifest_key) is not None:  # published meanwhile
        raise DatasetExists(
            f"dataset {name!r} appeared at {store.url(name)} while uploading; pass "
            "--overwrite to replace it"
        )
    store.put_bytes(manifest_key, published.to_json().encode())
    if on_upload is not None:
        on_upload(manifest_key, len(published.to_json().encode()))
    log.info(
        "published %s: %d shards, %d of %d files uploaded (the rest were there already)",
        store.url(name),
        len(published.shards),
        uploaded,
        len(files),
    )
    return published


def _upload_all(
    store: ObjectStore, files: dict[str, Path], on_upload: Callable[[str, int], None] | None
) -> int:
    """Upload ``files`` (key -> path), a few at once; return how many were uploaded.

    Files at once: small shards would otherwise go one request at a time, and a big one
    is already split into parallel parts by boto3. The first failure cancels what has
    not started, waits for what has (so nothing lands after this returns) and is raised.
    """
    pool = ThreadPoolExecutor(max_workers=_FILES_AT_ONCE, thread_name_prefix="tokenfeed-upload")
    try:
        futures = [pool.submit(_upload, store, key, path, on_upload) for key, path in files.items()]
        done = sum(f.result() for f in as_completed(futures))
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    return done


def _upload(
    store: ObjectStore, key: str, path: Path, on_upload: Callable[[str, int], None] | None
) -> bool:
    size = path.stat().st_size
    info = store.head(key)
    # Same content-addressed name and size: the same bytes (a different size can only be
    # a damaged upload by something else, which the correct bytes then replace).
    # (S3 copies at most 5 GiB in one request: a bigger object is reused untouched, and
    # only a gc with a grace shorter than the publish could take it.)
    if info is not None and info.size == size and (size > _MAX_COPY or store.touch(key)):
        log.debug("%s already uploaded", store.url(key))
        return False
    store.put_file(key, path)
    if on_upload is not None:
        on_upload(key, size)
    return True


def read_published(store: ObjectStore, name: str) -> Manifest:
    """The manifest of dataset ``name`` in ``store`` (DatasetNotFound if it has none)."""
    validate_dataset_name(name)
    key = f"{name}/{MANIFEST_NAME}"
    try:
        text = store.get(key)
    except ObjectNotFound as exc:
        if isinstance(exc, BucketNotFound):
            raise
        raise DatasetNotFound(
            f"no dataset {name!r} at {store.url(name)} (no {MANIFEST_NAME}); create it with "
            f"tokenfeed-server prepare ... --store {store.url()} --dataset {name}"
        ) from None
    try:
        return Manifest.from_json(text)
    except ManifestError as exc:
        raise ManifestError(
            f"{store.url(key)}: {exc}; re-run tokenfeed-server prepare ... --overwrite"
        ) from exc
