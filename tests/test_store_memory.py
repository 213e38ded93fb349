"""Server memory that does not grow with use (issue 28): every cache kept between
requests is counted in bytes by its owner and held under a byte cap whatever clients
ask, mixture tables are shared by the jobs of one mixture and freed with the last, and
:func:`~tokenfeed_server.store.memory.memory_by_owner` reports it all. Counts, never
timings or RSS."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shard_data import BYTE
from tokenfeed import protocol
from tokenfeed.mixture import Mixture
from tokenfeed.plan import Plan
from tokenfeed_server.store import Dataset, memory, open_dataset, pools, write_dataset
from tokenfeed_server.store.mixing import open_feed, shared_mixtures, table_bytes
from tokenfeed_server.store.pools import RowBuffers, WindowBlocks
from tokenfeed_server.store.serving import assemble

U2 = np.dtype("<u2")
NAMES = ("web", "code", "math")


def recount(buffers: RowBuffers) -> int:
    """What the pool holds, counted afresh from its buffers and views."""
    total = 0
    for slot in buffers._lru:
        total += sys.getsizeof(slot.memory) + sys.getsizeof(slot.view)
        for rows in slot.rows.values():
            total += sys.getsizeof(rows)
            total += sum(sys.getsizeof(t) + sys.getsizeof(t[0]) for t in rows)
    return total


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    rng = np.random.default_rng(0)
    for k, name in enumerate(NAMES):
        docs = [
            rng.integers(0, 256, size=int(n), dtype=np.uint16) for n in rng.integers(5, 400, 80)
        ]
        write_dataset(root, name, docs, tokenizer=BYTE, shuffle_seed=k, shard_tokens=3001)
    return root


@pytest.fixture(scope="module")
def opened(store: Path) -> Iterator[dict[str, Dataset]]:
    sets = {name: open_dataset(store, name) for name in NAMES}
    yield sets
    for ds in sets.values():
        ds.close()


@pytest.fixture
def small_pools() -> Iterator[None]:
    """The server's shared pools under small caps, as they were afterwards."""
    rows, blocks = pools.row_buffers.max_bytes, pools.window_blocks.max_bytes
    memory.configure(row_pool_bytes=1 << 20, window_blocks_bytes=1 << 18)
    yield
    memory.configure(row_pool_bytes=rows, window_blocks_bytes=blocks)


# -- the row buffer pool ------------------------------------------------------------------


def test_row_pool_counts_its_views_and_stays_under_its_cap_whatever_the_shapes() -> None:
    """Short rows cost more in views (a tuple and a memoryview each) than in buffer: the
    cap covers both, for hundreds of shapes, with a connection's window of chunks lent."""
    cap = 4 << 20
    buffers = RowBuffers(per_size=8, max_bytes=cap)
    shapes = 0
    for seq_len in (15, 16, 63, 100, 127, 255, 300, 511, 1023):
        for batch in (1, 2, 4, 8, 16):
            rows = max(1, (1 << 18) // (batch * (seq_len + 1) * 2)) * batch
            lent = [buffers.take_rows((rows, seq_len + 1), U2) for _ in range(8)]
            shapes += 1
            assert buffers.held_bytes <= cap
            assert buffers.held_bytes == recount(buffers)
            for out, views in lent:
                assert out.shape == (rows, seq_len + 1)
                assert views is None or len(views) == rows
            del lent
    assert shapes == 45 and len(buffers) > 0
    # With 32-byte rows the views outweigh the buffers they cover: both are counted.
    buffers.clear()
    out, views = buffers.take_rows((8192, 16), U2)
    assert views is not None and buffers.held_bytes > 2 * out.nbytes
    assert buffers.held_bytes == recount(buffers)


def test_row_pool_drops_the_least_recently_lent_buffer_first() -> None:
    kib = 1 << 10
    buffers = RowBuffers(max_bytes=224 * kib)  # 64 + 128 KiB and their views, not 64 more
    a, _ = buffers.take_rows((32, 1024), U2)  # 64 KiB
    b, _ = buffers.take_rows((16, 2048), U2)  # 64 KiB, lent at once: a second buffer
    a_memory, b_memory = a.base, b.base
    del a, b
    again, _ = buffers.take_rows((32, 1024), U2)  # a, the first free: now the most recent
    assert again.base is a_memory
    del again
    big, _ = buffers.take_rows((64, 1024), U2)  # 128 KiB: room made from the oldest, b
    del big
    assert len(buffers) == 2 and buffers.held_bytes <= buffers.max_bytes
    assert buffers.held_bytes == recount(buffers)
    first, _ = buffers.take_rows((32, 1024), U2)
    second, _ = buffers.take_rows((32, 1024), U2)
    assert first.base is a_memory and second.base is not b_memory


def test_idle_buffers_are_given_back_and_lent_ones_kept() -> None:
    buffers = RowBuffers()
    lent, _ = buffers.take_rows((4, 64), U2)
    free, _ = buffers.take_rows((4, 64), U2)
    del free
    assert len(buffers) == 2
    assert buffers.release_idle(3600.0) == 0  # both used just now
    freed = buffers.release_idle(0.0)
    assert freed > 0 and len(buffers) == 1 and buffers.held_bytes == recount(buffers)
    del lent
    buffers.release_idle(0.0)
    assert len(buffers) == 0 and buffers.held_bytes == 0


def test_a_zero_cap_pools_nothing_and_still_lends() -> None:
    buffers = RowBuffers(max_bytes=0)
    out, views = buffers.take_rows((3, 9), U2)
    assert out.shape == (3, 9) and out.flags.c_contiguous and views is None
    assert buffers.held_bytes == 0


def test_assemble_over_many_request_shapes_keeps_the_servers_pool_under_its_cap(
    opened: dict[str, Dataset], small_pools: None
) -> None:
    ds = opened["web"]
    for seq_len in range(7, 400, 13):
        for batch in (1, 3, 8):
            plan = Plan(ds.n_tokens, seq_len, batch, 1, seed=seq_len)
            tokens, ids, _ = assemble(ds, plan, 0, 0, count=2, stride=1)
            want = np.stack([ds.read(s, s + seq_len + 1) for s in plan.token_starts(ids)])
            np.testing.assert_array_equal(tokens, want)
            held = memory.memory_by_owner()
            assert held["row_buffers"] <= 1 << 20
            assert held["window_blocks"] <= 1 << 18
    assert memory.memory_by_owner()["row_buffers"] > 0


# -- window blocks ------------------------------------------------------------------------


def test_window_blocks_stay_under_their_byte_cap_and_serve_the_plans_order() -> None:
    cap = 40 * 1024
    blocks = WindowBlocks(block=256, max_blocks=10_000, max_bytes=cap)
    for seed in range(60):  # many jobs' orders: one block each at least
        plan = Plan(50_000, 7, 4, 1, seed=seed)
        positions = plan.rank_positions(0, 100 * seed, 30, 1)
        ids, epochs = blocks.windows(plan, positions)
        want_ids, want_epochs = plan.windows(positions)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(epochs, want_epochs)
        assert blocks.held_bytes <= cap
    assert 0 < len(blocks) < 60  # the count cap never bound: the byte cap did
    assert blocks.release_idle(3600.0) == 0
    assert blocks.release_idle(0.0) > 0 and len(blocks) == blocks.held_bytes == 0


def test_window_blocks_with_no_room_compute_directly() -> None:
    blocks = WindowBlocks(block=256, max_bytes=0)
    plan = Plan(50_000, 7, 4, 1, seed=3)
    positions = plan.rank_positions(0, 0, 10, 1)
    np.testing.assert_array_equal(blocks.windows(plan, positions)[0], plan.windows(positions)[0])
    assert len(blocks) == 0 and blocks.held_bytes == 0


# -- mixture tables -----------------------------------------------------------------------


def hello(mixture: Mixture, seed: int = 1) -> protocol.Hello:
    return protocol.Hello(
        dataset="", seq_len=16, batch_size=4, seed=seed, world_size=1, rank=0, worker=0,
        window=8, client="test", sources=mixture.names,
        schedule=tuple(tuple(row) for row in mixture.to_wire()),
    )  # fmt: skip


def test_jobs_of_one_mixture_share_its_tables_and_the_last_one_frees_them(
    opened: dict[str, Dataset],
) -> None:
    gc.collect()
    baseline = memory.memory_by_owner()["mixture_tables"]
    mixture = Mixture({"web": 5000, "code": 3000, "math": 1})  # a period of 8001 rows
    sets = [opened[n] for n in mixture.names]
    first = open_feed(sets, hello(mixture, seed=1))
    second = open_feed(sets, hello(Mixture({"web": 5000, "code": 3000, "math": 1}), seed=2))
    assert first.mixture is second.mixture  # one object: one set of tables
    tables = table_bytes(mixture)
    assert tables >= 16 * 8001
    assert memory.memory_by_owner()["mixture_tables"] == baseline + tables
    for feed in (first, second):  # both read through the shared tables
        tokens, rows = feed.assemble(0, 0, count=3, stride=1)
        assert tokens.shape == (12, 17) and set(rows[protocol.ROW_SOURCE].tolist()) <= {0, 1, 2}
    other = open_feed(sets, hello(Mixture({"web": 1, "math": 1, "code": 1})))
    assert other.mixture is not first.mixture
    assert memory.memory_by_owner()["mixture_tables"] == baseline + tables + table_bytes(
        Mixture({"web": 1, "math": 1, "code": 1})
    )
    del first, other
    gc.collect()
    assert memory.memory_by_owner()["mixture_tables"] == baseline + tables
    del second, feed
    gc.collect()
    assert memory.memory_by_owner()["mixture_tables"] == baseline
    assert mixture not in shared_mixtures._held


def test_a_single_dataset_feed_holds_no_mixture(opened: dict[str, Dataset]) -> None:
    before = len(shared_mixtures)
    msg = protocol.Hello(
        dataset="web", seq_len=16, batch_size=4, seed=1, world_size=1, rank=0, worker=0,
        window=8, client="test",
    )  # fmt: skip
    feed = open_feed([opened["web"]], msg)
    assert feed.mixture is None and len(shared_mixtures) == before


# -- memory_by_owner and the allocator ----------------------------------------------------


def test_memory_by_owner_lists_the_builtins_then_registered_owners() -> None:
    owners = memory.memory_by_owner()
    assert list(owners)[:3] == list(memory.BUILTIN_OWNERS)
    assert all(isinstance(v, int) and v >= 0 for v in owners.values())

    def broken() -> int:
        raise RuntimeError("a bug in an owner")

    remove_jobs = memory.register_owner("jobs", lambda: 1234)
    remove_broken = memory.register_owner("broken", broken)
    try:
        owners = memory.memory_by_owner()
        assert owners["jobs"] == 1234 and "broken" not in owners
        remove_again = memory.register_owner("jobs", lambda: 99)  # a second data plane
        remove_jobs()  # the first one's remover leaves the second
        assert memory.memory_by_owner()["jobs"] == 99
        remove_again()
        assert "jobs" not in memory.memory_by_owner()
    finally:
        remove_jobs()
        remove_broken()
    with pytest.raises(ValueError, match="built-in"):
        memory.register_owner("row_buffers", lambda: 0)


def test_the_arena_limit_and_trim_are_harmless_twice_and_skipped_off_glibc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    first = memory.limit_malloc_arenas(2)
    assert memory.limit_malloc_arenas(2) == first  # True on glibc, False elsewhere
    assert first == (memory._glibc() is not None)
    memory.trim_malloc()
    memory.trim_malloc()
    assert memory.limit_malloc_arenas(0) is False  # 0: glibc's default, untouched
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert memory.limit_malloc_arenas(2) is False  # the operator's choice wins
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    memory._glibc.cache_clear()
    monkeypatch.setattr(sys, "platform", "darwin")
    try:
        assert memory.limit_malloc_arenas(2) is False
        assert memory.trim_malloc() is False
    finally:
        memory._glibc.cache_clear()


def test_release_idle_empties_the_shared_pools(small_pools: None) -> None:
    out, _ = pools.row_buffers.take_rows((4, 64), U2)
    del out
    plan = Plan(50_000, 7, 4, 1, seed=1)
    pools.window_blocks.windows(plan, plan.rank_positions(0, 0, 2, 1))
    assert pools.row_buffers.held_bytes > 0 and pools.window_blocks.held_bytes > 0
    memory.release_idle(0.0)
    held: dict[str, Any] = memory.memory_by_owner()
    assert held["row_buffers"] == 0 and held["window_blocks"] == 0
