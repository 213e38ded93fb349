"""The plan's invariants: exactly-once, disjoint ranks/workers, resume, errors. Pure numpy,
no network. The pure order math it composes is tested in tests/test_order_*.py."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from round_robin import dataloader_round_robin
from tokenfeed import plan as plan_module
from tokenfeed.errors import ConfigError, PlanError
from tokenfeed.order import blocks, feistel, splitmix, steps
from tokenfeed.plan import (
    INT64_MAX,
    Plan,
    permute,
    step_position,
    steps_to_cover,
    worker_steps,
)

SETTINGS = settings(max_examples=60, deadline=None)


def is_bijection(values: np.ndarray, n: int) -> bool:
    return bool(np.array_equal(np.sort(values), np.arange(n)))


# ------------------------------------------------------------------------------ Plan


def test_plan_hand_checked_example() -> None:
    # 11 tokens, L=2: windows [0,3) [2,5) [4,7) [6,9) [8,11) -> W=5. B=2, 2 ranks -> G=4.
    plan = Plan(n_tokens=11, seq_len=2, batch_size=2, world_size=2, seed=3)
    assert plan.n_windows == 5
    assert plan.global_batch == 4
    assert plan.rank_positions(0, 0).tolist() == [0, 1]
    assert plan.rank_positions(1, 0).tolist() == [2, 3]
    # resume at 3 (not a multiple of G): global batches start at 3 and 3 + 2*4 = 11
    assert plan.rank_positions(1, 3, count=2, stride=2).tolist() == [5, 6, 13, 14]
    assert plan.token_starts(np.array([0, 4])).tolist() == [0, 8]
    ids, epochs = plan.windows(np.array([4, 5, 9, 10]))
    assert epochs.tolist() == [0, 1, 1, 2]
    perm0 = permute(np.arange(5), 5, 3, 0)
    perm1 = permute(np.arange(5), 5, 3, 1)
    perm2 = permute(np.arange(5), 5, 3, 2)
    assert ids.tolist() == [perm0[4], perm1[0], perm1[4], perm2[0]]
    assert step_position(3, 2, 4) == 11
    assert steps_to_cover(3, 11, 4) == 2
    assert steps_to_cover(3, 12, 4) == 3
    assert steps_to_cover(5, 5, 4) == 0
    assert steps_to_cover(9, 5, 4) == 0


def test_plan_single_window_and_exact_fit() -> None:
    plan = Plan(n_tokens=5, seq_len=4, batch_size=3)
    assert plan.n_windows == 1
    ids, epochs = plan.windows(np.arange(6))
    assert ids.tolist() == [0] * 6
    assert epochs.tolist() == [0, 1, 2, 3, 4, 5]
    assert Plan(n_tokens=9, seq_len=4, batch_size=1).n_windows == 2
    assert Plan(n_tokens=8, seq_len=4, batch_size=1).n_windows == 1


@SETTINGS
@given(
    n_windows=st.integers(1, 300),
    seq_len=st.integers(1, 5),
    extra=st.integers(0, 4),
    seed=st.integers(0, 2**64 - 1),
    start_epoch=st.integers(0, 10**6),
)
def test_every_epoch_visits_every_window_once(
    n_windows: int, seq_len: int, extra: int, seed: int, start_epoch: int
) -> None:
    n_tokens = n_windows * seq_len + 1 + min(extra, seq_len - 1)
    plan = Plan(n_tokens=n_tokens, seq_len=seq_len, batch_size=1, seed=seed)
    assert plan.n_windows == n_windows
    w = n_windows
    # Three epochs of stream, from an offset inside an epoch, in odd-sized chunks that
    # straddle epoch boundaries.
    first = start_epoch * w
    pos = np.arange(first, first + 3 * w, dtype=np.int64)
    chunks = [plan.windows(c) for c in np.array_split(pos, 7)]
    ids = np.concatenate([c[0] for c in chunks])
    epochs = np.concatenate([c[1] for c in chunks])
    assert np.array_equal(epochs, pos // w)
    for e in range(start_epoch, start_epoch + 3):
        assert is_bijection(ids[epochs == e], w)
    # and the token starts of every window stay inside the dataset
    starts = plan.token_starts(ids)
    assert starts.min() >= 0
    assert (starts + seq_len + 1).max() <= n_tokens


@SETTINGS
@given(
    world_size=st.integers(1, 6),
    batch_size=st.integers(1, 7),
    pos=st.integers(0, 10**15),
    count=st.integers(1, 4),
    stride=st.integers(1, 3),
)
def test_ranks_disjoint_and_cover_global_batches(
    world_size: int, batch_size: int, pos: int, count: int, stride: int
) -> None:
    plan = Plan(n_tokens=10**6, seq_len=16, batch_size=batch_size, world_size=world_size)
    g = plan.global_batch
    per_rank = [plan.rank_positions(r, pos, count, stride) for r in range(world_size)]
    for r, p in enumerate(per_rank):
        assert p.shape == (count * batch_size,)
        assert p.dtype == np.int64
        blocks = p.reshape(count, batch_size)
        for j in range(count):
            q = pos + j * stride * g
            assert blocks[j].tolist() == list(range(q + r * batch_size, q + (r + 1) * batch_size))
    union = np.concatenate(per_rank)
    assert np.unique(union).size == union.size  # disjoint
    expected = np.concatenate([np.arange(g) + pos + j * stride * g for j in range(count)])
    assert np.array_equal(np.sort(union), np.sort(expected))
    ids, epochs = plan.rank_batches(world_size - 1, pos, count, stride)
    assert ids.shape == epochs.shape == (count, batch_size)
    exp_ids, exp_epochs = plan.windows(per_rank[-1])
    assert np.array_equal(ids.reshape(-1), exp_ids)
    assert np.array_equal(epochs.reshape(-1), exp_epochs)


Row = tuple[int, np.ndarray, np.ndarray]


@SETTINGS
@given(
    start=st.integers(0, 10**6),
    length=st.integers(0, 500),
    world_size=st.integers(1, 5),
    batch_size=st.integers(1, 9),
)
def test_finite_budget_same_steps_every_rank_nothing_dropped(
    start: int, length: int, world_size: int, batch_size: int
) -> None:
    plan = Plan(n_tokens=1000, seq_len=7, batch_size=batch_size, world_size=world_size)
    g = plan.global_batch
    end = start + length
    steps = steps_to_cover(start, end, g)
    served = np.concatenate(
        [plan.rank_positions(r, start, steps) for r in range(world_size)] + [np.empty(0, np.int64)]
    )
    # same number of steps for every rank by construction: count*B rows each
    assert served.size == steps * g
    assert set(range(start, end)) <= set(served.tolist())
    assert served.size - length < g  # the overshoot is less than one global batch
    assert steps == math.ceil(length / g)


def job_stream(
    plan: Plan, start: int, n_steps: int, num_workers: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Simulate a whole job: every rank runs a DataLoader with `num_workers` workers, each
    worker fetching its steps via worker_steps/rank_batches; return the global stream of
    (window ids, epochs) as the trainer sees it, step by step, ranks in order."""
    g = plan.global_batch
    per_rank: list[list[tuple[np.ndarray, np.ndarray]]] = []
    for r in range(plan.world_size):

        def worker(w: int, r: int = r) -> Iterator[list[Row]]:
            # one DataLoader item = the k consecutive steps worker_steps assigns it
            for item in worker_steps(w, num_workers, n_steps, k):
                ids, eps = plan.rank_batches(r, step_position(start, item[0], g), len(item))
                yield [(s, i, e) for s, i, e in zip(item, ids, eps, strict=True)]

        streams = [worker(w) for w in range(max(1, num_workers))]
        got: list[tuple[np.ndarray, np.ndarray]] = []
        for item in dataloader_round_robin(streams, 10**9):
            for s, i, e in item:
                assert s == len(got)  # local steps arrive 0, 1, 2, ... in order
                got.append((i, e))
        assert len(got) == n_steps
        per_rank.append(got)
    ids = [per_rank[r][t][0] for t in range(n_steps) for r in range(plan.world_size)]
    eps = [per_rank[r][t][1] for t in range(n_steps) for r in range(plan.world_size)]
    empty = np.empty(0, np.int64)
    return np.concatenate([*ids, empty]), np.concatenate([*eps, empty])


@settings(max_examples=40, deadline=None)
@given(
    n_windows=st.integers(1, 60),
    seed=st.integers(0, 2**64 - 1),
    old=st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(0, 3)),
    new=st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(0, 3)),
    k=st.integers(1, 3),
    old_steps=st.integers(0, 30),
    new_steps=st.integers(0, 20),
)
def test_resume_with_other_world_size_and_workers_equals_uninterrupted(
    n_windows: int,
    seed: int,
    old: tuple[int, int, int],
    new: tuple[int, int, int],
    k: int,
    old_steps: int,
    new_steps: int,
) -> None:
    seq_len = 3
    n_tokens = n_windows * seq_len + 1
    (ws1, b1, nw1), (ws2, b2, nw2) = old, new
    p1 = Plan(n_tokens, seq_len, b1, ws1, seed)
    p2 = Plan(n_tokens, seq_len, b2, ws2, seed)
    # The old job consumes P = old_steps * G_old samples, then checkpoints P.
    ids1, eps1 = job_stream(p1, 0, old_steps, nw1, k)
    consumed = old_steps * p1.global_batch
    # The new job resumes at P with another world size / batch size / worker count.
    ids2, eps2 = job_stream(p2, consumed, new_steps, nw2, k)
    total = consumed + new_steps * p2.global_batch
    ref_ids, ref_eps = Plan(n_tokens, seq_len, 1, 1, seed).windows(np.arange(total))
    assert np.array_equal(np.concatenate([ids1, ids2]), ref_ids)
    assert np.array_equal(np.concatenate([eps1, eps2]), ref_eps)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_tokens": 4, "seq_len": 4, "batch_size": 1}, "fewer than one window"),
        ({"n_tokens": 0, "seq_len": 1, "batch_size": 1}, "fewer than one window"),
        ({"n_tokens": -5, "seq_len": 1, "batch_size": 1}, "n_tokens"),
        ({"n_tokens": 100, "seq_len": 0, "batch_size": 1}, "seq_len"),
        ({"n_tokens": 100, "seq_len": -3, "batch_size": 1}, "seq_len"),
        ({"n_tokens": 100, "seq_len": 4, "batch_size": 0}, "batch_size"),
        ({"n_tokens": 100, "seq_len": 4, "batch_size": -1}, "batch_size"),
        ({"n_tokens": 100, "seq_len": 4, "batch_size": 1, "world_size": 0}, "world_size"),
        ({"n_tokens": 100, "seq_len": 4, "batch_size": 1, "seed": -1}, "seed"),
        ({"n_tokens": 100, "seq_len": 4, "batch_size": 1, "seed": 2**64}, "seed"),
        ({"n_tokens": 2**63, "seq_len": 4, "batch_size": 1}, "n_tokens"),
        ({"n_tokens": 100, "seq_len": 2**63, "batch_size": 1}, "seq_len"),
        ({"n_tokens": 100, "seq_len": 4, "batch_size": 2**32, "world_size": 2**32}, "overflow"),
        ({"n_tokens": 100.0, "seq_len": 4, "batch_size": 1}, "integer"),
        ({"n_tokens": 100, "seq_len": True, "batch_size": 1}, "integer"),
    ],
)
def test_plan_rejects_degenerate_sizes(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(PlanError, match=match) as info:
        Plan(**kwargs)
    assert isinstance(info.value, ConfigError)
    assert isinstance(info.value, ValueError)


def test_plan_method_errors() -> None:
    plan = Plan(n_tokens=100, seq_len=4, batch_size=2, world_size=3)
    with pytest.raises(PlanError, match="rank 3 is out of range"):
        plan.rank_positions(3, 0)
    with pytest.raises(PlanError, match="rank"):
        plan.rank_positions(-1, 0)
    with pytest.raises(PlanError, match="pos"):
        plan.rank_positions(0, -1)
    with pytest.raises(PlanError, match="stride"):
        plan.rank_positions(0, 0, 2, 0)
    with pytest.raises(PlanError, match="overflow"):
        plan.rank_positions(0, INT64_MAX - 3)
    with pytest.raises(PlanError, match="overflow"):
        plan.rank_positions(0, 0, count=3, stride=2**62)
    with pytest.raises(PlanError, match="positions"):
        plan.windows(np.array([-1]))
    with pytest.raises(PlanError, match="integer"):
        plan.windows(np.array([1.5]))
    with pytest.raises(PlanError, match="window ids"):
        plan.token_starts(np.array([plan.n_windows]))
    # positions right up to the int64 limit still work
    ids, epochs = Plan(n_tokens=100, seq_len=4, batch_size=1).windows(np.array([INT64_MAX]))
    assert 0 <= int(ids[0]) < 24
    assert int(epochs[0]) == INT64_MAX // 24


def test_order_functions_are_importable_from_the_plan() -> None:
    # The documented import paths (tokenfeed.plan) name the order package's own objects.
    assert plan_module.permute is feistel.permute
    assert plan_module.splitmix64 is splitmix.splitmix64
    assert plan_module.default_block_sizes is blocks.default_block_sizes
    assert plan_module.step_position is steps.step_position
    assert plan_module.steps_to_cover is steps.steps_to_cover
    assert plan_module.worker_steps is steps.worker_steps
    assert (plan_module.ROUNDS, plan_module.SMALL_ROUNDS) == (feistel.ROUNDS, feistel.SMALL_ROUNDS)
