"""The serving Store and what the server does with datasets that change under it: new
ones are served, damaged ones refused clearly while the others are served, and a running
job never mixes two versions of a dataset."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from live_server import LiveServer
from shard_data import BYTE
from tokenfeed import TokenFeedDataset
from tokenfeed.errors import (
    DatasetChanged,
    DatasetNotFound,
    ManifestError,
    StoreError,
    UnknownDataset,
)
from tokenfeed.plan import INT64_MAX, Plan
from tokenfeed_server.store import Store, open_dataset, write_dataset
from tokenfeed_server.store.format import HEADER_SIZE
from tokenfeed_server.store.serving import RowBuffers, WindowBlocks
from tokenfeed_server.store.versions import local_version_dir


def docs(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=500, dtype=np.uint16) for _ in range(100)]


def dataset(srv: LiveServer, name: str, **kw: object) -> TokenFeedDataset:
    args: dict[str, object] = {
        "seq_len": 64,
        "batch_size": 4,
        "rank": 0,
        "world_size": 1,
        "request_timeout": 0.5,
        "deadline": 20.0,
    }
    args.update(kw)
    return TokenFeedDataset(srv.zmq, name, **args)  # type: ignore[arg-type]


# -- the Store on its own: a watcher thread keeps it current, look-ups read memory only


def test_store_watcher_sees_new_replaced_and_removed_datasets(tmp_path: Path) -> None:
    root = tmp_path / "store"
    write_dataset(root, "a", docs(1), tokenizer=BYTE, shuffle_seed=0)
    store = Store(root, scan_interval_s=3600.0)  # only wait_for_scan wakes it here
    store.open_all()
    try:
        first = store.get("a")
        write_dataset(root, "b", docs(2), tokenizer=BYTE, shuffle_seed=0)
        write_dataset(root, "a", docs(3), tokenizer=BYTE, shuffle_seed=0, overwrite=True)
        # Nothing is looked up on disk until the watcher has scanned.
        assert store.names() == ["a"] and store.get("a") is first
        assert store.wait_for_scan(timeout=10.0)
        assert store.names() == ["a", "b"]
        assert store.get("a").fingerprint != first.fingerprint
        assert store.get("b").n_documents == 100
        np.testing.assert_array_equal(first.read(0, 500), docs(1)[0])  # old files still read
        shutil.rmtree(root / "b")
        assert store.get("b").n_documents == 100
        assert store.wait_for_scan(timeout=10.0)
        with pytest.raises(DatasetNotFound, match="'b'"):
            store.get("b")
        assert [s["name"] for s in store.summaries()] == ["a"]
    finally:
        store.close()


def test_store_keeps_a_broken_dataset_as_its_error_until_it_is_rebuilt(tmp_path: Path) -> None:
    root = tmp_path / "store"
    write_dataset(root, "a", docs(1), tokenizer=BYTE, shuffle_seed=0)
    (root / "a" / "manifest.json").write_text("{not json")
    store = Store(root, scan_interval_s=3600.0)
    store.open_all()
    try:
        with pytest.raises(ManifestError, match="manifest"):
            store.get("a")
        assert store.summaries()[0]["ok"] is False
        write_dataset(root, "a", docs(1), tokenizer=BYTE, shuffle_seed=0, overwrite=True)
        assert store.wait_for_scan(timeout=10.0)
        assert store.get("a").n_documents == 100
    finally:
        store.close()


def test_store_close_stops_the_watcher(tmp_path: Path) -> None:
    root = tmp_path / "store"
    write_dataset(root, "a", docs(1), tokenizer=BYTE, shuffle_seed=0)
    store = Store(root)
    store.open_all()
    store.close()
    assert not store.wait_for_scan(timeout=0.2)  # nobody scans any more
    assert store.names() == []


# -- a running server


@pytest.mark.network
def test_a_dataset_that_appears_is_served(tmp_path: Path) -> None:
    store = tmp_path / "store"
    write_dataset(store, "old", docs(1), tokenizer=BYTE, shuffle_seed=0)
    with LiveServer(store) as srv:
        write_dataset(store, "new", docs(2), tokenizer=BYTE, shuffle_seed=0)
        deadline = time.monotonic() + 20.0  # the watcher rescans every 0.5 s
        while "new" not in {d["name"] for d in srv.get("/v1/datasets").json()}:
            assert time.monotonic() < deadline, "the server never listed the new dataset"
        assert sum(1 for _ in dataset(srv, "new", samples=40)) == 10


@pytest.mark.network
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_dataset_is_refused_and_the_rest_served(tmp_path: Path, damage: str) -> None:
    store = tmp_path / "store"
    write_dataset(store, "good", docs(1), tokenizer=BYTE, shuffle_seed=0)
    write_dataset(store, "bad", docs(2), tokenizer=BYTE, shuffle_seed=0, shard_tokens=20_000)
    shard = sorted((store / "bad").glob("shard-*"))[0]
    raw = bytearray(shard.read_bytes())
    if damage == "truncate":
        shard.write_bytes(bytes(raw[:-100]))  # caught by the size check at open
    else:
        raw[200] ^= 0xFF  # same size: only the checksum sees it
        shard.write_bytes(bytes(raw))
    log = tmp_path / "server.log"
    with LiveServer(store, extra=["--verify-checksums"], log_path=log) as srv:
        with pytest.raises(UnknownDataset, match="damaged"):
            next(iter(dataset(srv, "bad")))
        assert sum(1 for _ in dataset(srv, "good", samples=40)) == 10
        listed = {d["name"]: d for d in srv.get("/v1/datasets").json()}
        assert listed["good"]["ok"] is True and listed["bad"]["ok"] is False
        assert srv.get("/readyz").status_code == 200
    assert shard.name in log.read_text()  # the operator's log names the file


@pytest.mark.network
def test_a_running_job_keeps_its_version_across_an_overwrite_and_a_restart(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    old = write_dataset(store, "d", docs(1), tokenizer=BYTE, shuffle_seed=0).fingerprint
    kept = local_version_dir(store, "d", old)
    log = tmp_path / "server.log"
    srv = LiveServer(store, log_path=log).start()
    ds = dataset(srv, "d", samples=4 * 60, chunk_bytes=1, window=1)
    it = iter(ds)
    try:
        for _ in range(5):
            assert_rows_are_the_dataset(store, "d", next(it))
        # The operator rebuilds the dataset while the job reads, then restarts the server.
        new = write_dataset(store, "d", docs(2), tokenizer=BYTE, shuffle_seed=0, overwrite=True)
        assert kept.is_dir()  # the old build is kept, not deleted
        for _ in range(5):  # the job reads on in the build it started on
            assert_rows_are_the_dataset(store, "d", next(it), path=kept)
        zmq_port, http_port = srv.zmq_port, srv.http_port
        srv.kill()
        srv = LiveServer(store, log_path=log, zmq_port=zmq_port, http_port=http_port).start()
        # A restarted server opens the kept version for it: the epoch ends on its build.
        rest = list(it)
        assert len(rest) == 50
        for batch in rest:
            assert_rows_are_the_dataset(store, "d", batch, path=kept)
        listed = srv.get("/v1/datasets/d").json()
        assert listed["fingerprint"] == new.fingerprint  # new jobs get the new build
        assert sum(1 for _ in dataset(srv, "d", samples=16)) == 4
        # Once the old build is gone, a job pinned to it is refused, never mixed.
        shutil.rmtree(kept)
        srv.kill()
        srv = LiveServer(store, log_path=log, zmq_port=zmq_port, http_port=http_port).start()
        again = dataset(srv, "d", samples=4 * 60)
        again.load_state_dict({**ds.state_dict(), "position": 40})
        with pytest.raises(DatasetChanged, match=f"version {old} of dataset 'd' is no longer"):
            next(iter(again))
    finally:
        srv.stop()


def assert_rows_are_the_dataset(
    store: Path, name: str, batch: dict[str, Any], *, path: Path | None = None
) -> None:
    with open_dataset(store, name, path=path) as ds:
        for row, w in zip(batch["input_ids"].numpy(), batch["window_ids"].numpy(), strict=True):
            ref = ds.read(int(w) * 64, int(w) * 64 + 64)
            np.testing.assert_array_equal(row, ref)


@pytest.mark.network
@pytest.mark.parametrize("native", ["1", "0"], ids=["native-reads", "preadv-reads"])
def test_a_shard_truncated_under_the_server_fails_only_its_jobs(
    tmp_path: Path, native: str
) -> None:
    store = tmp_path / "store"
    write_dataset(store, "victim", docs(1), tokenizer=BYTE, shuffle_seed=0)
    write_dataset(store, "other", docs(2), tokenizer=BYTE, shuffle_seed=0)
    log = tmp_path / "server.log"
    env = {**os.environ, "TOKENFEED_NATIVE_READS": native}
    with LiveServer(store, log_path=log, env=env) as srv:
        victim = iter(dataset(srv, "victim", chunk_bytes=1, window=1))
        other = iter(dataset(srv, "other", chunk_bytes=1, window=1))
        next(victim)
        assert_rows_are_the_dataset(store, "other", next(other))
        # Reading a memory map of this file would now kill the server with SIGBUS.
        os.truncate(store / "victim" / "shard-000000.bin", HEADER_SIZE + 100)
        with pytest.raises(UnknownDataset, match="'victim' cannot be read"):
            for _ in victim:
                pass
        for _ in range(20):
            assert_rows_are_the_dataset(store, "other", next(other))
        assert srv.get("/healthz").status_code == 200
        assert srv.proc is not None and srv.proc.poll() is None
    assert "shard-000000.bin" in log.read_text()  # the operator's log names the file


@pytest.mark.parametrize(
    ("n_tokens", "batch", "world"),
    [(10_000, 8, 1), (60, 5, 3), (1_000_000, 4, 2), (1_000_000, 2, 64)],
)
def test_window_blocks_serve_the_plans_order_to_the_bit(
    n_tokens: int, batch: int, world: int
) -> None:
    plan = Plan(n_tokens=n_tokens, seq_len=7, batch_size=batch, world_size=world, seed=11)
    blocks = WindowBlocks(block=64, max_blocks=6)
    g, w = plan.global_batch, plan.n_windows
    requests = [
        (0, 0, 1, 1),
        (world - 1, 3, 40, 1),  # several blocks, across epoch ends when w is small
        (0, w - 5, 3, 1),  # across an epoch end
        (world // 2, 17 * g, 9, 3),  # strided like num_workers=3
        (0, 5 * w + 2, 200, 1),  # more blocks than are kept: computed directly
        (world - 1, INT64_MAX - 4 * g + 1, 4, 1),  # the stream's end: computed directly
    ]
    for rank, pos, count, stride in requests:
        positions = plan.rank_positions(rank, pos, count, stride)
        ids, epochs = blocks.windows(plan, positions)
        want_ids, want_epochs = plan.windows(positions)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(epochs, want_epochs)
    if world < 16:  # dense requests were served from blocks
        assert 0 < len(blocks) <= 6


def test_pooled_rows_are_read_into_and_lent_again_only_when_free(tmp_path: Path) -> None:
    write_dataset(tmp_path, "d", docs(3), tokenizer=BYTE, shuffle_seed=0, shard_tokens=7_000)
    buffers = RowBuffers(per_size=2)
    starts = np.array([0, 6_990, 31_000, 12])  # the second row crosses a shard boundary
    with open_dataset(tmp_path, "d") as ds:
        out, rows = buffers.take_rows((4, 17), ds.dtype)
        assert rows is not None and len(rows) == 4
        assert ds.gather(starts, 17, out=out, rows=rows) is out
        np.testing.assert_array_equal(out, ds.gather(starts, 17))
        # Lent while the array (or any view of it, e.g. a frame ZeroMQ holds) lives.
        view = out[1:]
        del out
        second, second_rows = buffers.take_rows((4, 17), ds.dtype)
        assert second_rows is not None and second_rows[0] is not rows[0]
        del view, second
        third, third_rows = buffers.take_rows((4, 17), ds.dtype)
        assert third_rows is not None
        assert third_rows[0] is rows[0]  # the first buffer again, with its views
        with pytest.raises(ValueError, match="rows has 4 rows, out 3"):
            ds.gather(starts[:3], 17, out=third[:3], rows=rows)


def test_pooled_buffers_are_bounded_whatever_sizes_clients_ask_for() -> None:
    """Clients pick seq_len, batch and chunk sizes: pooling one buffer per exact size
    would grow without bound. Sizes share power-of-two classes and the total is capped."""
    u2 = np.dtype("<u2")
    buffers = RowBuffers(per_size=4, max_bytes=1 << 16)
    first, _ = buffers.take_rows((4, 17), u2)  # 136 bytes: the 256-byte class
    memory = first.base
    del first
    again, rows = buffers.take_rows((3, 40), u2)  # 240 bytes: the same class, same memory
    assert again.base is memory and rows is not None and len(rows) == 3
    del again, rows
    for seq_len in range(1, 3000, 7):  # hundreds of distinct sizes, all dropped at once
        out, _ = buffers.take_rows((5, seq_len), u2)
        assert out.shape == (5, seq_len)
        assert buffers.pooled_bytes <= buffers.max_bytes
    assert buffers.pooled_bytes > 0
    big, big_rows = buffers.take_rows((1, 1 << 16), u2)  # over the cap: lent, never pooled
    assert big.shape == (1, 1 << 16) and big_rows is None
    assert buffers.pooled_bytes <= buffers.max_bytes


def test_a_dataset_failing_with_an_unexpected_error_is_listed_broken_and_the_rest_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not only StoreError: a manifest nested too deep for the JSON parser, or an OSError
    the reader does not expect (EACCES, which root never gets: simulated), must neither
    stop start-up nor freeze the rescans."""
    import tokenfeed_server.store.serving as serving

    root = tmp_path / "store"
    for name in ("good", "deep", "denied"):
        write_dataset(root, name, docs(1), tokenizer=BYTE, shuffle_seed=0)
    (root / "deep" / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    real_open = serving.open_dataset

    def open_denied(store: Path, name: str, **kw: Any) -> Any:
        if name == "denied":
            raise PermissionError(13, "Permission denied", str(store / name / "manifest.json"))
        return real_open(store, name, **kw)

    monkeypatch.setattr(serving, "open_dataset", open_denied)
    store = Store(root, scan_interval_s=3600.0)
    store.open_all()
    try:
        assert store.get("good").n_documents == 100
        by_name = {s["name"]: s for s in store.summaries()}
        assert [by_name[n]["ok"] for n in ("deep", "denied", "good")] == [False, False, True]
        assert "Permission denied" in by_name["denied"]["error"]
        for name in ("deep", "denied"):
            with pytest.raises(StoreError, match=name):
                store.get(name)
        write_dataset(root, "late", docs(2), tokenizer=BYTE, shuffle_seed=0)
        assert store.wait_for_scan(timeout=10.0)
        assert store.get("late").n_documents == 100  # rescans go on
    finally:
        store.close()
