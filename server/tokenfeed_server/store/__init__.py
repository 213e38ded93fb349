"""The data store: the on-disk dataset format, its readers and writer, the piece cache of
a store in object storage, and the serving Store.

One module per job:

* format and metadata: :mod:`~.format` (layout and shard header), :mod:`~.manifest`
  (``manifest.json`` and the fingerprint);
* reading: :mod:`~.reader` (the reader interface :class:`Dataset` and its shared read
  path; dataset names), :mod:`~.local` (a dataset in a directory: open validated, list,
  ``pread``), :mod:`~.remote` (a dataset in object storage, read through the cache),
  :mod:`~.mixed_gather` (rows of several local datasets in one pass);
* writing and publishing: :mod:`~.writer` (write a dataset atomically), :mod:`~.publish`
  / :mod:`~.gc` (a dataset into object storage, and the objects no manifest references);
* object storage: :mod:`~.objects` (``s3://`` URLs and the one S3 client),
  :mod:`~.errors` (the store's exceptions and :func:`wire_error`, their wire kinds);
* the piece cache: :mod:`~.pieces` (piece refs and lazy lists of them),
  :mod:`~.cache_policy` (what to keep, evict, fetch next: pure), :mod:`~.cache` (the
  mechanism: lock, fetch threads, pins, admission), :mod:`~.piece_index` (entries and
  bytes), :mod:`~.piece_files` (the directory), :mod:`~.piece_fetch` (one verified fetch
  with retries), :mod:`~.waiters`, :mod:`~.cache_stats`, :mod:`~.prefetch` (the jobs'
  plans as the cache's wanted pieces);
* serving: :mod:`~.mixing` (a job's datasets and mixture), :mod:`~.serving` (the
  datasets a running server shares between jobs, pooled row buffers, window blocks).
"""

from __future__ import annotations

from tokenfeed_server.store.errors import wire_error
from tokenfeed_server.store.local import LocalDataset, list_datasets, open_dataset
from tokenfeed_server.store.manifest import Manifest, ShardInfo, TokenizerInfo
from tokenfeed_server.store.objects import ObjectStore, S3Location, parse_store
from tokenfeed_server.store.reader import Dataset, validate_dataset_name
from tokenfeed_server.store.serving import Store, assemble, summary
from tokenfeed_server.store.writer import DatasetWriter, clean_stale_temp_dirs, write_dataset

__all__ = [
    "Dataset",
    "DatasetWriter",
    "LocalDataset",
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
    "wire_error",
    "write_dataset",
]
