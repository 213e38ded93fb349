"""Global steps, resume positions and DataLoader workers (:mod:`tokenfeed.order.steps`):
workers rebuild the local steps in order, disjointly; resume positions chain; errors.
Pure Python, no network."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from round_robin import dataloader_round_robin
from tokenfeed.errors import PlanError
from tokenfeed.order.ints import INT64_MAX
from tokenfeed.order.steps import step_position, steps_to_cover, worker_steps

SETTINGS = settings(max_examples=60, deadline=None)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("num_workers", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("n_steps", [0, 1, 2, 5, 7, 12, 13, None])
def test_workers_reconstruct_local_steps_in_order(
    k: int, num_workers: int, n_steps: int | None
) -> None:
    n_workers = max(1, num_workers)
    streams = [worker_steps(w, num_workers, n_steps, k) for w in range(n_workers)]
    limit = 50
    items = dataloader_round_robin(streams, limit)
    flat = [s for item in items for s in item]
    if n_steps is None:
        assert len(items) == limit
        assert flat == list(range(limit * k))
    else:
        assert flat == list(range(n_steps))
        assert all(len(it) == k for it in items[:-1])
        if items:
            assert 1 <= len(items[-1]) <= k
    assert_workers_disjoint(num_workers, n_steps, k, ramp=False)


@pytest.mark.parametrize("k", [1, 2, 5, 16])
@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
@pytest.mark.parametrize("n_steps", [0, 1, 2, 5, 7, 40, 41, None])
def test_ramped_items_keep_the_order(k: int, num_workers: int, n_steps: int | None) -> None:
    n_workers = max(1, num_workers)
    streams = [worker_steps(w, num_workers, n_steps, k, ramp=True) for w in range(n_workers)]
    items = dataloader_round_robin(streams, 60)
    flat = [s for item in items for s in item]
    assert flat == (list(range(len(flat))) if n_steps is None else list(range(n_steps)))
    if items:
        assert len(items[0]) == 1  # the first batch needs only one batch received
    sizes = [len(it) for it in items[: len(items) - (n_steps is not None)]]
    expected = [min(k, 2 ** (g // n_workers)) for g in range(len(sizes))]
    assert sizes == expected
    assert_workers_disjoint(num_workers, n_steps, k, ramp=True)


def assert_workers_disjoint(num_workers: int, n_steps: int | None, k: int, *, ramp: bool) -> None:
    # workers are disjoint: each step comes from exactly one worker
    n_workers = max(1, num_workers)
    owners: dict[int, int] = {}
    for w in range(n_workers):
        for item in itertools.islice(worker_steps(w, num_workers, n_steps, k, ramp=ramp), 20):
            for s in item:
                assert s not in owners
                owners[s] = w


@SETTINGS
@given(start=st.integers(0, 10**12), g_old=st.integers(1, 64), g_new=st.integers(1, 64))
def test_resume_positions_chain(start: int, g_old: int, g_new: int) -> None:
    # A second resume composes: positions are absolute, step numbers are not.
    p = step_position(start, 5, g_old)
    assert p == start + 5 * g_old
    assert step_position(p, 3, g_new) == start + 5 * g_old + 3 * g_new
    assert steps_to_cover(p, p + 3 * g_new, g_new) == 3


def test_step_function_errors() -> None:
    with pytest.raises(PlanError, match="overflow"):
        step_position(INT64_MAX, 1, 1)
    with pytest.raises(PlanError, match="global_batch"):
        steps_to_cover(0, 10, 0)
    with pytest.raises(PlanError, match="worker 2 is out of range"):
        worker_steps(2, 2, 10)
    with pytest.raises(PlanError, match="worker 1 is out of range"):
        worker_steps(1, 0, 10)
    with pytest.raises(PlanError, match="batches_per_item"):
        worker_steps(0, 2, 10, 0)
    with pytest.raises(PlanError, match="n_steps"):
        worker_steps(0, 2, -1)
