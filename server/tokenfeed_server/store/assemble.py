"""One request's rows: the job's stream positions, their windows, their tokens."""

from __future__ import annotations

import numpy as np

from tokenfeed.plan import Plan
from tokenfeed_server.store.pools import row_buffers, window_blocks
from tokenfeed_server.store.reader import Dataset

__all__ = ["assemble"]


def assemble(
    ds: Dataset,
    plan: Plan,
    rank: int,
    pos: int,
    *,
    count: int,
    stride: int,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of one request: tokens ``[count*B, L+1]``, window ids and epochs ``[count*B]``.

    The tokens are read into ``out`` when given, else a pooled buffer (see
    :class:`RowBuffers`); a shard that cannot be read raises CorruptShard naming the
    dataset.
    """
    positions = plan.rank_positions(rank, pos, count, stride)  # sorted, as blocks need
    window_ids, epochs = window_blocks.windows(plan, positions)
    rows = None
    if out is None:
        out, rows = row_buffers.take_rows((len(window_ids), plan.seq_len + 1), ds.dtype)
    tokens = ds.gather(plan.token_starts(window_ids), plan.seq_len + 1, out=out, rows=rows)
    return tokens, window_ids, epochs
