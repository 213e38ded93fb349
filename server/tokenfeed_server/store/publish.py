"""Publish a locally written dataset to object storage: files first, then the version.

A dataset is a series of immutable versions (see :mod:`~tokenfeed_server.store.versions`).
Publishing one, in this order:

1. every file it names is uploaded under a content-addressed name
   (:mod:`~tokenfeed_server.store.format`): a shard as ``shard-<content id>.bin``, an extra
   file as ``<stem>-<blake2b-128>.<suffix>``;
2. its manifest is written as the immutable ``NAME/versions/<fingerprint>.json``
   (If-None-Match: a version is never rewritten);
3. then as ``NAME/manifest.json``, the current version (readers by name and servers from
   before versions read it), conditionally: If-Match the ETag it had when this publish
   began (If-None-Match when there was none), so that of two ``prepare --overwrite`` runs
   at once exactly one becomes current and the other fails saying so, its version kept;
4. then the catalog (:mod:`~tokenfeed_server.store.catalog`), which servers poll.

Hence an interrupted publish leaves no visible version, only unreferenced objects that
``tokenfeed-server gc`` removes; ``--overwrite`` leaves the previous versions and their
shards, so a job reading one is never cut off. An object already in the bucket under its
content name is reused only if its ETag is the one this upload would give it (an MD5 of
the bytes, per part as boto3 splits it): same name and size is not trusted, so a
``prepare --overwrite`` with the same inputs repairs a damaged or truncated object. A
reused object is touched, so that a concurrent ``gc`` sees it as fresh. Where the service
does not support conditional writes, they are made unconditionally (logged once).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path, PurePosixPath

from tokenfeed.errors import DatasetExists, DatasetNotFound, ManifestError, StoreError
from tokenfeed_server.store.catalog import record_current, warn_unconditional
from tokenfeed_server.store.format import MANIFEST_NAME, shard_content_id
from tokenfeed_server.store.manifest import Manifest
from tokenfeed_server.store.objects import (
    BucketNotFound,
    ConditionalWritesUnsupported,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    PreconditionFailed,
)
from tokenfeed_server.store.reader import validate_dataset_name
from tokenfeed_server.store.sidecar import attach_local_pieces
from tokenfeed_server.store.versions import version_key

__all__ = [
    "PublishConflict",
    "content_name",
    "upload_etags",
    "publish_dataset",
    "published_names",
    "read_published",
]

log = logging.getLogger(__name__)
_HASH_CHUNK = 1 << 22
_FILES_AT_ONCE = 4
_MAX_COPY = 5 << 30
# what _upload did with one file
_KEPT, _UPLOADED, _REPLACED = "kept", "uploaded", "replaced"


class PublishConflict(StoreError):
    """Another publish of the same dataset became current while this one uploaded."""


def content_name(name: str, path: Path) -> str:
    """``tokenizer.json`` -> ``tokenizer-<blake2b-128 of the file>.json``."""
    hasher = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            hasher.update(chunk)
    pure = PurePosixPath(name)
    return f"{pure.stem}-{hasher.hexdigest()}{pure.suffix}"


def published_names(manifest: Manifest) -> list[str]:
    """The content-addressed name of each shard of a version-2 or -3 manifest, in order
    (version 3: its sidecar is read)."""
    if manifest.format_version < 2:
        raise ManifestError(
            f"dataset {manifest.name!r} has a version-{manifest.format_version} manifest "
            "without piece checksums; re-run tokenfeed-server prepare to publish it"
        )
    digests, bases, p = manifest.piece_digests(), manifest.piece_bases(), manifest.piece_bytes
    return [
        f"shard-{shard_content_id(p, digests.raw(bases[k], bases[k + 1]))}.bin"
        for k in range(len(manifest.shards))
    ]


def _read_local(local_dir: Path) -> Manifest:
    """The manifest of the local build in ``local_dir``, its sidecar (version 3) checked
    for its size and ready to read."""
    fd = os.open(local_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        manifest = Manifest.from_json((local_dir / MANIFEST_NAME).read_bytes())
        attach_local_pieces(manifest, fd, local_dir)
    finally:
        os.close(fd)
    return manifest


def publish_dataset(
    local_dir: Path,
    store: ObjectStore,
    name: str,
    *,
    overwrite: bool = False,
    on_upload: Callable[[str, int], None] | None = None,
) -> Manifest:
    """Upload the dataset in ``local_dir`` as the current version of ``NAME`` of
    ``store``; return its manifest as published (content-addressed names; same
    fingerprint as the local one).

    Raises DatasetExists if ``NAME`` has a manifest and not ``overwrite``,
    :class:`PublishConflict` if another publish of ``NAME`` became current meanwhile (this
    version is kept, not current), and the ObjectStoreError of a request that failed after
    retries. ``on_upload(key, bytes)`` is called after each upload (progress, tests).
    """
    validate_dataset_name(name)
    local = _read_local(local_dir)
    store.check_bucket()
    manifest_key = f"{name}/{MANIFEST_NAME}"
    before = store.head(manifest_key)  # the version this one replaces (If-Match)
    if not overwrite and before is not None:
        raise DatasetExists(
            f"dataset {name!r} already exists at {store.url(name)}; pass --overwrite to "
            "replace it (its old versions stay until tokenfeed-server gc)"
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
    sidecar = _add_sidecar(local, local_dir, name, files)
    outcomes = _upload_all(store, files, on_upload)
    published = local.with_names(shard_names, extra_names, pieces_file=sidecar)
    data = published.to_json().encode()
    published = Manifest.from_json(data)  # what readers will parse
    published.adopt_pieces(local)
    _put_version(store, name, published.fingerprint, data)
    _put_current(store, name, data, before, published.fingerprint)
    if on_upload is not None:
        on_upload(manifest_key, len(data))
    record_current(store, name)
    log.info(
        "published %s version %s: %d shards; %d of %d files uploaded (%d replaced because "
        "they did not match)",
        store.url(name),
        published.fingerprint,
        len(published.shards),
        outcomes.count(_UPLOADED) + outcomes.count(_REPLACED),
        len(files),
        outcomes.count(_REPLACED),
    )
    return published


def _add_sidecar(local: Manifest, local_dir: Path, name: str, files: dict[str, Path]) -> str:
    """Version 3: add the sidecar to ``files`` under its content name (like an extra
    file: ``pieces-<its checksum>.bin``) and return that name ("" before version 3)."""
    if local.format_version < 3:
        return ""
    sidecar = content_name(local.pieces_file, local_dir / local.pieces_file)
    files[f"{name}/{sidecar}"] = local_dir / local.pieces_file
    return sidecar


def _put_version(store: ObjectStore, name: str, fingerprint: str, data: bytes) -> None:
    """Write ``NAME/versions/<fingerprint>.json`` unless that version is there intact (the
    same content built again: its manifest differs at most in ``created``)."""
    key = version_key(name, fingerprint)
    try:
        store.put_bytes(key, data, if_none_match=True)
        return
    except PreconditionFailed:
        pass
    except ConditionalWritesUnsupported as exc:
        warn_unconditional(store, exc)
    try:
        if Manifest.from_json(store.get(key)).fingerprint == fingerprint:
            return
    except (ObjectNotFound, ManifestError):
        pass
    log.warning("%s is missing or damaged: written again", store.url(key))
    store.put_bytes(key, data)


def _put_current(
    store: ObjectStore, name: str, data: bytes, before: ObjectInfo | None, fingerprint: str
) -> None:
    """Make ``data`` ``NAME/manifest.json`` if it is still the one this publish began with
    (``before``; None: none)."""
    key = f"{name}/{MANIFEST_NAME}"
    try:
        if before is None:
            store.put_bytes(key, data, if_none_match=True)
        else:
            store.put_bytes(key, data, if_match=before.etag)
        return
    except (PreconditionFailed, ObjectNotFound):
        if before is None and store.head(key) is not None:
            raise DatasetExists(
                f"dataset {name!r} appeared at {store.url(name)} while uploading (another "
                "prepare published it); pass --overwrite to replace it"
            ) from None
        raise PublishConflict(
            f"dataset {name!r} was republished meanwhile by another prepare; re-run to "
            f"publish on top of it (this build, version {fingerprint}, is uploaded and kept "
            f"as {store.url(version_key(name, fingerprint))}, but is not current)"
        ) from None
    except ConditionalWritesUnsupported as exc:
        warn_unconditional(store, exc)
    if before is None and store.head(key) is not None:
        raise DatasetExists(
            f"dataset {name!r} appeared at {store.url(name)} while uploading; pass "
            "--overwrite to replace it"
        )
    store.put_bytes(key, data)


def _upload_all(
    store: ObjectStore, files: dict[str, Path], on_upload: Callable[[str, int], None] | None
) -> list[str]:
    """Upload ``files`` (key -> path), a few at once; return what was done with each.

    Files at once: small shards would otherwise go one request at a time, and a big one
    is already split into parallel parts by boto3. The first failure cancels what has
    not started, waits for what has (so nothing lands after this returns) and is raised.
    """
    pool = ThreadPoolExecutor(max_workers=_FILES_AT_ONCE, thread_name_prefix="tokenfeed-upload")
    try:
        futures = [pool.submit(_upload, store, key, path, on_upload) for key, path in files.items()]
        done = [f.result() for f in as_completed(futures)]
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    return done


def _upload(
    store: ObjectStore, key: str, path: Path, on_upload: Callable[[str, int], None] | None
) -> str:
    """Upload one file unless the object under its content name holds exactly its bytes."""
    size = path.stat().st_size
    info = store.head(key)
    # Reused only on proof: the ETag this upload would give it. Name and size alone are
    # what a damaged upload (or bytes overwritten in place) keeps.
    # (S3 copies at most 5 GiB in one request: a bigger object is reused untouched, and
    # only a gc with a grace shorter than the publish could take it.)
    if (
        info is not None
        and info.size == size
        and info.etag in upload_etags(store, path, size)
        and (size > _MAX_COPY or store.touch(key))
    ):
        log.debug("%s already uploaded", store.url(key))
        return _KEPT
    if info is not None:
        log.warning("%s does not match %s: uploaded again", store.url(key), path)
    store.put_file(key, path)
    if on_upload is not None:
        on_upload(key, size)
    return _UPLOADED if info is None else _REPLACED


def upload_etags(store: ObjectStore, path: Path, size: int | None = None) -> frozenset[str]:
    """The ETags an intact object of ``path``'s bytes has in ``store``: the MD5 of the
    bytes (a single PUT, or a copy of the object onto itself), and for a multipart upload
    the MD5 of its parts' MD5s with ``-<parts>``, parts as :meth:`ObjectStore.put_file`
    cuts them."""
    size = path.stat().st_size if size is None else size
    part = store.part_size(size)
    whole = hashlib.md5(usedforsecurity=False)
    digests: list[bytes] = []
    with path.open("rb") as f:
        while True:
            left = part if part is not None else _HASH_CHUNK
            piece = hashlib.md5(usedforsecurity=False)
            while left > 0 and (chunk := f.read(min(_HASH_CHUNK, left))):
                whole.update(chunk)
                piece.update(chunk)
                left -= len(chunk)
            if left == (part if part is not None else _HASH_CHUNK):
                break  # nothing read: the end
            digests.append(piece.digest())
    etags = {whole.hexdigest()}
    if part is not None:
        combined = hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest()
        etags.add(f"{combined}-{len(digests)}")
    return frozenset(etags)


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
        manifest = Manifest.from_json(text)
    except ManifestError as exc:
        raise ManifestError(
            f"{store.url(key)}: {exc}; re-run tokenfeed-server prepare ... --overwrite"
        ) from exc
    if manifest.format_version >= 3:
        # read (and checked) only if a digest is needed: verify --verify, a repair
        sidecar = f"{name}/{manifest.pieces_file}"
        manifest.attach_pieces(lambda: store.get(sidecar), store.url(sidecar))
    return manifest
