"""The writer: atomic publish, nothing left behind on errors, stale temp directories."""

from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shard_data import BYTE, random_docs
from tokenfeed.errors import DatasetExists, PrepareError
from tokenfeed_server.store import clean_stale_temp_dirs, list_datasets, open_dataset, write_dataset
from tokenfeed_server.store.format import TEMP_PREFIX
from tokenfeed_server.store.versions import local_version_dir
from tokenfeed_server.store.writer import LOCK_NAME, make_temp_dir, remove_temp_dir


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
    # A reader that had the old dataset open keeps reading the old data, which is kept
    # as a version (jobs and checkpoints may be pinned to it), nothing else left behind.
    np.testing.assert_array_equal(old.read(0, old.n_tokens), old_view)
    assert sorted(os.listdir(store)) == ["_tokenfeed", "d"]
    kept = local_version_dir(store, "d", old.fingerprint)
    assert sorted(os.listdir(kept)) == ["manifest.json", "pieces.bin", "shard-000000.bin"]
    assert sorted(os.listdir(kept.parent)) == [old.fingerprint]


def test_list_ignores_temp_dirs_and_cleans_unlocked_ones(store: Path) -> None:
    write_dataset(store, "real", random_docs(2), tokenizer=BYTE, shuffle_seed=0)
    live = make_temp_dir(store, "y")  # locked by this process
    dead = store / f"{TEMP_PREFIX}x-{os.getpid()}-abcd"  # a lock file nobody holds
    legacy = store / f"{TEMP_PREFIX}z-999999999-abcd"  # no lock file: never guessed at
    for d in (dead, legacy):
        d.mkdir()
        (d / LOCK_NAME).touch()
    (legacy / LOCK_NAME).unlink()
    for d in (dead, live, legacy):
        (d / "manifest.json").write_text("{}")
    assert list_datasets(store) == ["real"]
    assert clean_stale_temp_dirs(store) == [dead]
    assert live.exists() and legacy.exists() and not dead.exists()
    remove_temp_dir(live)
    assert not live.exists()
    assert list_datasets(tmp := store / "missing") == [] and not tmp.exists()


def test_nothing_of_the_writer_is_published(store: Path) -> None:
    write_dataset(store, "d", random_docs(2), tokenizer=BYTE, shuffle_seed=0)
    write_dataset(store, "d", random_docs(3), tokenizer=BYTE, shuffle_seed=0, overwrite=True)
    names = sorted(p.name for p in (store / "d").iterdir())
    assert names == ["manifest.json", "pieces.bin", "shard-000000.bin"]
    assert sorted(os.listdir(store)) == ["_tokenfeed", "d"]  # the old version, kept


# A writer in another process: it makes its temp dir, then forks a child that inherits the
# lock and keeps writing while the parent (whose pid names the dir) exits, as a writer on
# another host or in another container looks to a cleaner: a pid that means nothing here.
_WRITER = """
import os, sys
from tokenfeed_server.store.writer import make_temp_dir, release_temp_dir
path = make_temp_dir(sys.argv[1], "w")
if os.fork() == 0:  # the child holds the inherited lock until its stdin closes
    print(path, flush=True)
    sys.stdin.read()
    release_temp_dir(path)
    sys.stdout.close()  # after the lock: end of file tells the test it is released
    os._exit(0)
os._exit(0)
"""


def _start_writer(store: Path) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(store)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30.0)
    assert ready, "the writer process did not start"
    path = Path(proc.stdout.readline().strip())
    proc.wait(timeout=30)  # the parent, whose pid is in the name, is gone
    return proc, path


def test_cleanup_spares_a_live_writer_whatever_its_pid(store: Path) -> None:
    store.mkdir()
    proc, path = _start_writer(store)
    assert path.is_dir() and path.parent == store
    assert clean_stale_temp_dirs(store) == []  # the lock is held by the forked child
    assert path.is_dir()
    assert proc.stdin is not None
    proc.stdin.close()  # the child lets go of the lock and exits
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30.0)
    assert ready and proc.stdout.read() == ""
    proc.stdout.close()
    assert clean_stale_temp_dirs(store) == [path]
    assert not path.exists()


def test_cleanup_removes_the_dir_of_a_killed_writer(store: Path) -> None:
    code = (
        "import sys; from tokenfeed_server.store import TokenizerInfo\n"
        "from tokenfeed_server.store.writer import DatasetWriter\n"
        "w = DatasetWriter(sys.argv[1], 'd', tokenizer=TokenizerInfo('byte', 257, 256),"
        " shuffle_seed=0)\n"
        "w.add([1, 2, 3]); print(w.tmp, flush=True); sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(store)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30.0)
        assert ready, "the writer process did not start"
        path = Path(proc.stdout.readline().strip())
        assert clean_stale_temp_dirs(store) == [] and path.is_dir()
    finally:
        proc.kill()  # what a crash looks like: the kernel drops the lock
        proc.wait(timeout=30)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
    assert clean_stale_temp_dirs(store) == [path]
    assert os.listdir(store) == []


def test_writer_large_array_fast_path(store: Path) -> None:
    big = np.arange(3_000_000, dtype=np.int64) % 256
    m = write_dataset(store, "big", [big, big[:10]], tokenizer=BYTE, shuffle_seed=0,
                      shard_tokens=1 << 20)  # fmt: skip
    ds = open_dataset(store, "big")
    assert m.documents == 2 and len(m.shards) == 3
    np.testing.assert_array_equal(ds.read(1_048_000, 1_049_000), big[1_048_000:1_049_000])
    np.testing.assert_array_equal(ds.document_starts(0, ds.n_tokens), [0, 3_000_001])
