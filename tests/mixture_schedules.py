"""Hypothesis strategies for mixture schedules, shared by the mixture and order tests."""

from __future__ import annotations

import math
from collections.abc import Mapping

from hypothesis import strategies as st

NAMES = ["web", "code", "math", "books", "wiki", "arxiv"]

weights_st = st.dictionaries(
    st.sampled_from(NAMES), st.integers(1, 20), min_size=1, max_size=len(NAMES)
)


@st.composite
def schedules(
    draw: st.DrawFn, max_segments: int = 4, max_gap: int = 200
) -> list[tuple[int, dict[str, int]]]:
    n = draw(st.integers(1, max_segments))
    gaps = draw(st.lists(st.integers(1, max_gap), min_size=n - 1, max_size=n - 1))
    starts = [0]
    for g in gaps:
        starts.append(starts[-1] + g)
    return [(s, draw(weights_st)) for s in starts]


def reduced(weights: Mapping[str, int]) -> dict[str, int]:
    g = math.gcd(*weights.values())
    return {k: v // g for k, v in weights.items()}
