"""Many keyed permutations in one call: each row with its own domain size and tweak.

The block shuffle permutes the windows of every block by its own key (the block's serial
number in the stream, the *tweak*) over its own size, and one call's rows span a few
blocks. Running every row through one Feistel network, with per-row keys and a per-row
bound on the cycle walk, costs about what one :func:`~tokenfeed.order.feistel.permute`
of the same rows costs; the per-tweak keys are derived vectorized and, for the runs of
consecutive tweaks that consecutive calls ask for, cached.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import numpy.typing as npt

from tokenfeed.order.feistel import domain_bits, encrypt, round_keys, rounds_for
from tokenfeed.order.ints import U64Array
from tokenfeed.order.splitmix import GOLDEN, MASK64, splitmix64

__all__ = ["CACHE_SLOTS", "Tweak", "permute_sized", "range_round_keys", "vector_round_keys"]

#: Tweak ranges longer than this (calls of very many rows) get their keys computed, not
#: cached: the caches stay a few MiB at most, whatever the calls.
CACHE_SLOTS = 16384

#: A permutation's tweak per row: one int for all rows, one per row, or
#: ``(first, count, rows)``: row i has tweak ``first + rows[i]``, ``0 <= rows[i] < count``.
Tweak = int | U64Array | tuple[int, int, npt.NDArray[np.intp]]


def vector_round_keys(seed: int, tweaks: U64Array, rounds: int) -> list[U64Array]:
    """``round_keys(seed, t, rounds)`` of every ``t`` in ``tweaks``, as one array per
    round (splitmix64 on uint64 arrays wraps exactly like it does on ints)."""
    with np.errstate(over="ignore"):
        base = splitmix64(np.uint64(splitmix64(seed)) ^ tweaks)
        return [splitmix64(base + np.uint64(r * GOLDEN & MASK64)) for r in range(rounds)]


@lru_cache(maxsize=16)
def range_round_keys(seed: int, first: int, count: int, rounds: int) -> list[U64Array]:
    """:func:`vector_round_keys` of tweaks ``[first, first + count)``, cached: the block
    serials of consecutive calls (see :meth:`tokenfeed.order.blocks.BlockLayout.windows`)."""
    keys = vector_round_keys(seed, np.arange(first, first + count, dtype=np.uint64), rounds)
    for key in keys:
        key.flags.writeable = False
    return keys


def _tweak_keys(seed: int, tweak: Tweak, rounds: int) -> tuple[list[U64Array], bool]:
    """The round keys ``round_keys(seed, t, rounds)`` of every row's tweak ``t``, and
    whether they differ per row (else each key is a 1-element array)."""
    if isinstance(tweak, tuple):
        first, count, rows = tweak
        if count <= CACHE_SLOTS:
            keys = range_round_keys(seed, first, count, rounds)
        else:
            tweaks = np.arange(first, first + count, dtype=np.uint64)
            keys = vector_round_keys(seed, tweaks, rounds)
        return [key[rows] for key in keys], True
    if not isinstance(tweak, int) and int(tweak.min()) == int(tweak.max()):
        tweak = int(tweak[0])
    if isinstance(tweak, int):
        return [np.full(1, k, dtype=np.uint64) for k in round_keys(seed, tweak, rounds)], False
    # Rows often come as runs of one block each: keys per run, gathered per row.
    starts = np.flatnonzero(tweak[1:] != tweak[:-1]) + 1
    if (starts.size + 1) * 4 > tweak.size:
        return vector_round_keys(seed, tweak, rounds), True
    keys = vector_round_keys(seed, np.append(tweak[:1], tweak[starts]), rounds)
    run = np.repeat(np.arange(starts.size + 1), np.diff(starts, prepend=0, append=tweak.size))
    return [key[run] for key in keys], True


def permute_sized(index: U64Array, size: U64Array | int, seed: int, tweak: Tweak) -> U64Array:
    """``permute(index[i], size[i], seed, tweak[i])`` for every row, vectorized (an int
    ``size`` or ``tweak`` is the same for every row). Rows whose sizes share a Feistel
    domain go through one network with a per-row walk bound; otherwise (rare: the short
    block's size crosses a power of two) rows are grouped by size."""
    groups: list[tuple[int, int | U64Array, npt.NDArray[np.intp] | None]]
    if isinstance(size, int):
        groups = [(size, size, None)]
    else:
        lo, hi = int(size.min()), int(size.max())
        if lo == hi:
            groups = [(lo, lo, None)]
        elif domain_bits(lo) == domain_bits(hi):
            groups = [(hi, size, None)]
        else:
            groups = [(int(n), int(n), np.flatnonzero(size == n)) for n in np.unique(size)]
    out = index.copy() if groups[0][2] is None else np.zeros_like(index)
    for n, bound, sel in groups:
        if n == 1:
            out[sel if sel is not None else slice(None)] = 0  # one-window blocks
            continue
        x = out if sel is None else index[sel]
        tw: Tweak = tweak
        if sel is not None:
            if isinstance(tweak, tuple):
                tw = (tweak[0], tweak[1], tweak[2][sel])
            elif not isinstance(tweak, int):
                tw = tweak[sel]
        bits = domain_bits(n)
        keys, per_element = _tweak_keys(seed, tw, rounds_for(bits))
        encrypt(x, bound, bits, keys, per_element)
        if sel is not None:
            out[sel] = x
    return out
