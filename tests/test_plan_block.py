"""The block shuffle through the plan (``Plan(shuffle="block")``): new orders per epoch and
seed, block_spans, batching/rank/worker invariance, validation, and the global shuffle left
bit-exact. The layout's own invariants (exactly once, locality, quality, huge sizes) are
tested on :mod:`tokenfeed.order.blocks` in tests/test_order_blocks.py. Pure numpy, no
network (one test uses the server's WindowBlocks cache, in-process)."""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from block_reference import reference_epoch
from tokenfeed.errors import ConfigError, PlanError
from tokenfeed.plan import (
    Plan,
    step_position,
    worker_steps,
)

SETTINGS = settings(max_examples=60, deadline=None)
ROOT = Path(__file__).resolve().parents[1]


def block_plan(
    n_windows: int, region: int, block: int, seed: int = 0, seq_len: int = 3, **kw: Any
) -> Plan:
    return Plan(
        n_windows * seq_len + 1,
        seq_len,
        kw.pop("batch_size", 1),
        seed=seed,
        shuffle="block",
        region_windows=region,
        block_regions=block,
        **kw,
    )


sizes = st.tuples(
    st.integers(1, 120),  # W
    st.integers(1, 40) | st.sampled_from([1, 200]),  # R (also R >= W)
    st.integers(1, 6) | st.sampled_from([1, 100]),  # K (also K > regions)
)


# --------------------------------------------------------------------------- exactly once


def test_new_order_every_epoch_and_seed() -> None:
    w = 500
    orders = set()
    for seed in range(3):
        plan = block_plan(w, 40, 3, seed)
        ids, _ = plan.windows(np.arange(5 * w))
        orders.update(tuple(ids[e * w : (e + 1) * w].tolist()) for e in range(5))
    assert len(orders) == 15
    # and not the global shuffle's order for the same seed
    glob = Plan(w * 3 + 1, 3, 1, seed=0).windows(np.arange(w))[0]
    assert not np.array_equal(glob, block_plan(w, 40, 3, 0).windows(np.arange(w))[0])
    # region orders differ between epochs too (not only the in-block order)
    first_blocks = {tuple(reference_epoch(w, 40, 3, 0, e)[0].regions) for e in range(6)}
    assert len(first_blocks) > 1


# ---------------------------------------------------------------------- locality, spans


def test_block_spans_global_and_whole() -> None:
    assert Plan(1001, 10, 2).block_spans(123) == [(0, 1001)]
    # one block per epoch: the whole dataset (the windows' tokens, not trailing ones)
    plan = Plan(1005, 10, 2, shuffle="block", region_windows=10, block_regions=20)
    assert plan.block_spans(0) == [(0, 1001)]
    # many blocks ahead: a whole epoch is in range
    plan = block_plan(100, 10, 2, seq_len=10)
    assert plan.block_spans(7, blocks=11) == [(0, 1001)]
    assert plan.block_spans(7, blocks=1) != [(0, 1001)]


def test_block_spans_errors() -> None:
    plan = block_plan(100, 10, 2)
    with pytest.raises(PlanError, match="blocks must be >= 1"):
        plan.block_spans(0, 0)
    with pytest.raises(PlanError, match="position must be >= 0"):
        plan.block_spans(-1)
    with pytest.raises(PlanError, match="position must be an integer"):
        plan.block_spans(1.5)  # type: ignore[arg-type]


# ------------------------------------------------------------------ batching invariance


@SETTINGS
@given(
    sizes=sizes,
    seed=st.integers(0, 2**64 - 1),
    data=st.data(),
)
def test_order_independent_of_batching(
    sizes: tuple[int, int, int], seed: int, data: st.DataObject
) -> None:
    w, r, k = sizes
    plan = block_plan(w, r, k, seed)
    base = data.draw(st.integers(0, 10**12))
    pos = np.array(
        data.draw(st.lists(st.integers(0, 5 * w), min_size=1, max_size=300)), dtype=np.int64
    )
    pos = pos + base
    ids, eps = plan.windows(pos)
    one = [plan.windows(np.array([p])) for p in pos.tolist()]
    assert ids.tolist() == [int(i[0][0]) for i in one]
    assert eps.tolist() == [int(i[1][0]) for i in one]
    # sorted, 2-d and 0-d inputs agree
    order = np.argsort(pos, kind="stable")
    assert np.array_equal(plan.windows(pos[order])[0], ids[order])
    if pos.size % 2 == 0:
        assert np.array_equal(plan.windows(pos.reshape(2, -1))[0].reshape(-1), ids)
    assert int(plan.windows(np.int64(pos[0]))[0]) == ids[0]


def job_stream(
    plan: Plan, start: int, n_steps: int, num_workers: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """What every rank's DataLoader yields, laid out as global batches in step order."""
    g = plan.global_batch
    per_rank = []
    for rank in range(plan.world_size):
        items: list[list[tuple[np.ndarray, np.ndarray]]] = []
        streams: list[Iterator[list[int]]] = [
            worker_steps(w, num_workers, n_steps, k) for w in range(max(1, num_workers))
        ]
        live = list(range(len(streams)))
        i = 0
        while live:  # the DataLoader's round robin over its workers
            wk = live[i % len(live)]
            item = next(streams[wk], None)
            if item is None:
                live.remove(wk)
                continue
            ids, eps = plan.rank_batches(rank, step_position(start, item[0], g), len(item))
            items.append(list(zip(ids, eps, strict=True)))
            i += 1
        per_rank.append([row for item in items for row in item])
    ids_out = [per_rank[r][t][0] for t in range(n_steps) for r in range(plan.world_size)]
    eps_out = [per_rank[r][t][1] for t in range(n_steps) for r in range(plan.world_size)]
    empty = np.empty(0, np.int64)
    return np.concatenate([*ids_out, empty]), np.concatenate([*eps_out, empty])


@settings(max_examples=30, deadline=None)
@given(
    sizes=sizes,
    seed=st.integers(0, 2**64 - 1),
    old=st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(0, 3)),
    new=st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(0, 3)),
    k=st.integers(1, 3),
    old_steps=st.integers(0, 20),
    new_steps=st.integers(0, 15),
)
def test_ranks_workers_and_resume_give_the_stream(
    sizes: tuple[int, int, int],
    seed: int,
    old: tuple[int, int, int],
    new: tuple[int, int, int],
    k: int,
    old_steps: int,
    new_steps: int,
) -> None:
    w, r, kb = sizes
    (ws1, b1, nw1), (ws2, b2, nw2) = old, new
    p1 = block_plan(w, r, kb, seed, batch_size=b1, world_size=ws1)
    p2 = block_plan(w, r, kb, seed, batch_size=b2, world_size=ws2)
    assert p1.order_key == p2.order_key
    ids1, eps1 = job_stream(p1, 0, old_steps, nw1, k)
    consumed = old_steps * p1.global_batch
    ids2, eps2 = job_stream(p2, consumed, new_steps, nw2, k)
    total = consumed + new_steps * p2.global_batch
    ref_ids, ref_eps = block_plan(w, r, kb, seed).windows(np.arange(total))
    assert np.array_equal(np.concatenate([ids1, ids2]), ref_ids)
    assert np.array_equal(np.concatenate([eps1, eps2]), ref_eps)


# ------------------------------------------------------------------------ keys and errors


def test_order_key() -> None:
    g = Plan(1001, 10, 4, world_size=2, seed=7)
    assert g.order_key == ("global", 100, 7, 0, 0)
    b = Plan(1001, 10, 4, seed=7, shuffle="block", region_windows=10, block_regions=3)
    assert b.order_key == ("block", 100, 7, 10, 3)
    assert hash(b.order_key) != hash(g.order_key)
    # batch and world sizes do not change the order, hence not the key
    assert b.order_key == block_plan(100, 10, 3, 7, seq_len=10, batch_size=9).order_key


def test_window_blocks_cache_keeps_block_and_global_apart() -> None:
    serving = pytest.importorskip("tokenfeed_server.store.serving")
    cache = serving.WindowBlocks(block=64, max_blocks=8)
    glob = Plan(1001, 10, 4, seed=7)
    blk = Plan(1001, 10, 4, seed=7, shuffle="block", region_windows=10, block_regions=3)
    pos = np.arange(5, 60, dtype=np.int64)
    for plan in (glob, blk, glob):
        ids, eps = cache.windows(plan, pos)
        assert np.array_equal(ids, plan.windows(pos)[0])
        assert np.array_equal(eps, plan.windows(pos)[1])
    assert len(cache) == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shuffle": "local"}, "shuffle must be 'global' or 'block', got 'local'"),
        ({"shuffle": None}, "shuffle must be 'global' or 'block'"),
        ({"region_windows": 4}, "apply to shuffle='block' only"),
        ({"block_regions": 4}, "apply to shuffle='block' only"),
        ({"shuffle": "block"}, "needs region_windows >= 1 and block_regions >= 1"),
        ({"shuffle": "block", "region_windows": 4}, "default_block_sizes"),
        ({"shuffle": "block", "block_regions": 4}, "block_regions >= 1"),
        ({"shuffle": "block", "region_windows": -1, "block_regions": 1}, "region_windows"),
        ({"shuffle": "block", "region_windows": 1, "block_regions": 2**63}, "block_regions"),
        ({"shuffle": "block", "region_windows": 1.0, "block_regions": 1}, "integer"),
    ],
)
def test_plan_rejects_bad_shuffle_options(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(PlanError, match=match) as info:
        Plan(n_tokens=100, seq_len=4, batch_size=1, **kwargs)
    assert isinstance(info.value, ConfigError)


def test_numpy_sizes_are_normalized() -> None:
    plan = Plan(100, 4, 1, shuffle="block", region_windows=np.int64(5), block_regions=np.uint8(2))
    assert type(plan.region_windows) is int
    assert type(plan.block_regions) is int
    assert plan.order_key == ("block", 24, 0, 5, 2)


# ------------------------------------------------------------------ global order unchanged

# blake2b-128 of windows()'s (ids, epochs) bytes for 5000 positions from `start`, recorded
# from the implementation before the block shuffle existed (commit d53b21a): the global
# order must never change, or every job's resume breaks.
PINNED_GLOBAL = [
    (11, 2, 0, 0, [2, 0, 3, 1], "90d65f95cc332bd7c3325859bdff14c7"),
    (1000, 7, 12345, 3, [58, 66, 30, 124], "f02c0da4eb20f0b00bc564038e760105"),
    (
        10**6,
        1,
        2**64 - 1,
        999995,
        [373124, 65590, 605969, 121265],
        "54e540a153ec30fb45bd5ce5b6d65907",
    ),
    (
        10**12,
        2048,
        42,
        18066406224,
        [184568087, 204810835, 72673492, 127312538],
        "a1978e78a858c102be9c95500f03b32e",
    ),
    (12292, 3, 7, 0, [751, 1970, 788, 3760], "3994f15911eb57bcde3a26545aa8fc8e"),
]


@pytest.mark.parametrize(("n", "seq_len", "seed", "start", "head", "digest"), PINNED_GLOBAL)
def test_global_order_pinned(
    n: int, seq_len: int, seed: int, start: int, head: list[int], digest: str
) -> None:
    ids, eps = Plan(n, seq_len, 1, seed=seed).windows(np.arange(start, start + 5000))
    assert ids[:4].tolist() == head
    assert hashlib.blake2b(ids.tobytes() + eps.tobytes(), digest_size=16).hexdigest() == digest


def old_plan_module(tmp_path: Path) -> ModuleType:
    """tokenfeed/plan.py as of commit d53b21a (before the block shuffle), if git has it."""
    try:
        text = subprocess.run(
            ["git", "show", "d53b21a:client/tokenfeed/plan.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("git history with commit d53b21a is not available (shallow clone?)")
    path = tmp_path / "old_plan.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("old_plan_d53b21a", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_global_order_equals_the_old_implementation(tmp_path: Path) -> None:
    old = old_plan_module(tmp_path)
    rng = np.random.default_rng(4)
    for _ in range(40):
        seq_len = int(rng.integers(1, 9))
        n_tokens = int(rng.integers(seq_len + 1, 10**6))
        seed = int(rng.integers(0, 2**63))
        pos = rng.integers(0, 10**13, size=2000, dtype=np.int64)
        pos[:500] = np.arange(500) + int(pos[0])  # a run that may straddle an epoch
        new_ids, new_eps = Plan(n_tokens, seq_len, 1, seed=seed).windows(pos)
        old_ids, old_eps = old.Plan(n_tokens, seq_len, 1, seed=seed).windows(pos)
        assert np.array_equal(new_ids, old_ids)
        assert np.array_equal(new_eps, old_eps)
