"""The entry points of the prepare pipeline: :func:`prepare` (a local store, either
engine) and :func:`prepare_objects` (``s3://`` inputs and stores around it).

Object storage: ``s3://`` inputs are downloaded into a scratch directory first (not
streamed: the scatter pass reads each file once, but a download is retried and
resumable per object, and the same local code then runs unchanged); a ``s3://`` store
gets the dataset written into a scratch store, then published by
:func:`~tokenfeed_server.store.publish.publish_dataset` (files first, the manifest last).
The scratch directory (``--scratch-dir``, default the system temp dir) needs room for the
downloaded inputs, the scratch buckets and the shards, and is removed in every case.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from tokenfeed.errors import DatasetExists, PrepareError
from tokenfeed_server.prepare.config import PrepareConfig, PrepareStats
from tokenfeed_server.prepare.corpus import walked
from tokenfeed_server.prepare.local import prepare_local
from tokenfeed_server.prepare.steps import check_and_list_inputs
from tokenfeed_server.store.format import MANIFEST_NAME
from tokenfeed_server.store.manifest import Manifest
from tokenfeed_server.store.objects import ObjectStore, S3Location
from tokenfeed_server.store.publish import publish_dataset
from tokenfeed_server.store.reader import validate_dataset_name

__all__ = ["download_inputs", "prepare", "prepare_objects"]


def prepare(config: PrepareConfig, stats: PrepareStats | None = None) -> Manifest:
    """Build dataset ``config.dataset`` in ``config.store`` from ``config.inputs``.

    Raises PrepareError (BadRecord for bad input, StoreFull when the store's disk fills
    up), DatasetExists, InvalidDatasetName. Leaves nothing behind on failure.
    """
    stats = stats if stats is not None else PrepareStats()
    started = time.perf_counter()
    files = check_and_list_inputs(config)
    if config.engine == "ray":
        # Imported here: Ray and pyarrow are an optional extra of the server.
        from tokenfeed_server.prepare.ray_engine import prepare_ray

        manifest = prepare_ray(config, files, stats)
    else:
        manifest = prepare_local(config, files, stats)
        assert (config.store / config.dataset / MANIFEST_NAME).is_file()
    stats.seconds = time.perf_counter() - started
    return manifest


def prepare_objects(
    config: PrepareConfig,
    *,
    store: S3Location | None = None,
    s3_inputs: Sequence[S3Location] = (),
    scratch_dir: Path | None = None,
    stats: PrepareStats | None = None,
) -> Manifest:
    """:func:`prepare` with object storage: inputs from ``s3_inputs`` too (after
    ``config.inputs``), and the dataset published to ``store`` when given (then
    ``config.store`` is not used). Returns the manifest as published.

    Checks the bucket and an existing dataset before any work (DatasetExists unless
    ``config.overwrite``). Nothing is visible in the store unless the whole dataset was
    uploaded; the scratch directory is removed in every case.
    """
    validate_dataset_name(config.dataset)
    stats = stats if stats is not None else PrepareStats()
    started = time.perf_counter()
    target: ObjectStore | None = None
    if store is not None:
        target = ObjectStore(store)
        target.check_bucket()
        if not config.overwrite and target.head(f"{config.dataset}/{MANIFEST_NAME}"):
            raise DatasetExists(
                f"dataset {config.dataset!r} already exists at {target.url(config.dataset)}; "
                "pass --overwrite to replace it (its old shards stay until "
                "tokenfeed-server gc)"
            )
    if scratch_dir is not None:
        scratch_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="tokenfeed-prepare-", dir=scratch_dir))
    try:
        inputs = config.inputs + tuple(download_inputs(s3_inputs, scratch / "inputs"))
        local = replace(config, inputs=inputs)
        if target is not None:
            local = replace(local, store=scratch / "store", overwrite=False)
        manifest = prepare(local, stats)
        if target is not None:
            manifest = publish_dataset(
                local.store / config.dataset, target, config.dataset, overwrite=config.overwrite
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    stats.seconds = time.perf_counter() - started  # downloads and upload included
    return manifest


def download_inputs(inputs: Sequence[S3Location], into: Path) -> list[Path]:
    """Download ``s3://`` inputs under ``into/BUCKET/KEY``; return the local inputs.

    A location with objects below it (``PREFIX/...``) is a directory: the objects a walk
    of it would take (:func:`~tokenfeed_server.prepare.corpus.walked`) are downloaded.
    Otherwise it must be one object, a file. Mirroring the keys keeps every document's
    path relative to the inputs' root, so the order equals a prepare of the same local
    files.
    """
    local: list[Path] = []
    for location in inputs:
        bucket = ObjectStore(S3Location(location.bucket))
        root = into / location.bucket
        taken = 0
        listed = bucket.list(f"{location.prefix}/" if location.prefix else "")
        for info in listed:
            relative = info.key[len(location.prefix) + 1 :] if location.prefix else info.key
            if not walked(relative):
                continue
            path = root / info.key
            path.parent.mkdir(parents=True, exist_ok=True)
            bucket.get_to_file(info.key, path)
            taken += 1
        if taken:
            local.append(root / location.prefix if location.prefix else root)
            continue
        if location.prefix and bucket.head(location.prefix) is not None:
            path = root / location.prefix
            path.parent.mkdir(parents=True, exist_ok=True)
            bucket.get_to_file(location.prefix, path)
            local.append(path)
            continue
        raise PrepareError(
            f"input {location.url()} has no objects to read (neither an object nor a "
            "prefix with .txt/.jsonl/.parquet/... objects below it)"
        )
    return local
