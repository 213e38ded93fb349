"""Open shard files bounded by ``--max-open-shards``: the server-wide set of descriptors
(:mod:`tokenfeed_server.store.handles`), reopened on demand and never another build.

In-process tests shrink the process's one set (:data:`HANDLES`) to a few files; the
server test serves 20,000 shards from a process limited to 1,024 descriptors with 64
shard files open at most, for one exact epoch.
"""

from __future__ import annotations

import collections
import os
import random
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from live_server import LiveServer
from shard_data import BYTE, random_docs, stream
from tokenfeed import TokenFeedDataset, TokenFeedLoader
from tokenfeed.errors import CorruptShard
from tokenfeed_server.store import open_dataset, write_dataset
from tokenfeed_server.store.handles import HANDLES
from tokenfeed_server.store.mixed_gather import MixedGather

SEQ, BATCH = 15, 64
SHARDS = 20_000


@pytest.fixture
def few_handles() -> Iterator[int]:
    """This process's set of open shard files bounded to 8 (back to the default after)."""
    HANDLES.configure(8)
    yield 8
    HANDLES.configure(0)


def _build(root: Path, name: str, docs: list[np.ndarray], shard_tokens: int) -> None:
    # Durability is not what these tests are about: an fsync per shard is a minute for
    # 20,000 shards on a slow disk, 3 s without.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", lambda fd: None)
        write_dataset(root, name, docs, tokenizer=BYTE, shuffle_seed=0, shard_tokens=shard_tokens)


def _many(root: Path, name: str = "d", n: int = 400, seed: int = 0) -> np.ndarray:
    docs = random_docs(n, seed=seed)
    _build(root, name, docs, 20)  # about 20 tokens a shard: hundreds of shards
    return stream(docs, 256)


def test_the_bound_holds_and_evicted_files_are_reopened(tmp_path: Path, few_handles: int) -> None:
    ref = _many(tmp_path)
    before = HANDLES.stats()
    with open_dataset(tmp_path, "d") as ds:
        assert len(ds.manifest.shards) > 20 * few_handles
        assert HANDLES.stats()["open"] == 0  # opening the dataset opens no shard
        np.testing.assert_array_equal(ds.read(0, ds.n_tokens), ref)
        starts = np.random.default_rng(0).integers(0, ds.n_tokens - 9, size=500)
        for _ in range(2):  # every file evicted and opened again in between
            rows = ds.gather(starts, 9)
            np.testing.assert_array_equal(rows, ref[starts[:, None] + np.arange(9)])
            assert HANDLES.stats()["open"] <= few_handles
        ds.verify_checksums()
    after = HANDLES.stats()
    assert after["open"] == 0  # closed with the dataset
    assert after["evictions"] - before["evictions"] > len(ds.manifest.shards)
    assert after["opens"] - before["opens"] > 2 * len(ds.manifest.shards)


def _evict_all(ds: object, n_tokens: int) -> None:
    """Read enough other files that none opened before is still open."""
    gather = ds.gather  # type: ignore[attr-defined]
    for start in range(0, n_tokens - 1, 20):
        gather(np.asarray([start]), 1)


def test_a_file_replaced_under_its_name_is_an_error_not_other_data(
    tmp_path: Path, few_handles: int
) -> None:
    ref = _many(tmp_path)
    with open_dataset(tmp_path, "d") as ds:
        shard = ds.manifest.shards[3]
        k_start = int(ds.bounds[3])
        np.testing.assert_array_equal(ds.gather(np.asarray([k_start]), 2)[0], ref[k_start:][:2])
        _evict_all(ds, ds.n_tokens)
        # The very same bytes, as a new file: only its identity differs. Never read.
        path = tmp_path / "d" / shard.name
        copy = tmp_path / "copy.bin"
        shutil.copyfile(path, copy)
        os.replace(copy, path)
        with pytest.raises(CorruptShard, match=rf"{shard.name}.*another file now has"):
            ds.gather(np.asarray([k_start]), 2)
        # the other files are still served
        np.testing.assert_array_equal(ds.read(0, 5), ref[:5])


def test_an_overwritten_dataset_keeps_reading_its_own_build(
    tmp_path: Path, few_handles: int
) -> None:
    old_ref = _many(tmp_path, seed=1)
    with open_dataset(tmp_path, "d") as old:
        _evict_all(old, old.n_tokens)
        docs = [(d + 7) % 256 for d in random_docs(400, seed=1)]  # same sizes, other tokens
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(os, "fsync", lambda fd: None)
            write_dataset(
                tmp_path, "d", docs, tokenizer=BYTE, shuffle_seed=0, shard_tokens=20,
                overwrite=True,
            )  # fmt: skip
        assert not (tmp_path / "d" / "missing").exists()
        # every file reopened after the swap is the old build's (moved to versions/)
        np.testing.assert_array_equal(old.read(0, old.n_tokens), old_ref)
        with open_dataset(tmp_path, "d") as new:
            new_tokens = new.read(0, new.n_tokens)
        assert new_tokens.shape == old_ref.shape and not np.array_equal(new_tokens, old_ref)
        # a removed build (gc, by hand) fails clearly once a file must be opened again
        _evict_all(old, old.n_tokens)
        kept = next((tmp_path / "_tokenfeed" / "versions" / "d").iterdir())
        shutil.rmtree(kept)
        with pytest.raises(CorruptShard, match="gone while the dataset is served"):
            old.read(0, old.n_tokens)


def test_threads_reading_while_files_come_and_go(tmp_path: Path) -> None:
    """Readers on several threads, 4 files open at most, requests touching up to 64
    files: a descriptor evicted by one thread is never closed under another's read (a
    closed or reused descriptor would fail the read or return other bytes)."""
    refs = {name: _many(tmp_path, name, seed=i) for i, name in enumerate(("a", "b"))}
    HANDLES.configure(4)
    errors: list[BaseException] = []
    try:
        sets = [open_dataset(tmp_path, name) for name in refs]
        mixed = MixedGather(sets)

        def run(seed: int) -> None:
            rng = np.random.default_rng(seed)
            try:
                for _ in range(60):
                    which = rng.integers(0, 2, size=64)
                    starts = rng.integers(0, min(ds.n_tokens for ds in sets) - 5, size=64)
                    out = np.empty((64, 5), dtype=sets[0].dtype)
                    if seed % 2:
                        mixed.gather(which, starts, 5, out=out)
                    else:
                        out = sets[0].gather(starts, 5)
                        which = np.zeros(64, dtype=np.int64)
                    for row, s, w in zip(out, starts.tolist(), which.tolist(), strict=True):
                        np.testing.assert_array_equal(row, refs["ab"[w]][s : s + 5])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        # Files evicted while another thread read them close when that read ends: once
        # every reader is done, the bound holds again.
        assert HANDLES.stats()["open"] <= 4
        for ds in sets:
            ds.close()
    finally:
        HANDLES.configure(0)
    assert not errors, errors[0]


# ---------------------------------------------------------------- a server, 20,000 shards


@pytest.fixture(scope="module")
def big_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 60, size=int(SHARDS * 32 / 30))
    docs = [rng.integers(0, 256, size=int(n), dtype=np.uint16) for n in sizes]
    _build(root, "many", docs, 32)
    return root


def _server(store: Path, log: Path) -> LiveServer:
    """A server whose process may open 1,024 files, 64 of them shard files."""
    limited = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))\n"
        "from tokenfeed_server.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    command = [
        sys.executable, "-c", limited, "serve", "--store", str(store), "--host", "127.0.0.1",
        "--zmq-port", "0", "--http-port", "0", "--max-open-shards", "64",
    ]  # fmt: skip
    return LiveServer(command=command, log_path=log)


def _metric(server: LiveServer, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"no metric {name} {labels}")


def test_20000_shards_one_exact_epoch_with_64_files_open(big_store: Path, tmp_path: Path) -> None:
    with open_dataset(big_store, "many") as ref:
        assert len(ref.manifest.shards) >= SHARDS
        tokens = ref.read(0, ref.n_tokens)
    log = tmp_path / "server.log"
    with _server(big_store, log) as server:
        assert server.proc is not None
        ds = TokenFeedDataset(
            server.zmq, "many", seq_len=SEQ, batch_size=BATCH, seed=1, rank=0, world_size=1,
            epochs=1, request_timeout=5.0, deadline=60.0,
        )  # fmt: skip
        seen: collections.Counter[int] = collections.Counter()
        checked = random.Random(0)
        for batch in TokenFeedLoader(ds, num_workers=0, pin_memory=False):
            ids = batch["window_ids"].tolist()
            # the last batch is filled up from the next epoch
            seen.update(w for w, e in zip(ids, batch["epoch"].tolist(), strict=True) if e == 0)
            if checked.random() < 0.1:  # the rows are the dataset's windows
                for row, w in zip(batch["input_ids"].numpy(), ids, strict=True):
                    np.testing.assert_array_equal(row, tokens[w * SEQ : w * SEQ + SEQ])
        n_windows = ds.n_windows or 0
        assert n_windows == (len(tokens) - 1) // SEQ
        assert sorted(seen) == list(range(n_windows))  # every window of the epoch
        assert max(seen.values()) == 1  # none twice within the epoch
        assert _metric(server, "tokenfeed_max_open_shards") == 64
        assert _metric(server, "tokenfeed_open_shard_files") <= 64
        assert _metric(server, "tokenfeed_shard_files_total", event="evicted") > SHARDS
        # the process's own count: far below one per shard, and below its limit
        assert len(os.listdir(f"/proc/{server.proc.pid}/fd")) < 64 + 200
    text = log.read_text()
    assert "out of file descriptors" not in text and "Too many open files" not in text
