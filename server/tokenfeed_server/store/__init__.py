"""The data store: the on-disk dataset format, its reader and writer, and the serving Store.

One module per job: :mod:`~tokenfeed_server.store.format` (layout and shard header),
:mod:`~tokenfeed_server.store.manifest` (``manifest.json`` and the fingerprint),
:mod:`~tokenfeed_server.store.reader` (open a dataset validated, list a store, read
rows), :mod:`~tokenfeed_server.store.writer` (write a dataset atomically),
:mod:`~tokenfeed_server.store.objects` (``s3://`` store URLs and the S3 client),
:mod:`~tokenfeed_server.store.publish` / :mod:`~tokenfeed_server.store.gc` (a dataset
into object storage, and the objects no manifest references out of it),
:mod:`~tokenfeed_server.store.cache` (the bounded, verified piece cache),
:mod:`~tokenfeed_server.store.remote` (a dataset in object storage, read through it),
:mod:`~tokenfeed_server.store.mixing` (a job's datasets and mixture) and
:mod:`~tokenfeed_server.store.serving` (the datasets a running server shares between jobs).
"""

from __future__ import annotations

from tokenfeed_server.store.manifest import Manifest, ShardInfo, TokenizerInfo
from tokenfeed_server.store.objects import ObjectStore, S3Location, parse_store
from tokenfeed_server.store.reader import (
    Dataset,
    list_datasets,
    open_dataset,
    validate_dataset_name,
)
from tokenfeed_server.store.serving import Store, assemble, summary
from tokenfeed_server.store.writer import DatasetWriter, clean_stale_temp_dirs, write_dataset

__all__ = [
    "Dataset",
    "DatasetWriter",
    "Manifest",
    "ObjectStore",
    "S3Location",
    "ShardInfo",
    "Store",
    "TokenizerInfo",
    "assemble",
    "clean_stale_temp_dirs",
    "list_datasets",
    "open_dataset",
    "parse_store",
    "summary",
    "validate_dataset_name",
    "write_dataset",
]
