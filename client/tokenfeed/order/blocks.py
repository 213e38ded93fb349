"""The block shuffle's layout: regions, blocks, and which window each position holds.

The ``W`` windows of an epoch are cut into *regions* of ``R = region_windows``
consecutive windows, region ``r`` = windows ``[r*R, min((r+1)*R, W))`` (``M = ceil(W/R)``
regions; only the last may be shorter); a region is about one shard of the store (see
:func:`default_block_sizes`). Each epoch:

- the regions are permuted: slot ``s`` of the epoch's region sequence holds a region
  drawn by a keyed permutation of ``(seed, epoch)``, domain-separated from every other
  key. The short last region sits at a slot ``S`` hashed from ``(seed, epoch)``; the
  other slots hold ``permute(s', M-1, ...)`` of the ``M - 1`` full regions (``s'`` =
  ``s`` with ``S`` skipped). Placing the one short region directly, instead of inverting
  the permutation to find it, keeps every block's size and first position O(1) to
  compute;
- the slots are grouped into *blocks* of ``K = block_regions`` consecutive slots
  (``ceil(M/K)`` blocks; the last may hold fewer regions). The epoch's positions go to
  the blocks in order: block ``b`` covers the local positions
  ``[b*K*R - d*[S//K < b], ...)`` for a block of ``K*R - d*[S//K == b]`` windows (``d`` =
  the short region's missing windows), so a position's block is O(1);
- inside a block, the positions are a keyed permutation (key from the seed and the
  block's serial number in the stream, ``epoch * blocks + b``) of the block's windows
  taken across all its regions, so consecutive rows mix ``K`` regions.

Cost: one keyed permutation per row as in the global shuffle, plus a region lookup in
small per-block tables (a bounded LRU cache of a few MiB at most, whatever the dataset's
size or the epoch): ``benchmarks/bench_block_shuffle.py`` measures the block shuffle at
0.9-1.1x the global one's rate with the default sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Final

import numpy as np

from tokenfeed.errors import PlanError
from tokenfeed.order.feistel import permute_checked
from tokenfeed.order.ints import INT64_MAX, IntArray, U64Array, check_int
from tokenfeed.order.sized import CACHE_SLOTS, permute_sized
from tokenfeed.order.splitmix import splitmix64

__all__ = [
    "DEFAULT_BLOCK_REGIONS",
    "TAG_BLOCK",
    "TAG_REGIONS",
    "TAG_SHORT",
    "BlockInfo",
    "BlockLayout",
    "default_block_sizes",
]

#: Regions per block when the trainer leaves ``block_regions`` at 0.
DEFAULT_BLOCK_REGIONS: Final = 4

# Domain separation of the block shuffle's keys (ASCII tags, xored into the seed before it
# is mixed), so the region order, the short region's slot and the in-block orders are
# independent of each other and of the global shuffle's keys for the same seed.
TAG_REGIONS: Final = 0x7466_2E72_6567_696F  # "tf.regio"
TAG_SHORT: Final = 0x7466_2E73_686F_7274  # "tf.short"
TAG_BLOCK: Final = 0x7466_2E62_6C6F_636B  # "tf.block"

# A call's blocks are described by small per-block tables (gathered per row) when they
# hold at most this many region slots, or a quarter of the rows if that is more.
_TABLE_SLOTS = 256
# Region slots a cached table describes at least (see BlockLayout.windows).
_TABLE_BATCH = 2048


@dataclass(frozen=True)
class BlockInfo:
    """Per block (one row per block serial ``epoch * nb + b``): its window count, the
    in-block index where the short region ends (past every index if the block has no
    short region), its first region slot, its epoch and the epoch's short-region slot."""

    size: U64Array
    short_end: U64Array
    first_slot: U64Array
    epoch: U64Array
    short: U64Array


@dataclass(frozen=True)
class BlockLayout:
    """The block shuffle's sizes and keys for one (W, R, K, seed); see the module docstring.

    Per-row arithmetic is uint64: a position's offset plus the short region's deficit may
    exceed int64 when W is near 2**63.
    """

    w: int  # windows
    r: int  # windows per region, at most w
    m: int  # regions, ceil(w / r)
    last: int  # windows of the last region (1..r)
    d: int  # r - last: windows the short region lacks
    k: int  # regions per block, at most m
    kr: int  # k * r: windows of a full block
    nb: int  # blocks per epoch, ceil(m / k)
    seed_regions: int
    seed_short: int
    seed_block: int

    @staticmethod
    def of(w: int, region_windows: int, block_regions: int, seed: int) -> BlockLayout:
        r = max(1, min(region_windows, w))
        m = -(-w // r)
        last = w - (m - 1) * r
        k = max(1, min(block_regions, m))
        return BlockLayout(
            w=w,
            r=r,
            m=m,
            last=last,
            d=r - last,
            k=k,
            kr=k * r,
            nb=-(-m // k),
            seed_regions=splitmix64(seed ^ TAG_REGIONS),
            seed_short=splitmix64(seed ^ TAG_SHORT),
            seed_block=splitmix64(seed ^ TAG_BLOCK),
        )

    def short_slot(self, epochs: U64Array) -> U64Array:
        """The slot of the short (last) region in each epoch's region sequence."""
        slot: U64Array = splitmix64(np.uint64(self.seed_short) ^ epochs) % np.uint64(self.m)
        return slot

    def short_slot_of(self, epoch: int) -> int:
        """:meth:`short_slot` of one epoch (same bits: splitmix64 is exact on ints)."""
        return splitmix64(self.seed_short ^ epoch) % self.m

    def shift(self, local: U64Array, short: U64Array | int) -> None:
        """Add the short region's deficit ``d``, in place, to the epoch-local positions
        after the block holding the short region: then block ``b`` starts at ``b*K*R``."""
        if not self.d:
            return
        k, m, r = self.k, self.m, self.r
        end: U64Array | int
        if isinstance(short, int):
            sb = short // k
            end = sb * self.kr + min(k, m - sb * k) * r - self.d
        else:
            sb_first = short // np.uint64(k) * np.uint64(k)
            regions = np.minimum(np.uint64(k), np.uint64(m) - sb_first)
            end = sb_first * np.uint64(r) + regions * np.uint64(r) - np.uint64(self.d)
        local += (local >= end) * np.uint64(self.d)  # (a masked np.add is slower)

    def block_info(self, serial: U64Array) -> BlockInfo:
        """The :class:`BlockInfo` of blocks ``serial`` (``epoch * nb + b``), vectorized."""
        u = np.uint64
        k = u(self.k)
        epoch = serial // u(self.nb)
        first = (serial - epoch * u(self.nb)) * k
        short = self.short_slot(epoch)
        size = np.minimum(k, u(self.m) - first) * u(self.r)
        in_block = (short >= first) & (short < first + k)
        short_index = np.where(in_block, short, first + k) - first
        if self.d:
            size[in_block] -= u(self.d)
        short_end = short_index * u(self.r) + u(self.last)
        return BlockInfo(size, short_end, first, epoch, short)

    def regions_at(self, slots: U64Array, short: U64Array, epochs: U64Array) -> U64Array:
        """The region in slot ``slots`` of epoch ``epochs`` (the short one at ``short``)."""
        if self.m == 1:
            return np.zeros_like(slots)
        is_short = slots == short
        # Skip the short region's slot; the short slot itself gets a dummy in-range index.
        index = np.where(slots > short, slots - np.uint64(1), slots)
        index[is_short] = 0
        full = permute_checked(index, self.m - 1, self.seed_regions, epochs.astype(np.int64))
        regions: U64Array = np.where(is_short, np.uint64(self.m - 1), full.astype(np.uint64))
        return regions

    def windows(self, local: IntArray, epochs: IntArray) -> IntArray:
        """Window ids of epoch-local positions ``local`` of epochs ``epochs`` (int64)."""
        shape = local.shape
        if local.size == 0:
            return np.zeros(shape, dtype=np.int64)
        u = np.uint64
        loc = local.reshape(-1).astype(np.uint64)  # a copy: shifted in place
        ep = epochs.reshape(-1)
        e0, e1 = int(ep.min()), int(ep.max())
        epu = ep.astype(np.uint64)
        self.shift(loc, self.short_slot_of(e0) if e0 == e1 else self.short_slot(epu))
        block = loc // u(self.kr)
        offset = loc - block * u(self.kr)
        # The block's serial number in the stream keys its order: unique per (epoch,
        # block), below (epoch + 1) * W <= 2**64, and consecutive across epochs.
        serial = epu * u(self.nb) + block
        s0, s1 = int(serial.min()), int(serial.max())
        n_blocks = s1 - s0 + 1
        if n_blocks * self.k > max(_TABLE_SLOTS, loc.size // 4):
            # Rows from many blocks (scattered positions, tiny blocks): everything per row.
            regions, off = self._regions_per_row(offset, serial)
        else:
            regions, off = self._regions_from_tables(offset, serial, s0, n_blocks)
        ids: IntArray = (regions * u(self.r) + off).astype(np.int64).reshape(shape)
        return ids

    def _split(self, j: U64Array, short_end: U64Array | np.uint64) -> tuple[U64Array, U64Array]:
        """In-block indices ``j`` to ``(slot within the block, window within its region)``.

        ``j`` counts the block's windows without the short region's missing ones; adding
        ``d`` past the short region's end (in place) makes every region ``R`` long.
        """
        r = np.uint64(self.r)
        if self.d:
            j += (j >= short_end) * np.uint64(self.d)
        within: U64Array = j // r  # (np.divmod is ~15x slower than // and -)
        return within, j - within * r

    def _regions_per_row(self, offset: U64Array, serial: U64Array) -> tuple[U64Array, U64Array]:
        """``(region, window within it)`` of every row, each row's block computed alone."""
        info = self.block_info(serial)
        j = permute_sized(offset, info.size, self.seed_block, serial)
        within, off = self._split(j, info.short_end)
        return self.regions_at(info.first_slot + within, info.short, info.epoch), off

    def _regions_from_tables(
        self, offset: U64Array, serial: U64Array, s0: int, n_blocks: int
    ) -> tuple[U64Array, U64Array]:
        """:meth:`_regions_per_row` for rows of ``n_blocks`` consecutive blocks from serial
        ``s0`` (the common case): the blocks are described in small tables (the regions of
        their K slots each), gathered per row."""
        # Tables of 2S blocks from a multiple of S, S >= 2 * n_blocks a power of two: they
        # cover this call, and the next calls find theirs cached. At least _TABLE_BATCH
        # slots (or as many as rows): a table's cost is mostly fixed (numpy calls, walks),
        # and a small call should not pay for a big one.
        span = 2 << (n_blocks - 1).bit_length()
        while span * self.k < min(_TABLE_BATCH, offset.size):
            span *= 2
        # No uint64 overflow: a serial is at most its position + 1 <= 2**63.
        base = s0 // span * span
        tables = _block_tables if 2 * span * self.k <= CACHE_SLOTS else _make_block_tables
        info, table = tables(self, base, 2 * span)
        if n_blocks == 1:
            i = s0 - base
            j = permute_sized(offset, int(info.size[i]), self.seed_block, s0)
            within, off = self._split(j, info.short_end[i])
            return table[within.astype(np.intp) + i * self.k], off  # (intp: 3x faster)
        row = (serial - np.uint64(base)).astype(np.intp)
        tweak = (base, 2 * span, row)  # the block serials, as table rows
        j = permute_sized(offset, info.size[row], self.seed_block, tweak)
        within, off = self._split(j, info.short_end[row])
        return table[row * self.k + within.astype(np.intp)], off

    def block_serial(self, position: int) -> int:
        """The serial number (``epoch * nb + b``) of the block holding ``position``."""
        epoch, local = divmod(position, self.w)
        if self.d:  # as shift(), on ints
            sb = self.short_slot_of(epoch) // self.k
            if local >= sb * self.kr + min(self.k, self.m - sb * self.k) * self.r - self.d:
                local += self.d
        return epoch * self.nb + local // self.kr

    def block_spans(self, seq_len: int, position: int, blocks: int) -> list[tuple[int, int]]:
        """:meth:`Plan.block_spans` in block mode."""
        if self.nb == 1 or blocks > 2 * self.nb:
            # One block per epoch, or a whole epoch in range: every window.
            return [(0, self.w * seq_len + 1)]
        first = self.block_serial(position)
        # Serials past the stream's end (2**63 - 1) hold no position: leave them out.
        last = min(first + blocks - 1, (INT64_MAX // self.w + 1) * self.nb - 1)
        return list(_block_spans(self, seq_len, first, last))


@lru_cache(maxsize=64)
def _block_spans(
    layout: BlockLayout, seq_len: int, first: int, last: int
) -> tuple[tuple[int, int], ...]:
    """Merged token spans of the regions of block serials ``[first, last]``. Cached: a
    prefetcher asks again and again while a job is inside the same block."""
    info = layout.block_info(np.arange(first, last + 1, dtype=np.uint64))
    slots = info.first_slot[:, None] + np.arange(layout.k, dtype=np.uint64)[None, :]
    valid = slots < np.uint64(layout.m)
    n = slots.shape[1]
    regions = np.unique(
        layout.regions_at(
            slots[valid],
            np.repeat(info.short, n).reshape(slots.shape)[valid],
            np.repeat(info.epoch, n).reshape(slots.shape)[valid],
        )
    )
    first_window = regions * np.uint64(layout.r)
    length = np.where(regions == np.uint64(layout.m - 1), layout.last, layout.r)
    starts = (first_window * np.uint64(seq_len)).tolist()
    stops = ((first_window + length.astype(np.uint64)) * np.uint64(seq_len) + np.uint64(1)).tolist()
    spans: list[tuple[int, int]] = []
    for start, stop in zip(starts, stops, strict=True):  # sorted by region, hence by start
        if spans and start <= spans[-1][1]:  # neighbours share a token: merge
            spans[-1] = (spans[-1][0], max(spans[-1][1], stop))
        else:
            spans.append((start, stop))
    return tuple(spans)


def _make_block_tables(layout: BlockLayout, first: int, count: int) -> tuple[BlockInfo, U64Array]:
    """The :class:`BlockInfo` of block serials ``[first, first + count)`` and the regions
    of their ``K`` slots each (row-major; a short last block's spare slots repeat region
    ``M - 1``, never read)."""
    info = layout.block_info(np.arange(first, first + count, dtype=np.uint64))
    k = layout.k
    slots = info.first_slot[:, None] + np.arange(k, dtype=np.uint64)[None, :]
    np.minimum(slots, np.uint64(layout.m - 1), out=slots)
    table = layout.regions_at(slots.reshape(-1), np.repeat(info.short, k), np.repeat(info.epoch, k))
    for part in (table, info.size, info.short_end, info.first_slot, info.epoch, info.short):
        part.flags.writeable = False  # shared by every caller of the cache
    return info, table


#: :func:`_make_block_tables`, cached (tables of at most CACHE_SLOTS slots): consecutive
#: calls mostly fall in the same blocks, and a table is most of a small call's fixed cost.
_block_tables = lru_cache(maxsize=16)(_make_block_tables)


def default_block_sizes(shard_tokens: Sequence[int], seq_len: int) -> tuple[int, int]:
    """``(region_windows, block_regions)`` for a dataset whose shards hold ``shard_tokens``
    tokens each, when the trainer leaves them at 0: a region is about one shard's windows
    (the largest shard's, i.e. the size the writer cuts at, so a region spans one or two
    shards), a block :data:`DEFAULT_BLOCK_REGIONS` regions, or all of them when there are
    fewer. Pure: the same store and ``seq_len`` give the same sizes on every server,
    whatever its cache size.
    """
    seq_len = check_int("seq_len", seq_len, 1, INT64_MAX)
    tokens = [check_int(f"shard_tokens[{i}]", t, 0, INT64_MAX) for i, t in enumerate(shard_tokens)]
    total = sum(tokens)
    if total < seq_len + 1:
        raise PlanError(
            f"the dataset's shards hold {total} tokens, fewer than one window of "
            f"seq_len + 1 = {seq_len + 1}; use a shorter seq_len or a larger dataset"
        )
    n_windows = (total - 1) // seq_len
    region = min(n_windows, max(1, max(tokens) // seq_len))
    regions = -(-n_windows // region)
    return region, min(DEFAULT_BLOCK_REGIONS, regions)
