"""One period of a mixture segment: the smooth weighted round robin order of its sources.

The order inside a period: smooth weighted round robin
    One period is the sequence nginx's smooth weighted round robin (SWRR) produces from
    all-zero state: at each step every source adds its weight to its *current*, the
    source with the largest current wins (ties: the lowest source index) and ``W`` is
    subtracted from the winner's current. After ``k`` steps source ``s`` has
    ``current_s = k*w_s - W*n_s(k)`` where ``n_s(k)`` counts its wins, and the currents
    sum to 0. Every step's winner had the largest of values summing to ``W``, hence
    ``> 0``, so every current stays ``> -W``. Two consequences, both tested:

    - *Exact counts*: after ``W`` steps ``n_s < w_s + 1`` for every ``s`` and
      ``sum(n_s) = W = sum(w_s)``, so ``n_s = w_s`` exactly and every current is 0
      again: the sequence is periodic with period ``W``.
    - *Smoothness*: in every prefix of ``k`` rows of a period a source is never ahead of
      its share by a whole row, ``n_s(k) <= ceil(k*w_s/W)``, and never behind by as much
      as the number of other sources, ``n_s(k) > k*w_s/W - (m - 1)`` (the currents sum
      to 0 and each is ``> -W``). With two sources that makes ``|n_s(k) - k*w_s/W| < 1``.
      With more sources a source can lag a little over one row (1:1:1:1:7:7 puts a
      weight-7 source 1.06 rows behind; at most about 1.2 rows in random trials with up
      to 12 sources). Weights 5:1:1 give ``a a b a c a a``, never ``a a a a a b c``.

    The period's table (source per offset, and the offset's rank among its source's
    occurrences in the period) is computed once per distinct weight vector and shared.
"""

from __future__ import annotations

import functools

import numpy as np

from tokenfeed.order.ints import IntArray

__all__ = ["period_table"]

#: Above this many sources in one segment, one SWRR step is done with numpy rather than
#: Python lists (a step costs O(sources) either way; numpy wins past a few dozen).
_NUMPY_SOURCES = 48


@functools.lru_cache(maxsize=16)
def period_table(weights: tuple[int, ...]) -> tuple[IntArray, IntArray]:
    """One SWRR period of positive ``weights``: (winner index per step, its rank).

    Shared between all mixtures with the same weight vector (read-only arrays).
    """
    m, total = len(weights), sum(weights)
    winners = np.empty(total, dtype=np.int64)
    ranks = np.empty(total, dtype=np.int64)
    seen = [0] * m
    if m == 1:
        winners[:] = 0
        ranks[:] = np.arange(total, dtype=np.int64)
    elif m <= _NUMPY_SOURCES:
        cur = [0] * m
        for step in range(total):
            cur = [c + w for c, w in zip(cur, weights, strict=True)]
            b = cur.index(max(cur))  # first maximum: ties go to the lowest index
            cur[b] -= total
            winners[step] = b
            ranks[step] = seen[b]
            seen[b] += 1
    else:
        w_arr = np.array(weights, dtype=np.int64)
        cur_arr = np.zeros(m, dtype=np.int64)
        for step in range(total):
            cur_arr += w_arr
            b = int(np.argmax(cur_arr))  # first maximum, as above
            cur_arr[b] -= total
            winners[step] = b
            ranks[step] = seen[b]
            seen[b] += 1
    winners.setflags(write=False)
    ranks.setflags(write=False)
    return winners, ranks
