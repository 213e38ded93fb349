"""The writer: atomic publish, nothing left behind on errors, stale temp directories."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from shard_data import BYTE, random_docs
from tokenfeed.errors import DatasetExists, PrepareError
from tokenfeed_server.store import clean_stale_temp_dirs, list_datasets, open_dataset, write_dataset
from tokenfeed_server.store.format import TEMP_PREFIX


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


def test_out_of_vocab_tokens_rejected_and_nothing_left(store: Path) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        write_dataset(store, "d", [np.array([1, 2, 300])], tokenizer=BYTE, shuffle_seed=0)
    assert list_datasets(store) == []
    assert os.listdir(store) == []


def test_empty_dataset_rejected(store: Path) -> None:
    with pytest.raises(PrepareError, match="empty"):
        write_dataset(store, "d", [], tokenizer=BYTE, shuffle_seed=0)
    assert os.listdir(store) == []


def test_exists_and_overwrite(store: Path) -> None:
    write_dataset(store, "d", random_docs(5), tokenizer=BYTE, shuffle_seed=0)
    old = open_dataset(store, "d")
    old_view = old.read(0, old.n_tokens).copy()
    with pytest.raises(DatasetExists, match="overwrite"):
        write_dataset(store, "d", random_docs(5, seed=9), tokenizer=BYTE, shuffle_seed=0)
    write_dataset(
        store, "d", random_docs(7, seed=9), tokenizer=BYTE, shuffle_seed=0, overwrite=True
    )
    new = open_dataset(store, "d")
    assert new.n_documents == 7 and new.fingerprint != old.fingerprint
    # A reader that had the old dataset open keeps reading the old data.
    np.testing.assert_array_equal(old.read(0, old.n_tokens), old_view)
    assert sorted(os.listdir(store)) == ["d"]


def test_list_ignores_temp_dirs_and_cleans_dead_ones(store: Path) -> None:
    write_dataset(store, "real", random_docs(2), tokenizer=BYTE, shuffle_seed=0)
    dead = store / f"{TEMP_PREFIX}x-999999999-abcd"
    live = store / f"{TEMP_PREFIX}y-{os.getpid()}-abcd"
    for d in (dead, live):
        d.mkdir()
        (d / "manifest.json").write_text("{}")
    assert list_datasets(store) == ["real"]
    assert clean_stale_temp_dirs(store) == [dead]
    assert live.exists() and not dead.exists()
    assert list_datasets(tmp := store / "missing") == [] and not tmp.exists()


def test_writer_large_array_fast_path(store: Path) -> None:
    big = np.arange(3_000_000, dtype=np.int64) % 256
    m = write_dataset(store, "big", [big, big[:10]], tokenizer=BYTE, shuffle_seed=0,
                      shard_tokens=1 << 20)  # fmt: skip
    ds = open_dataset(store, "big")
    assert m.documents == 2 and len(m.shards) == 3
    np.testing.assert_array_equal(ds.read(1_048_000, 1_049_000), big[1_048_000:1_049_000])
    np.testing.assert_array_equal(ds.document_starts(0, ds.n_tokens), [0, 3_000_001])
