"""The block shuffle's layout (:mod:`tokenfeed.order.blocks`), tested directly: every
window exactly once per epoch, the same order as a slow reference, a block reads only its
regions, block_spans, quality, huge sizes, default_block_sizes. Pure numpy, no network."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from block_reference import RefBlock, merged, reference_epoch, reference_windows
from tokenfeed.errors import PlanError
from tokenfeed.order.blocks import BlockLayout, default_block_sizes
from tokenfeed.order.ints import INT64_MAX
from tokenfeed.plan import Plan

SETTINGS = settings(max_examples=60, deadline=None)


def windows_of(layout: BlockLayout, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stream positions to ``(window ids, epochs)`` as :meth:`Plan.windows` splits them."""
    p = np.asarray(positions, dtype=np.int64)
    epochs = p // np.int64(layout.w)
    return layout.windows(p - epochs * np.int64(layout.w), epochs), epochs


sizes = st.tuples(
    st.integers(1, 120),  # W
    st.integers(1, 40) | st.sampled_from([1, 200]),  # R (also R >= W)
    st.integers(1, 6) | st.sampled_from([1, 100]),  # K (also K > regions)
)


# --------------------------------------------------------------------------- exactly once


@SETTINGS
@given(sizes=sizes, seed=st.integers(0, 2**64 - 1), start_epoch=st.integers(0, 10**9))
def test_every_epoch_visits_every_window_once(
    sizes: tuple[int, int, int], seed: int, start_epoch: int
) -> None:
    w, r, k = sizes
    layout = BlockLayout.of(w, r, k, seed)
    assert layout.w == w
    first = start_epoch * w + (seed % w)  # start inside an epoch
    pos = np.arange(first, first + 3 * w, dtype=np.int64)
    chunks = [windows_of(layout, c) for c in np.array_split(pos, 5)]
    ids = np.concatenate([c[0] for c in chunks])
    epochs = np.concatenate([c[1] for c in chunks])
    assert ids.dtype == epochs.dtype == np.int64
    assert np.array_equal(epochs, pos // w)
    for e in np.unique(epochs)[1:-1]:  # the full epochs
        assert np.array_equal(np.sort(ids[epochs == e]), np.arange(w))
    assert np.array_equal(ids, reference_windows(w, r, k, seed, pos))


@pytest.mark.parametrize(
    ("w", "r", "k"),
    [
        (1, 1, 1),
        (1, 5, 3),
        (7, 1, 1),  # one-window regions and blocks
        (7, 1, 3),
        (7, 7, 1),  # one region
        (7, 100, 4),  # R >= W
        (10, 3, 2),  # short region of 1
        (10, 4, 100),  # K > regions: one block per epoch
        (12, 4, 2),  # W a multiple of R: no short region
        (97, 10, 3),
        (1000, 33, 5),
        (4097, 64, 4),
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2**64 - 1])
def test_grid_matches_reference_and_is_exact(w: int, r: int, k: int, seed: int) -> None:
    layout = BlockLayout.of(w, r, k, seed)
    pos = np.arange(0, 4 * w, dtype=np.int64)
    ids, _ = windows_of(layout, pos)
    for e in range(4):
        assert np.array_equal(np.sort(ids[e * w : (e + 1) * w]), np.arange(w))
    assert np.array_equal(ids, reference_windows(w, r, k, seed, pos))


def test_hand_checked_layout() -> None:
    # W=10, R=3, K=2: regions {0,1,2} {3,4,5} {6,7,8} {9}; 2 blocks; the short region {9}
    # makes its block one window short of 6.
    layout = BlockLayout.of(10, 3, 2, 5)
    ids, _ = windows_of(layout, np.arange(10))
    blocks = reference_epoch(10, 3, 2, 5, 0)
    sizes = [len(b.order) for b in blocks]
    assert sorted(sizes) == [4, 6]
    assert ids.tolist() == blocks[0].order + blocks[1].order
    for blk in blocks:
        chunk = ids[blk.start : blk.start + len(blk.order)]
        expected = sorted(w for reg in blk.regions for w in range(reg * 3, min(reg * 3 + 3, 10)))
        assert sorted(chunk.tolist()) == expected


# ---------------------------------------------------------------------- locality, spans


@SETTINGS
@given(sizes=sizes, seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 10**6))
def test_windows_of_a_block_come_only_from_its_regions(
    sizes: tuple[int, int, int], seed: int, epoch: int
) -> None:
    w, r, k = sizes
    seq_len = 3
    layout = BlockLayout.of(w, r, k, seed)
    re = min(r, w)
    ids, _ = windows_of(layout, np.arange(epoch * w, (epoch + 1) * w))
    for blk in reference_epoch(w, r, k, seed, epoch):
        part = ids[blk.start : blk.start + len(blk.order)]
        assert set((part // re).tolist()) == set(blk.regions)
        # block_spans of any position of the block (blocks=1) is exactly its regions
        spans = [(g * re * seq_len, min(g * re + re, w) * seq_len + 1) for g in blk.regions]
        for q in {blk.start, blk.start + len(blk.order) - 1}:
            assert layout.block_spans(seq_len, epoch * w + q, 1) == merged(spans)
    # every window of a region lands within one block: fewer than K*R positions apart
    where = np.empty(w, dtype=np.int64)
    where[ids] = np.arange(w)
    region_of = np.arange(w) // re
    for g in range(-(-w // re)):
        spread = where[region_of == g]
        assert spread.max() - spread.min() < min(k, -(-w // re)) * re


@SETTINGS
@given(
    sizes=sizes,
    seed=st.integers(0, 2**64 - 1),
    position=st.integers(0, 10**5),
    blocks=st.integers(1, 5),
)
def test_block_spans_cover_exactly_the_tokens_read(
    sizes: tuple[int, int, int], seed: int, position: int, blocks: int
) -> None:
    w, r, k = sizes
    seq_len = 4
    layout = BlockLayout.of(w, r, k, seed)
    # The stream's blocks from the reference, epoch by epoch, until `blocks` are found.
    e, q = divmod(position, w)
    found: list[tuple[int, RefBlock]] = []
    while len(found) < blocks:
        for blk in reference_epoch(w, r, k, seed, e):
            if found or blk.start <= q < blk.start + len(blk.order):
                found.append((e, blk))
                if len(found) == blocks:
                    break
        e, q = e + 1, -1
    positions = np.concatenate(
        [np.arange(ep * w + b.start, ep * w + b.start + len(b.order)) for ep, b in found]
    )
    ids, _ = windows_of(layout, positions)
    read = merged([(i * seq_len, i * seq_len + seq_len + 1) for i in ids.tolist()])
    assert layout.block_spans(seq_len, position, blocks) == read


def test_many_small_blocks_in_one_call() -> None:
    # Many distinct blocks in one batch: keys and block info computed per row.
    w, r, k = 5000, 3, 2
    layout = BlockLayout.of(w, r, k, 9)
    pos = np.arange(w - 700, w + 700, dtype=np.int64)  # also straddles an epoch
    ids, _ = windows_of(layout, pos)
    assert np.array_equal(ids, reference_windows(w, r, k, 9, pos))
    rng = np.random.default_rng(0)
    shuffled = rng.permutation(pos)
    assert np.array_equal(windows_of(layout, shuffled)[0], reference_windows(w, r, k, 9, shuffled))


# ------------------------------------------------------------------------------ quality


@pytest.mark.parametrize(("w", "r", "k"), [(48, 4, 3), (60, 5, 4), (30, 1, 3), (16, 4, 4)])
def test_every_window_lands_everywhere_equally_often(w: int, r: int, k: int) -> None:
    # With W a multiple of R (no short region) every region is equally likely in every
    # slot and every window at every place of its block, so across epochs each window
    # lands at each position equally often. Chi-square of the (window, position) table
    # over many epochs, in one call (a table path over many blocks); 5 sd as in
    # test_plan.py. A fixed region order or in-block order fails this.
    epochs = 6000
    layout = BlockLayout.of(w, r, k, 11)
    ids, _ = windows_of(layout, np.arange(epochs * w))
    table = np.zeros((w, w))
    np.add.at(table, (ids, np.tile(np.arange(w), epochs)), 1)
    assert np.all(table.sum(axis=1) == epochs)
    expected = epochs / w
    chi2 = float(((table - expected) ** 2 / expected).sum())
    dof = (w - 1) ** 2
    assert chi2 < dof + 5 * math.sqrt(2 * dof) + 2


def test_block_order_is_not_region_major() -> None:
    # Inside a block, consecutive positions mix its regions (not one region, then the
    # next): over a block of 4 regions x 256 windows, region changes between neighbours
    # happen about 3/4 of the time.
    layout = BlockLayout.of(1024 * 8, 256, 4, 3)
    ids, _ = windows_of(layout, np.arange(1024))
    regions = ids // 256
    assert len(set(regions.tolist())) == 4
    changes = float(np.mean(regions[1:] != regions[:-1]))
    assert 0.65 < changes < 0.85


# ---------------------------------------------------------------------------- large sizes


@pytest.mark.parametrize(
    ("n_tokens", "r", "k"),
    [
        (INT64_MAX, 2**40 + 3, 3),  # W = 2**63 - 2: offsets + deficit exceed int64
        (INT64_MAX, 2**62 + 1, 1),  # two regions, the short one about half
        (10**12, 32768, 4),
        (INT64_MAX, INT64_MAX, INT64_MAX),
        (INT64_MAX, 1, 1),  # W blocks per epoch: serials up to ~2**64
        (INT64_MAX, 3, 5),
    ],
)
def test_huge_datasets_stay_in_range_and_injective(n_tokens: int, r: int, k: int) -> None:
    layout = BlockLayout.of(n_tokens - 1, r, k, 3)  # seq_len 1: n_tokens - 1 windows
    w = layout.w
    rng = np.random.default_rng(0)
    local = np.unique(
        np.concatenate([rng.integers(0, w, 20000, dtype=np.int64), [0, 1, w - 2, w - 1]])
    )
    for epoch in (0, INT64_MAX // w - 1):
        ids, eps = windows_of(layout, local + epoch * w)
        assert (eps == epoch).all()
        assert ids.min() >= 0
        assert ids.max() < w
        assert np.unique(ids).size == local.size
    last, eps = windows_of(layout, np.array([INT64_MAX]))
    assert 0 <= int(last[0]) < w
    for p in (0, w - 1, INT64_MAX):
        spans = layout.block_spans(1, p, 3)
        assert spans
        assert all(0 <= a < b <= w + 1 for a, b in spans)


def test_default_block_sizes() -> None:
    # 10 shards of 2**20 tokens and a short one, seq_len 2048: a region = 512 windows
    shards = [2**20] * 10 + [1000]
    assert default_block_sizes(shards, 2048) == (512, 4)
    # fewer regions than 4: a block of all of them
    assert default_block_sizes([2**20, 2**20], 2048) == (512, 2)
    assert default_block_sizes([2**20], 2048) == (511, 1)  # W = 511: one region
    # shards smaller than a window: one-window regions
    assert default_block_sizes([3] * 100, 8) == (1, 4)
    # usable as a Plan's sizes
    r, k = default_block_sizes(shards, 2048)
    plan = Plan(sum(shards), 2048, 1, shuffle="block", region_windows=r, block_regions=k)
    assert plan.block_spans(0, 1)[0][1] - plan.block_spans(0, 1)[0][0] <= 4 * 512 * 2048 + 1
    with pytest.raises(PlanError, match="fewer than one window"):
        default_block_sizes([], 4)
    with pytest.raises(PlanError, match="fewer than one window"):
        default_block_sizes([2, 2], 4)
    with pytest.raises(PlanError, match=r"shard_tokens\[1\]"):
        default_block_sizes([10, -1], 4)
    with pytest.raises(PlanError, match="seq_len"):
        default_block_sizes([10], 0)
