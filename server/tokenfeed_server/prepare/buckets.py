"""The local engine's scratch buckets: documents scattered to disk by their key's top
bits, then gathered back one bucket at a time in key order.

A bucket larger than its share of the memory budget is split on disk by the next key
bits first (recursively), so memory stays bounded by ``PrepareConfig.memory_mb`` and
never by the corpus; the output order does not depend on how buckets were split.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tokenfeed_server.prepare.config import PrepareConfig, PrepareStats
from tokenfeed_server.store.writer import DatasetWriter

__all__ = ["Buckets", "bucket_bits", "gather_bucket"]

_MAX_BUCKET_BITS = 12
_SPLIT_BITS = 4
# A bucket's index: per document its length, key, file rank and record number.
_IDX_COLUMNS = 4
_IDX_BYTES = 8 * _IDX_COLUMNS


class Buckets:
    """Documents scattered into ``n = 2**bits`` bucket files by bits of their key.

    Bucket ``b`` is ``b<b>.tok`` (tokens back to back) and ``b<b>.idx`` (per document:
    uint64 length, key, file rank, record). ``shift`` selects which key bits pick the
    bucket; documents with equal keys share a bucket, so each sorts completely on its own.
    """

    def __init__(
        self, directory: Path, bits: int, shift: int, dtype: np.dtype[Any], flush_bytes: int
    ) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.n = 1 << bits
        self.shift = np.uint64(shift)
        self.mask = np.uint64(self.n - 1)
        self.dtype = dtype
        self.flush_bytes = flush_bytes
        self._tok: list[list[np.ndarray]] = [[] for _ in range(self.n)]
        self._idx: list[list[np.ndarray]] = [[] for _ in range(self.n)]
        self._buffered = 0

    def paths(self, b: int) -> tuple[Path, Path]:
        """The token file and the index file of bucket ``b``."""
        return self.dir / f"b{b}.tok", self.dir / f"b{b}.idx"

    def add(self, tokens: np.ndarray, lengths: np.ndarray, ids: np.ndarray) -> None:
        """Add documents; ``ids`` is their (key, file rank, record) rows, uint64."""
        keys = ids[:, 0]
        if self.n == 1:
            which = np.zeros(len(lengths), dtype=np.uint16)
        else:
            which = ((keys >> self.shift) & self.mask).astype(np.uint16)
        # Group by bucket keeping input order inside each (stable radix sort on uint16).
        doc_order = np.argsort(which, kind="stable")
        tok_order = np.argsort(np.repeat(which, lengths), kind="stable")
        doc_counts = np.bincount(which, minlength=self.n)
        tok_counts = np.bincount(which, weights=lengths, minlength=self.n).astype(np.int64)
        idx = np.column_stack([lengths.astype(np.uint64), ids])[doc_order]
        grouped = tokens[tok_order]
        d = t = 0
        for b in np.flatnonzero(doc_counts).tolist():
            nd, nt = int(doc_counts[b]), int(tok_counts[b])
            self._idx[b].append(idx[d : d + nd])
            self._tok[b].append(grouped[t : t + nt])
            d += nd
            t += nt
        self._buffered += grouped.nbytes + idx.nbytes
        if self._buffered >= self.flush_bytes:
            self.flush()

    def flush(self) -> None:
        """Append the buffered documents to their bucket files."""
        for b in range(self.n):
            if not self._idx[b]:
                continue
            tok_path, idx_path = self.paths(b)
            with tok_path.open("ab") as f:
                for arr in self._tok[b]:
                    f.write(arr.data.cast("B"))
            with idx_path.open("ab") as f:
                for arr in self._idx[b]:
                    f.write(np.ascontiguousarray(arr).data.cast("B"))
            self._tok[b].clear()
            self._idx[b].clear()
        self._buffered = 0


def bucket_bits(estimated_bytes: int, bucket_bytes: int) -> int:
    """Key bits that pick a bucket, so a bucket is about ``bucket_bytes`` (at most 12)."""
    if estimated_bytes <= bucket_bytes:
        return 0
    return min(_MAX_BUCKET_BITS, math.ceil(math.log2(estimated_bytes / bucket_bytes)))


def gather_bucket(
    buckets: Buckets,
    b: int,
    *,
    writer: DatasetWriter,
    config: PrepareConfig,
    stats: PrepareStats,
    depth_bits: int,
) -> None:
    """Write bucket ``b`` sorted by key; split it first if it exceeds its memory share."""
    tok_path, idx_path = buckets.paths(b)
    if not idx_path.exists():
        return
    size = tok_path.stat().st_size + idx_path.stat().st_size
    n_docs = idx_path.stat().st_size // _IDX_BYTES
    if size > config.memory_bytes // 4 and n_docs > 1 and depth_bits < 64:
        bits = min(_SPLIT_BITS, 64 - depth_bits)
        sub = _split(buckets, b, bits, config=config, depth_bits=depth_bits)
        stats.bucket_splits += 1
        for s in range(sub.n):
            gather_bucket(
                sub, s, writer=writer, config=config, stats=stats, depth_bits=depth_bits + bits
            )
        shutil.rmtree(sub.dir, ignore_errors=True)
        return
    stats.peak_bucket_bytes = max(stats.peak_bucket_bytes, size)
    _write_sorted(tok_path, idx_path, buckets.dtype, writer, config)


def _split(
    buckets: Buckets, b: int, bits: int, *, config: PrepareConfig, depth_bits: int
) -> Buckets:
    """Scatter bucket ``b`` into ``2**bits`` sub-buckets by its next key bits; remove it."""
    tok_path, idx_path = buckets.paths(b)
    limit = config.memory_bytes // 4
    sub = Buckets(
        tok_path.parent / f"split-{b}",
        bits,
        64 - depth_bits - bits,
        buckets.dtype,
        flush_bytes=limit,
    )
    for tokens, lengths, ids in _iter_pieces(tok_path, idx_path, buckets.dtype, limit // 2):
        sub.add(tokens, lengths, ids)
    sub.flush()
    tok_path.unlink()
    idx_path.unlink()
    return sub


def _write_sorted(
    tok_path: Path,
    idx_path: Path,
    dtype: np.dtype[Any],
    writer: DatasetWriter,
    config: PrepareConfig,
) -> None:
    """Load one bucket, sort its documents by key and hand them to the writer; remove it."""
    idx = np.fromfile(idx_path, dtype=np.uint64).reshape(-1, _IDX_COLUMNS)
    tokens = np.fromfile(tok_path, dtype=dtype)
    lengths = idx[:, 0].astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    # (key, file rank, record): unique, so the order is the same however docs arrived.
    order = np.lexsort((idx[:, 3], idx[:, 2], idx[:, 1])).tolist()
    del idx
    # Emit in pieces so the copy in sorted order never holds a second whole bucket.
    piece_tokens = max(1, config.memory_bytes // (16 * dtype.itemsize))
    parts: list[np.ndarray] = []
    part_lengths: list[int] = []
    held = 0
    for d in order:
        a, z = offsets[d], offsets[d + 1]
        parts.append(tokens[a:z])
        part_lengths.append(z - a)
        held += z - a
        if held >= piece_tokens:
            writer.add_batch(np.concatenate(parts), np.asarray(part_lengths, dtype=np.int64))
            parts, part_lengths, held = [], [], 0
    if parts:
        writer.add_batch(np.concatenate(parts), np.asarray(part_lengths, dtype=np.int64))
    tok_path.unlink()
    idx_path.unlink()


def _iter_pieces(
    tok_path: Path, idx_path: Path, dtype: np.dtype[Any], max_bytes: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Stream a bucket as (tokens, lengths, ids) pieces of about ``max_bytes``."""
    docs_per_read = max(1, max_bytes // _IDX_BYTES)
    with tok_path.open("rb") as tok_f, idx_path.open("rb") as idx_f:
        while True:
            idx = np.fromfile(idx_f, dtype=np.uint64, count=_IDX_COLUMNS * docs_per_read)
            idx = idx.reshape(-1, _IDX_COLUMNS)
            if len(idx) == 0:
                return
            lengths = idx[:, 0].astype(np.int64)
            ends = np.cumsum(lengths) * dtype.itemsize
            start = 0
            while start < len(idx):
                base = int(ends[start - 1]) if start else 0
                stop = int(np.searchsorted(ends, base + max_bytes, side="right"))
                stop = max(stop, start + 1)
                count = int(lengths[start:stop].sum())
                tokens = np.fromfile(tok_f, dtype=dtype, count=count)
                yield tokens, lengths[start:stop], idx[start:stop, 1:]
                start = stop
