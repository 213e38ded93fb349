"""A mixture's stream positions to ``(source, source position)``: the locate tables.

Locating a row
    For a stream position ``p`` in segment ``k`` (the last with ``start_k <= p``):
    ``off = p - start_k``, ``full, j = divmod(off, W_k)``, ``source = table_k[j]``, and the
    row's position in that source's own stream is
    ``base[k, source] + full*w[k, source] + rank_k[j]``, where ``base[k, s]`` is the rows
    source ``s`` received before ``start_k`` (computed once per segment from the previous
    one). So source positions of every source run ``0, 1, 2, ...`` over the whole stream,
    across segment boundaries, with nothing repeated or skipped: each source then walks
    its own :class:`~tokenfeed.plan.Plan` (seeded by
    :func:`~tokenfeed.mixture.source_seed`), which gives every window exactly once per
    *source* epoch; a small source with a large weight runs more epochs.
    :meth:`Mixture.locate <tokenfeed.mixture.Mixture.locate>` is vectorized numpy; memory
    is the tables (one period per distinct weight vector) and ``O(segments * sources)``,
    never the run's length. A source position never exceeds the stream position, so any
    position up to ``2**63 - 1`` is computed without overflow.
"""

from __future__ import annotations

import bisect

import numpy as np

from tokenfeed.order.ints import IntArray
from tokenfeed.order.swrr import period_table

__all__ = ["SegmentTables"]

#: A sorted block spanning at most this many segment boundaries is cut into pieces, one
#: per segment; beyond, every row searches its segment.
_SPLIT_SEGMENTS = 8


class SegmentTables:
    """What :meth:`Mixture.locate <tokenfeed.mixture.Mixture.locate>` needs for one
    mixture's names and reduced segments. A mixture builds it on first use (one that is
    only validated, compared or sent on the wire never builds a table)."""

    def __init__(self, names: tuple[str, ...], segments: tuple[tuple[int, tuple[int, ...]], ...]):
        n = len(names)
        self.start_list = [s for s, _ in segments]
        self.starts = np.array(self.start_list, dtype=np.int64)
        self.periods = np.array([sum(w) for _, w in segments], dtype=np.int64)
        self.weights = np.array([w for _, w in segments], dtype=np.int64).reshape(-1, n)
        # Per segment: source (global index) and rank per period offset, in one flat array
        # per kind so that rows of several segments gather in one call.
        offsets: list[int] = []
        sources: list[IntArray] = []
        ranks: list[IntArray] = []
        shared: dict[tuple[int, ...], int] = {}
        size = 0
        for _, w in segments:
            if w in shared:
                offsets.append(shared[w])
                continue
            active = [i for i, x in enumerate(w) if x]
            winners, rank = period_table(tuple(w[i] for i in active))
            sources.append(np.array(active, dtype=np.int64)[winners])
            ranks.append(rank)
            shared[w] = size
            offsets.append(size)
            size += len(winners)
        self.table_offsets = np.array(offsets, dtype=np.int64)
        self.source = np.concatenate(sources)
        self.rank = np.concatenate(ranks)
        # base[k, s]: rows source s received before segment k starts (exact Python ints;
        # they never exceed the start, so they fit int64).
        base: list[list[int]] = [[0] * n]
        for k in range(1, len(segments)):
            base.append(self._counts_in(k - 1, segments[k][0], base[k - 1]))
        self.base_rows = base
        self.base = np.array(base, dtype=np.int64).reshape(-1, n)

    def _counts_in(self, k: int, position: int, base: list[int]) -> list[int]:
        """Rows per source in ``[0, position)`` for ``position`` in segment ``k``."""
        full, j = divmod(position - int(self.starts[k]), int(self.periods[k]))
        first = int(self.table_offsets[k])
        partial = np.bincount(self.source[first : first + j], minlength=len(base))
        w = self.weights[k]
        return [base[s] + full * int(w[s]) + int(partial[s]) for s in range(len(base))]

    def counts(self, position: int) -> list[int]:
        """Rows each source received in stream positions ``[0, position)`` (exact)."""
        k = bisect.bisect_right(self.start_list, position) - 1
        return self._counts_in(k, position, self.base_rows[k])

    def locate(self, p: IntArray) -> tuple[IntArray, IntArray]:
        """``(source, source_position)`` of flat int64 positions in ``[0, 2**63 - 1]``."""
        if len(self.start_list) == 1:
            return self._in_segment(0, p)
        k_lo = bisect.bisect_right(self.start_list, int(p.min())) - 1
        k_hi = bisect.bisect_right(self.start_list, int(p.max())) - 1
        if k_lo == k_hi:  # the hot path: a block of rows inside one segment
            return self._in_segment(k_lo, p)
        if k_hi - k_lo <= _SPLIT_SEGMENTS and bool(np.all(p[1:] >= p[:-1])):
            # A block of increasing positions (a global batch) across a few boundaries:
            # cut it at the boundaries and take each piece on the hot path.
            src = np.empty_like(p)
            pos = np.empty_like(p)
            cuts = np.searchsorted(p, self.starts[k_lo + 1 : k_hi + 1]).tolist()
            for k, a, b in zip(range(k_lo, k_hi + 1), [0, *cuts], [*cuts, len(p)], strict=True):
                if a < b:
                    src[a:b], pos[a:b] = self._in_segment(k, p[a:b])
            return src, pos
        # Anything else: every row looks up its own segment, and per-(segment, source)
        # values are gathered through flat indices (2-D fancy indexing is much slower).
        seg = np.searchsorted(self.starts[k_lo + 1 : k_hi + 1], p, "right")
        if k_lo:
            seg += k_lo
        full, j = np.divmod(p - self.starts[seg], self.periods[seg])
        j += self.table_offsets[seg]
        src = self.source[j]
        flat = seg * np.int64(self.weights.shape[1])
        flat += src
        pos = self.weights.ravel()[flat]
        pos *= full
        pos += self.base.ravel()[flat]
        pos += self.rank[j]
        return src, pos

    def _in_segment(self, k: int, p: IntArray) -> tuple[IntArray, IntArray]:
        """locate() of positions that all lie in segment ``k``."""
        start = self.start_list[k]
        off = p - np.int64(start) if start else p
        full, j = np.divmod(off, np.int64(self.periods[k]))
        first = int(self.table_offsets[k])
        if first:
            j += np.int64(first)
        src = self.source[j]
        pos = self.weights[k][src]
        pos *= full
        pos += self.base[k][src]
        pos += self.rank[j]
        return src, pos
