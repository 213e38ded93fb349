"""The frames of a ``chunk``: tokens and named provenance rows, sent and read zero-copy.

Token data never goes inside msgpack: after the header come the tokens ``[rows, cols]``
in the store's little-endian dtype, then one int64 row per provenance name.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tokenfeed.dtypes import DTYPES
from tokenfeed.errors import ProtocolError
from tokenfeed.protocol.bounds import MAX_PROVENANCE_ROWS
from tokenfeed.protocol.messages import Chunk


def chunk_frames(
    req: int,
    tokens: np.ndarray,
    provenance: Mapping[str, np.ndarray],
    ring: tuple[int, int] | None = None,
) -> list[Any]:
    """The frames of a ``chunk``: header, tokens, provenance rows; sent zero-copy.

    ``provenance`` maps row names (:data:`ROW_WINDOW`, :data:`ROW_EPOCH`, ...) to one
    integer per token row. ``ring``: the tokens were put in the connection's
    shared-memory ring at ``(offset, end)`` (see "Rings"): the token frame is empty.
    """
    names = tuple(provenance)
    offset, end = ring or (0, 0)
    header = Chunk(
        req=req,
        rows=tokens.shape[0],
        cols=tokens.shape[1],
        dtype=_wire_dtype_name(tokens.dtype),
        provenance=names,
        ring_offset=offset,
        ring_end=end,
    ).header()
    # One preallocated frame filled row by row: np.stack + astype cost twice as much on
    # the server's per-chunk path (benchmarks/bench_loaders.py).
    rows = np.empty((len(names), tokens.shape[0]), dtype="<i8")
    for i, name in enumerate(names):
        rows[i] = provenance[name]
    return [header, b"" if ring else np.ascontiguousarray(tokens), rows]


@functools.lru_cache(maxsize=8)
def _wire_dtype_name(dtype: np.dtype[Any]) -> str:
    # newbyteorder() runs slow Python code; a store has one dtype, so look it up once.
    name: str = dtype.newbyteorder("<").name
    return name


def decode_chunk(header: Chunk, frames: Sequence[Any]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Wrap a chunk's payload frames (zero-copy) as ``(tokens, {row name: int64 array})``.

    Callers take the rows they know (:data:`ROW_WINDOW`, :data:`ROW_EPOCH`) and ignore
    the others; :func:`require_rows` names the ones that must be there.
    """
    if len(frames) != 2:
        raise ProtocolError(f"chunk must carry 2 payload frames, got {len(frames)}")
    dtype = DTYPES.get(header.dtype)
    if dtype is None:
        raise ProtocolError(f"chunk dtype {header.dtype!r} is not one of {sorted(DTYPES)}")
    names = header.provenance
    if len(names) > MAX_PROVENANCE_ROWS or len(set(names)) != len(names):
        raise ProtocolError(
            f"chunk provenance names must be distinct and at most {MAX_PROVENANCE_ROWS}, "
            f"got {list(names)}"
        )
    tokens_buf, meta_buf = (memoryview(f) for f in frames)
    if tokens_buf.nbytes != header.rows * header.cols * dtype.itemsize:
        raise ProtocolError(
            f"chunk token frame has {tokens_buf.nbytes} bytes, header says "
            f"{header.rows}x{header.cols} {header.dtype}"
        )
    if meta_buf.nbytes != len(names) * header.rows * 8:
        raise ProtocolError(
            f"chunk provenance frame has {meta_buf.nbytes} bytes, expected "
            f"{len(names) * header.rows * 8} ({len(names)} rows of {header.rows} int64)"
        )
    tokens = np.frombuffer(tokens_buf, dtype=dtype).reshape(header.rows, header.cols)
    meta = np.frombuffer(meta_buf, dtype="<i8").reshape(len(names), header.rows)
    return tokens, dict(zip(names, meta, strict=True))


def require_rows(rows: Mapping[str, np.ndarray], *names: str) -> list[np.ndarray]:
    """The provenance rows ``names`` in that order; ProtocolError naming any missing."""
    missing = [n for n in names if n not in rows]
    if missing:
        raise ProtocolError(
            f"chunk lacks provenance rows {missing} (has {sorted(rows)}); "
            "install matching versions of tokenfeed and tokenfeed-server"
        )
    return [rows[n] for n in names]
