"""The serving Store: the datasets of one directory, opened once and shared by every job.

A dataset is validated when first opened (see
:func:`~tokenfeed_server.store.reader.open_dataset`); it is then shared by all jobs, so
the page cache holds one copy whatever the number of trainers.

The data plane's loop thread never touches the file system to look a dataset up: a
watcher thread rescans the store every ``scan_interval_s`` and (re)opens what changed,
and :meth:`Store.get` only reads the result. A dataset that appears is served from the
next scan on; one replaced on disk (``prepare --overwrite``, noticed by the identity of
its manifest file) is reopened for new jobs, while running jobs keep the old files and
their clients see the fingerprint change when they reconnect; one removed is no longer
found.

A store in object storage (``s3://BUCKET/PREFIX``) works the same way: the watcher lists
``PREFIX/*/manifest.json`` every ``scan_interval_s`` (a replaced manifest has a new ETag)
and opens :class:`~tokenfeed_server.store.remote.RemoteDataset` objects, which read
verified pieces through the server's :class:`~tokenfeed_server.store.cache.PieceCache`.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenfeed.errors import DatasetNotFound, StoreError
from tokenfeed.plan import Plan
from tokenfeed_server.logbudget import LogBudget
from tokenfeed_server.store.format import MANIFEST_NAME
from tokenfeed_server.store.local import list_datasets, open_dataset
from tokenfeed_server.store.objects import ObjectStoreError, S3Location
from tokenfeed_server.store.pools import (
    DEFAULT_POOL_BYTES,
    Order,
    RowBuffers,
    WindowBlocks,
    row_buffers,
    window_blocks,
)
from tokenfeed_server.store.reader import Dataset, validate_dataset_name
from tokenfeed_server.store.remote import list_remote_datasets, open_remote_dataset

if TYPE_CHECKING:
    from tokenfeed_server.store.cache import PieceCache
    from tokenfeed_server.store.objects import ObjectStore

# The pools moved to store.pools (issue 28); their names here still work.
__all__ = [
    "DEFAULT_POOL_BYTES",
    "DEFAULT_SCAN_INTERVAL_S",
    "Order",
    "RowBuffers",
    "Store",
    "WindowBlocks",
    "assemble",
    "row_buffers",
    "summary",
    "window_blocks",
]

log = logging.getLogger(__name__)

#: Seconds between two scans of the store directory by the watcher.
DEFAULT_SCAN_INTERVAL_S = 0.5

# The identity of a manifest file: a dataset published again gets a new inode (local),
# a new ETag (object storage).
_Signature = tuple[object, ...]


@dataclass(frozen=True)
class _Listing:
    """One dataset as the last scan found it: opened, or the error that stops it."""

    signature: _Signature
    dataset: Dataset | None
    error: StoreError | None


class Store:
    """The datasets of one store directory, by name, kept current by a watcher thread.

    :meth:`open_all` opens every dataset and starts the watcher; :meth:`close` stops it.
    """

    def __init__(
        self,
        root: Path | S3Location,
        *,
        verify_checksums: bool = False,
        scan_interval_s: float = DEFAULT_SCAN_INTERVAL_S,
        objects: ObjectStore | None = None,
        cache: PieceCache | None = None,
    ) -> None:
        if scan_interval_s <= 0:
            raise ValueError(f"scan_interval_s must be > 0, got {scan_interval_s}")
        if isinstance(root, S3Location) and (objects is None or cache is None):
            raise ValueError("a store in object storage needs its ObjectStore and a PieceCache")
        self.root = root
        #: For a store in object storage: its objects, and the cache its datasets read from.
        self.objects = objects if isinstance(root, S3Location) else None
        self.cache = cache if isinstance(root, S3Location) else None
        self.verify_checksums = verify_checksums
        self.scan_interval_s = scan_interval_s
        # Replaced whole by the watcher, never mutated: readers need no lock.
        self._entries: dict[str, _Listing] = {}
        self._scans = threading.Condition()
        self._started = 0  # scans begun
        self._finished = 0  # scans completed
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log_budget = LogBudget(per_s=5)

    # -- lifecycle -------------------------------------------------------------------

    def open_all(self, *, watch: bool = True) -> None:
        """Open and validate every dataset now (problems show in the start-up log), then
        start the watcher unless ``watch`` is false.

        Checksums are verified here when the Store was made with ``verify_checksums``;
        never for datasets that appear or change later, so a rescan stays cheap.
        """
        if self.objects is not None:
            self.objects.check_bucket()
        elif not isinstance(self.root, Path) or not self.root.is_dir():
            raise StoreError(
                f"store directory {self.root} does not exist; create it with "
                "`tokenfeed-server prepare ... --store DIR` or point --store at an existing one"
            )
        self.scan(verify_checksums=self.verify_checksums, initial=True)
        if watch and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._watch, name="tokenfeed-store-watcher", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        """Stop the watcher and close every open dataset."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        entries, self._entries = self._entries, {}
        for entry in entries.values():
            if entry.dataset is not None:
                entry.dataset.close()

    # -- look-ups (memory only) ------------------------------------------------------

    def get(self, name: str) -> Dataset:
        """The open dataset ``name``; raises DatasetNotFound or the error that stops it."""
        validate_dataset_name(name)
        entry = self._entries.get(name)
        if entry is None:
            raise DatasetNotFound(
                f"dataset {name!r} is not in store {self.root}; available: "
                f"{', '.join(self.names()) or 'none'}"
            )
        if entry.error is not None:
            raise entry.error
        assert entry.dataset is not None
        return entry.dataset

    def names(self) -> list[str]:
        """Names of the complete datasets on disk at the last scan, sorted."""
        return sorted(self._entries)

    def summaries(self) -> list[dict[str, Any]]:
        """One summary per dataset on disk, including those that fail to open."""
        out = []
        for name, entry in sorted(self._entries.items()):
            if entry.dataset is not None:
                out.append(summary(entry.dataset))
            else:
                out.append({"name": name, "ok": False, "error": str(entry.error)})
        return out

    # -- scanning (off the data plane's thread) -------------------------------------

    def wait_for_scan(self, timeout: float | None = None) -> bool:
        """Wait until a scan that began after this call has finished; False on timeout.

        What was on disk when this is called is then what :meth:`get` answers from. The
        watcher is woken at once, so this takes one scan, not one interval.
        """
        with self._scans:
            target = self._started + 1
            self._wake.set()
            return self._scans.wait_for(lambda: self._finished >= target, timeout)

    def scan(self, *, verify_checksums: bool = False, initial: bool = False) -> None:
        """Rescan the directory: open datasets that are new or whose manifest changed,
        forget removed ones. The watcher calls this; it is safe from one thread at a time.
        """
        with self._scans:
            self._started += 1
        try:
            self._entries = self._rescan(verify_checksums, initial)
        finally:
            with self._scans:
                self._finished += 1
                self._scans.notify_all()

    def _rescan(self, verify_checksums: bool, initial: bool) -> dict[str, _Listing]:
        old = self._entries
        new: dict[str, _Listing] = {}
        if self.objects is not None:
            return self._rescan_remote(old, initial)
        assert isinstance(self.root, Path)
        for name in list_datasets(self.root) if self.root.is_dir() else []:
            entry = old.get(name)
            try:
                st = os.stat(self.root / name / MANIFEST_NAME)
            except FileNotFoundError:
                continue  # removed between the listing and now
            except OSError as exc:  # e.g. EACCES: listed as broken, the others served
                signature: _Signature = (-1, -1, exc.errno or 0)
                if entry is None or entry.signature != signature:
                    error = StoreError(f"dataset {name!r}: cannot read its manifest: {exc}")
                    entry = _Listing(signature, None, error)
                    self._report(name, entry, True)
                new[name] = entry
                continue
            signature = (st.st_ino, st.st_mtime_ns, st.st_size)
            if entry is None or entry.signature != signature:
                # Running jobs hold the old Dataset and keep reading the old files.
                entry = self._open(name, signature, verify_checksums)
                self._report(name, entry, initial or name not in old)
            new[name] = entry
        return new

    def _rescan_remote(self, old: dict[str, _Listing], initial: bool) -> dict[str, _Listing]:
        """One listing of ``<prefix>/*/manifest.json``; (re)open what is new or changed."""
        assert self.objects is not None
        new: dict[str, _Listing] = {}
        for name, signature in list_remote_datasets(self.objects).items():
            entry = old.get(name)
            if entry is None or entry.signature != signature:
                # Running jobs hold the old Dataset: its pieces are content-addressed
                # objects that stay in the bucket until gc, so they never mix builds.
                entry = self._open(name, signature, False)
                self._report(name, entry, initial or name not in old)
                if isinstance(entry.error, ObjectStoreError):
                    # Object storage failed (after retries), not the dataset: try again
                    # at the next scan instead of keeping it broken until it changes.
                    entry = _Listing((), None, entry.error)
            new[name] = entry
        return new

    def _open(self, name: str, signature: _Signature, verify_checksums: bool) -> _Listing:
        # A failure is kept under its signature: a damaged dataset is not re-read on every
        # scan, only once its manifest changes (a rebuild).
        try:
            if self.objects is not None:
                assert self.cache is not None
                ds: Dataset = open_remote_dataset(self.objects, self.cache, name)
            else:
                assert isinstance(self.root, Path)
                ds = open_dataset(self.root, name, verify_checksums=verify_checksums)
        except StoreError as exc:
            return _Listing(signature, None, exc)
        except Exception as exc:
            # An OSError the reader did not expect, a manifest nested too deep to parse, a
            # bug: the dataset is listed broken and every other one is still served.
            error = StoreError(f"dataset {name!r} cannot be opened: {type(exc).__name__}: {exc}")
            return _Listing(signature, None, error)
        return _Listing(signature, ds, None)

    def _report(self, name: str, entry: _Listing, new: bool) -> None:
        if entry.error is not None:
            log.error("dataset %s is not served: %s", name, entry.error)
            return
        ds = entry.dataset
        assert ds is not None
        log.info(
            "dataset %s %s: %d tokens, %d shards",
            name,
            "opened" if new else "replaced on disk, reopened",
            ds.n_tokens,
            len(ds.manifest.shards),
        )

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.scan_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.scan()
            except Exception:  # a bug or an unreadable store: keep the last good view
                if self._log_budget.take():
                    log.exception("cannot rescan store %s", self.root)


def summary(ds: Dataset) -> dict[str, Any]:
    """The manifest summary served at /v1/datasets."""
    m = ds.manifest
    return {
        "name": ds.name,
        "ok": True,
        "fingerprint": ds.fingerprint,
        "tokens": ds.n_tokens,
        "documents": ds.n_documents,
        "dtype": m.dtype,
        "shards": len(m.shards),
        "tokenizer": {
            "kind": m.tokenizer.kind,
            "vocab_size": m.tokenizer.vocab_size,
            "eos_id": m.tokenizer.eos_id,
        },
        "shuffle_seed": m.shuffle_seed,
        "format_version": m.format_version,
        "created": m.created,
    }


def assemble(
    ds: Dataset, plan: Plan, rank: int, pos: int, *, count: int, stride: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of one request: tokens ``[count*B, L+1]``, window ids and epochs ``[count*B]``.

    The tokens are read into a pooled buffer (see :class:`RowBuffers`); a shard that
    cannot be read raises CorruptShard naming the dataset.
    """
    positions = plan.rank_positions(rank, pos, count, stride)  # sorted, as blocks need
    window_ids, epochs = window_blocks.windows(plan, positions)
    out, rows = row_buffers.take_rows((len(window_ids), plan.seq_len + 1), ds.dtype)
    tokens = ds.gather(plan.token_starts(window_ids), plan.seq_len + 1, out=out, rows=rows)
    return tokens, window_ids, epochs
