"""A mixture's locate tables (:mod:`tokenfeed.order.locate`), tested directly: exact counts
in every aligned period, source positions 0, 1, 2, ... across segments, every block shape
on the same order, exact far down the stream. Pure numpy, no network."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mixture_schedules import reduced, schedules
from tokenfeed.mixture import Mixture
from tokenfeed.order.ints import INT64_MAX
from tokenfeed.order.locate import SegmentTables

SETTINGS = settings(max_examples=60, deadline=None)


@SETTINGS
@given(schedule=schedules(), periods=st.lists(st.integers(0, 10**12), min_size=1, max_size=3))
def test_exact_counts_in_every_aligned_period(
    schedule: list[tuple[int, dict[str, int]]], periods: list[int]
) -> None:
    mix = Mixture(schedule)
    tables = SegmentTables(mix.names, mix.segments)
    # the last segment is open-ended: check periods far down the stream too
    for k, (start, weights) in enumerate(schedule):
        red = reduced(weights)
        period = sum(red.values())
        end = schedule[k + 1][0] if k + 1 < len(schedule) else None
        qs = [0, 1] + (periods if end is None else [])
        for q in qs:
            lo = start + q * period
            if end is not None and lo + period > end:
                continue
            src, _ = tables.locate(np.arange(lo, lo + period, dtype=np.int64))
            got = np.bincount(src, minlength=len(mix.names))
            want = [red.get(name, 0) for name in mix.names]
            assert got.tolist() == want


@SETTINGS
@given(schedule=schedules(), n=st.integers(1, 1500))
def test_source_positions_continue_across_segments(
    schedule: list[tuple[int, dict[str, int]]], n: int
) -> None:
    """Each source's positions are 0, 1, 2, ... over the whole multi-segment stream."""
    mix = Mixture(schedule)
    tables = SegmentTables(mix.names, mix.segments)
    src, pos = tables.locate(np.arange(n, dtype=np.int64))
    for s in range(len(mix.names)):
        mine = pos[src == s]
        assert mine.tolist() == list(range(len(mine)))
    assert tables.counts(n) == np.bincount(src, minlength=len(mix.names)).tolist()


@SETTINGS
@given(
    schedule=schedules(max_segments=30, max_gap=40), block=st.integers(1, 300), seed=st.integers()
)
def test_block_shapes_take_the_same_order(
    schedule: list[tuple[int, dict[str, int]]], block: int, seed: int
) -> None:
    """Sorted blocks inside one segment, across a few boundaries, across many, and
    shuffled positions all give the same rows (locate has one path for each)."""
    mix = Mixture(schedule)
    tables = SegmentTables(mix.names, mix.segments)
    n = schedule[-1][0] + 50
    src, pos = tables.locate(np.arange(n, dtype=np.int64))
    for s in range(len(mix.names)):
        assert pos[src == s].tolist() == list(range(int((src == s).sum())))
    pieces = [tables.locate(np.arange(a, min(a + block, n))) for a in range(0, n, block)]
    assert np.concatenate([x[0] for x in pieces]).tolist() == src.tolist()
    assert np.concatenate([x[1] for x in pieces]).tolist() == pos.tolist()
    order = np.random.default_rng(seed % 2**32).permutation(n)
    s2, p2 = tables.locate(order)
    assert s2.tolist() == src[order].tolist() and p2.tolist() == pos[order].tolist()


@SETTINGS
@given(schedule=schedules(max_gap=10**17), data=st.data())
def test_far_positions_match_exact_counts(
    schedule: list[tuple[int, dict[str, int]]], data: st.DataObject
) -> None:
    """Up to 2**63 - 1 without overflow: a row's source position equals the exact
    (Python int) count of earlier rows of its source."""
    mix = Mixture(schedule)
    tables = SegmentTables(mix.names, mix.segments)
    ps = data.draw(st.lists(st.integers(0, INT64_MAX - 1), min_size=1, max_size=8))
    ps += [INT64_MAX - 1, 2**62, schedule[-1][0]]
    src, pos = tables.locate(np.array(ps, dtype=np.int64))
    for p, s, sp in zip(ps, src.tolist(), pos.tolist(), strict=True):
        assert 0 <= sp <= p
        assert tables.counts(p)[s] == sp
        assert tables.counts(p + 1)[s] == sp + 1
