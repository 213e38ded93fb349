"""A same-content ``--overwrite`` while jobs read a dataset with more shards than
``--max-open-shards``: the jobs read on, exactly once, never "gone".

A job's shard files come and go from the server's bounded set of open files and are
reopened by name in the directory of the build it opened
(:mod:`tokenfeed_server.store.handles`). Rebuilding the same content gives a build of the
same fingerprint; the build swapped out must stay (kept as that version, or inside it
when that version is kept already) for the jobs reading it, not be deleted.
"""

from __future__ import annotations

import collections
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from live_server import LiveServer
from shard_data import BYTE, random_docs, stream
from tokenfeed import TokenFeedDataset, TokenFeedLoader
from tokenfeed_server.store import open_dataset, write_dataset
from tokenfeed_server.store.versions import COPY_PREFIX, list_versions, local_version_dir
from waiting import wait_until

SEQ, BATCH = 15, 8
OPEN_SHARDS = 8
DOCS = random_docs(400, seed=11)


def _write(root: Path, *, overwrite: bool = False) -> str:
    manifest = write_dataset(
        root, "d", DOCS, tokenizer=BYTE, shuffle_seed=0, shard_tokens=200, overwrite=overwrite
    )
    return manifest.fingerprint


class _Job:
    """One job of one epoch over "d", read a batch at a time."""

    def __init__(self, server: LiveServer, seed: int) -> None:
        self.ds = TokenFeedDataset(
            server.zmq, "d", seq_len=SEQ, batch_size=BATCH, seed=seed, rank=0, world_size=1,
            epochs=1, request_timeout=5.0, deadline=20.0,
        )  # fmt: skip
        self.batches: Iterator[dict[str, Any]] = iter(
            TokenFeedLoader(self.ds, num_workers=0, pin_memory=False)
        )
        self.seen: collections.Counter[int] = collections.Counter()
        self.rows: dict[int, np.ndarray] = {}

    def read(self, n: int | None) -> None:
        """The next ``n`` batches (None: to the end of the epoch)."""
        for i, batch in enumerate(self.batches):
            ids = batch["window_ids"].tolist()
            epochs = batch["epoch"].tolist()
            for row, w, e in zip(batch["input_ids"].numpy(), ids, epochs, strict=True):
                if e == 0:  # the last batch is filled up from the next epoch
                    self.seen[w] += 1
                    self.rows[w] = row
            if n is not None and i + 1 >= n:
                return

    def check(self, tokens: np.ndarray) -> None:
        n_windows = (len(tokens) - 1) // SEQ
        assert self.ds.n_windows == n_windows
        assert sorted(self.seen) == list(range(n_windows))  # the whole epoch
        assert max(self.seen.values()) == 1  # none twice
        for w, row in self.rows.items():
            np.testing.assert_array_equal(row, tokens[w * SEQ : w * SEQ + SEQ])


def _server(store: Path, log: Path) -> LiveServer:
    command = [
        sys.executable, "-m", "tokenfeed_server.cli", "serve", "--store", str(store),
        "--host", "127.0.0.1", "--zmq-port", "0", "--http-port", "0",
        "--max-open-shards", str(OPEN_SHARDS),
        "--chunk-bytes", "256",  # a batch a chunk: the job asks all epoch long
    ]  # fmt: skip
    return LiveServer(command=command, log_path=log)


def _reopened(log: Path, times: int) -> None:
    """Wait until the server has opened the republished build ``times`` times."""
    wait_until(
        lambda: log.read_text().count("replaced, reopened") >= times,
        30.0,
        f"the server reopening the republished dataset ({times})",
    )


@pytest.mark.network
def test_jobs_read_on_across_same_content_overwrites(tmp_path: Path) -> None:
    store = tmp_path / "store"
    fingerprint = _write(store)
    with open_dataset(store, "d") as ds:
        assert len(ds.manifest.shards) >= 40 > OPEN_SHARDS
        tokens = ds.read(0, ds.n_tokens)
    np.testing.assert_array_equal(tokens, stream(DOCS, BYTE.eos_id))
    first_shard = store / "d" / "shard-000000.bin"
    first_inode = os.stat(first_shard).st_ino
    log = tmp_path / "server.log"
    with _server(store, log) as server:
        a = _Job(server, seed=1)
        a.read(20)  # about a third of the epoch: every shard opened and evicted already
        assert _write(store, overwrite=True) == fingerprint  # same content, a new build
        _reopened(log, 1)
        # the build job a reads is kept as that version, whole, where it was moved
        kept = local_version_dir(store, "d", fingerprint)
        assert os.stat(kept / "shard-000000.bin").st_ino == first_inode
        b = _Job(server, seed=2)  # a job on the new build
        b.read(20)
        a.read(10)
        assert _write(store, overwrite=True) == fingerprint  # and again
        _reopened(log, 2)
        # that version is kept already: the build job b reads goes inside it
        copies = [p for p in kept.iterdir() if p.name.startswith(COPY_PREFIX)]
        assert len(copies) == 1 and (copies[0] / "manifest.json").is_file()
        a.read(None)
        b.read(None)
        a.check(tokens)
        b.check(tokens)
    text = log.read_text()
    assert "gone while the dataset is served" not in text, text
    assert [v.fingerprint for v in list_versions(store, "d")] == [fingerprint]
