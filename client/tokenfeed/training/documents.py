"""Document boundaries inside packed rows, for attention that must not cross documents.

A row is a window of the token stream, so it usually holds the end of one document, a
few whole ones and the start of another. Every document ends with EOS (``prepare``
guarantees it), so the boundaries follow from the tokens alone: a document starts at
column 0 and right after every EOS. Pure numpy, vectorized over the batch.
"""

from __future__ import annotations

import numpy as np


def document_fields(input_ids: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``position_ids`` ``[B, L]`` (int64) and ``cu_seqlens`` ``[n + 1]`` (int32).

    ``position_ids`` count from 0 at every document start within each row (what Hugging
    Face models take to keep packed documents apart). ``cu_seqlens`` are the cumulative
    lengths of the ``n`` document pieces of the flattened batch, each row boundary also
    cutting, as variable-length attention kernels (flash-attn ``varlen``) take them.
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq_len], got shape {input_ids.shape}")
    rows, length = input_ids.shape
    starts = np.zeros((rows, length), dtype=bool)
    starts[:, 0] = True
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    columns = np.broadcast_to(np.arange(length, dtype=np.int64), (rows, length))
    last_start = np.maximum.accumulate(np.where(starts, columns, 0), axis=1)
    cu_seqlens = np.append(np.flatnonzero(starts.ravel()), rows * length).astype(np.int32)
    return columns - last_start, cu_seqlens
