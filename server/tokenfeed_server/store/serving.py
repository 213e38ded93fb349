"""The serving Store: the datasets of one directory, opened once and shared by every job.

A dataset is validated when first opened (see
:func:`~tokenfeed_server.store.reader.open_dataset`); it is then shared by all jobs, so
the page cache holds one copy whatever the number of trainers. A dataset replaced on disk
(``prepare --overwrite``) is noticed by the identity of its manifest file and reopened for
new jobs; running jobs keep the old files and their clients see the fingerprint change
when they reconnect.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenfeed.errors import DatasetNotFound, StoreError
from tokenfeed.plan import Plan
from tokenfeed_server.store.reader import (
    Dataset,
    list_datasets,
    open_dataset,
    validate_dataset_name,
)

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    signature: tuple[int, int]
    dataset: Dataset | None
    error: StoreError | None


class Store:
    """Open datasets of one store directory, by name."""

    def __init__(self, root: Path, *, verify_checksums: bool = False) -> None:
        self.root = root
        self.verify_checksums = verify_checksums
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()  # HTTP handlers and the data plane both look up

    def open_all(self) -> None:
        """Open and validate every dataset now, so that problems show in the start-up log."""
        if not self.root.is_dir():
            raise StoreError(
                f"store directory {self.root} does not exist; create it with "
                "`tokenfeed-server prepare ... --store DIR` or point --store at an existing one"
            )
        for name in list_datasets(self.root):
            try:
                ds = self.get(name, verify_checksums=self.verify_checksums)
                log.info(
                    "dataset %s: %d tokens, %d shards", name, ds.n_tokens, len(ds.manifest.shards)
                )
            except StoreError as exc:
                log.error("dataset %s is not served: %s", name, exc)

    def get(self, name: str, *, verify_checksums: bool = False) -> Dataset:
        """The open dataset ``name``; raises DatasetNotFound or the error that stops it.

        Headers and sizes are always checked. Checksums only when asked: at start-up
        with ``--verify-checksums``; never for a dataset replaced while serving, whose
        reopening runs on the data plane and must not stall it for a full hash.
        """
        validate_dataset_name(name)
        manifest = self.root / name / "manifest.json"
        try:
            st = os.stat(manifest)
        except FileNotFoundError:
            raise DatasetNotFound(
                f"dataset {name!r} is not in store {self.root}; available: "
                f"{', '.join(self.names()) or 'none'}"
            ) from None
        signature = (st.st_ino, st.st_mtime_ns)
        with self._lock:
            entry = self._entries.get(name)
        if entry is None or entry.signature != signature:
            # Opened outside the lock: validating (or hashing) a big dataset must not block
            # look-ups of the others. Two threads opening at once both succeed; one wins.
            opened = self._open(name, signature, verify_checksums)
            with self._lock:
                current = self._entries.get(name)
                if current is not None and current.signature == signature:
                    entry = current  # another thread opened the same files first
                else:
                    self._entries[name] = entry = opened
            if entry is not opened and opened.dataset is not None:
                opened.dataset.close()
        if entry.error is not None:
            raise entry.error
        assert entry.dataset is not None
        return entry.dataset

    def _open(self, name: str, signature: tuple[int, int], verify_checksums: bool) -> _Entry:
        # Failures are cached under the same signature, so a client hammering a corrupt
        # dataset does not make the server re-read it on every hello.
        try:
            ds = open_dataset(self.root, name, verify_checksums=verify_checksums)
        except StoreError as exc:
            return _Entry(signature, None, exc)
        return _Entry(signature, ds, None)

    def names(self) -> list[str]:
        """Names of the complete datasets on disk."""
        return list_datasets(self.root) if self.root.is_dir() else []

    def summaries(self) -> list[dict[str, Any]]:
        """One summary per dataset on disk, including those that fail to open."""
        out = []
        for name in self.names():
            try:
                out.append(summary(self.get(name)))
            except StoreError as exc:
                out.append({"name": name, "ok": False, "error": str(exc)})
        return out

    def close(self) -> None:
        """Close every open dataset."""
        with self._lock:
            for entry in self._entries.values():
                if entry.dataset is not None:
                    entry.dataset.close()
            self._entries.clear()


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
    """Rows of one request: tokens ``[count*B, L+1]``, window ids and epochs ``[count*B]``."""
    positions = plan.rank_positions(rank, pos, count, stride)
    window_ids, epochs = plan.windows(positions)
    tokens = ds.gather(plan.token_starts(window_ids), plan.seq_len + 1)
    return tokens, window_ids, epochs
