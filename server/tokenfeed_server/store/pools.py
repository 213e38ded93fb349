"""Memory the server keeps between requests for speed, bounded in bytes (issue 28).

Two caches outlive a request: :class:`RowBuffers`, the token buffers rows are read into,
and :class:`WindowBlocks`, blocks of a stream's order computed once for many requests.
Clients choose what fills them (sequence lengths, batch sizes, seeds, mixtures), so each
counts every byte it holds, is capped in bytes (not in the number of shapes or keys seen:
a long-running server sees ever more of those), drops the least recently used entry to
stay under its cap, and gives back what no request used for a while
(:meth:`RowBuffers.release_idle`, :meth:`WindowBlocks.release_idle`), so a server whose
jobs have all ended shrinks back instead of keeping its busiest hour's memory forever.

Their sizes are :class:`~tokenfeed_server.config.MemorySettings`;
:mod:`tokenfeed_server.store.memory` reports them per owner.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from tokenfeed.plan import INT64_MAX

__all__ = [
    "DEFAULT_POOL_BYTES",
    "DEFAULT_WINDOW_BLOCK_BYTES",
    "Order",
    "RowBuffers",
    "WindowBlocks",
    "row_buffers",
    "window_blocks",
]

#: Bytes :class:`RowBuffers` keeps at most, buffers and their row views together (16
#: chunks of the default max_chunk_bytes).
DEFAULT_POOL_BYTES = 256 * 1024 * 1024
#: Bytes :class:`WindowBlocks` keeps at most (64 blocks of a mixture's four int64 arrays
#: of 8,192 positions).
# a plan's block of 8192 positions is 128 KiB: room for 512 jobs' current blocks (a
# server of 256 jobs with their own seeds recomputed a block per request at 16 MiB)
DEFAULT_WINDOW_BLOCK_BYTES = 64 * 1024 * 1024

# What one row's entry costs beyond the buffer: the 1-tuple and the memoryview slice in
# it (measured, not guessed: the sizes differ between Python versions).
_PROBE = memoryview(bytearray(1))
_VIEW_BYTES = sys.getsizeof((_PROBE,)) + sys.getsizeof(_PROBE[:1])
del _PROBE
# Row sizes whose views one pooled buffer keeps; the oldest goes first.
_ROW_SIZES = 4


class RowBuffers:
    """Reusable token buffers for the rows the data plane sends.

    Chunks leave with zero-copy sends, so ZeroMQ may still hold a buffer after the send
    returns. A buffer is lent as a fresh array over pooled memory; every view of it, and
    ZeroMQ's hold on it, keeps that array alive, so the memory is lent again only once the
    array is gone (tracked by a weak reference). Reuse spares the page faults of fresh
    allocations on every chunk, and :meth:`take_rows` the making of one view per row.

    Clients choose the sizes (sequence length, batch, chunk), so the pool is bounded in
    bytes: sizes are rounded up to power-of-two classes, at most ``per_size`` buffers are
    kept per class, and :attr:`held_bytes` (the buffers *and* the per-row views made over
    them, which for short rows outweigh the buffer) never exceeds ``max_bytes``: the least
    recently lent buffers are dropped to make room (one still lent lives on, unpooled,
    until its array is gone).
    """

    def __init__(self, per_size: int = 32, max_bytes: int = DEFAULT_POOL_BYTES) -> None:
        self.per_size = per_size
        self.max_bytes = max_bytes
        self._pools: dict[int, list[_Slot]] = {}  # class -> its slots
        self._lru: OrderedDict[_Slot, None] = OrderedDict()  # every slot, least recent first
        self._held = 0  # bytes of every slot: buffers and views
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        """Bytes the pool holds now, buffers and row views (never more than ``max_bytes``)."""
        return self._held

    #: The former name of :attr:`held_bytes`.
    pooled_bytes = held_bytes

    def __len__(self) -> int:
        """Buffers pooled now."""
        return len(self._lru)

    def take_rows(
        self, shape: tuple[int, int], dtype: np.dtype[Any]
    ) -> tuple[np.ndarray, list[tuple[memoryview]] | None]:
        """A C-contiguous array of ``shape`` and ``dtype`` whose content is undefined, and
        its rows as 1-tuples of memoryviews of its memory (what :meth:`Dataset.gather
        <tokenfeed_server.store.reader.Dataset.gather>` reads into), kept with the pooled
        buffer per row size; None for a buffer not pooled.

        The views hold the pooled memory, never the lent array, so they do not keep a
        buffer lent.
        """
        size = _size_class(shape[0] * shape[1] * dtype.itemsize)
        row = shape[1] * dtype.itemsize
        with self._lock:
            slot = self._free_slot(size)
            if slot is None:
                return np.empty(shape, dtype), None
            array = np.ndarray(shape, dtype, buffer=slot.memory)
            slot.lent = weakref.ref(array)
            slot.used = time.monotonic()
            self._lru.move_to_end(slot)
            rows = self._rows(slot, row, shape[0]) if row else None
            # the new views may push the pool over its cap: older buffers go first, and
            # this one (then lent unpooled) only if it alone is over the cap
            self._fit(keep=slot)
            return array, rows

    def release_idle(self, idle_s: float) -> int:
        """Drop the buffers not lent for ``idle_s`` seconds; the bytes given back."""
        cutoff = time.monotonic() - idle_s
        with self._lock:
            before = self._held
            for slot in list(self._lru):
                if slot.used > cutoff:
                    break  # the rest were lent more recently
                if slot.lent() is None:
                    self._drop(slot)
            return before - self._held

    def resize(self, max_bytes: int) -> None:
        """Set the cap, dropping the least recently lent buffers to fit it now."""
        with self._lock:
            self.max_bytes = max_bytes
            self._fit(keep=None)

    def clear(self) -> None:
        """Drop every buffer (those still lent live on until their arrays are gone)."""
        with self._lock:
            for slot in list(self._lru):
                self._drop(slot)

    def _free_slot(self, size: int) -> _Slot | None:
        """A pooled buffer of class ``size`` not lent now, made if there is room; None
        when the class has ``per_size`` buffers all lent or ``size`` cannot fit."""
        pool = self._pools.get(size)
        if pool is not None:
            for slot in pool:
                if slot.lent() is None:
                    return slot
            if len(pool) >= self.per_size:
                return None
        if size > self.max_bytes:
            return None  # (a buffer just under it is dropped again by _fit)
        slot = _Slot(bytearray(size))
        self._pools.setdefault(size, []).append(slot)
        self._lru[slot] = None
        self._held += slot.nbytes
        return slot

    def _rows(self, slot: _Slot, row: int, n: int) -> list[tuple[memoryview]]:
        """The first ``n`` row views of ``row`` bytes over ``slot``, made as needed."""
        rows = slot.rows.get(row)
        if rows is None:
            if len(slot.rows) >= _ROW_SIZES:
                oldest = next(iter(slot.rows))
                self._charge(slot, -_list_bytes(slot.rows.pop(oldest)))
            rows = slot.rows[row] = []
            self._charge(slot, _list_bytes(rows))
        if len(rows) < n:
            before = _list_bytes(rows)
            view = slot.view
            # only the rows asked for: a buffer's whole length in short rows would cost
            # several times the buffer itself in views
            rows.extend((view[a : a + row],) for a in range(len(rows) * row, n * row, row))
            self._charge(slot, _list_bytes(rows) - before)
        return rows[:n]

    def _charge(self, slot: _Slot, nbytes: int) -> None:
        slot.nbytes += nbytes
        if slot in self._lru:
            self._held += nbytes

    def _fit(self, keep: _Slot | None) -> None:
        """Drop least recently lent buffers until the pool fits its cap; ``keep`` goes
        last (and only if it alone is over the cap)."""
        for slot in list(self._lru):
            if self._held <= self.max_bytes:
                return
            if slot is not keep:
                self._drop(slot)
        if keep is not None and self._held > self.max_bytes:
            self._drop(keep)

    def _drop(self, slot: _Slot) -> None:
        del self._lru[slot]
        pool = self._pools[slot.size]
        pool.remove(slot)
        if not pool:
            del self._pools[slot.size]
        self._held -= slot.nbytes


def _list_bytes(rows: list[tuple[memoryview]]) -> int:
    """What a list of row views costs: the list and, per row, its tuple and view."""
    return sys.getsizeof(rows) + len(rows) * _VIEW_BYTES


def _size_class(nbytes: int) -> int:
    """The power of two at or above ``nbytes`` (at least 1)."""
    return 1 << max(nbytes - 1, 0).bit_length()


def _gone() -> None:
    return None


class _Slot:
    """One pooled buffer: its memory (and one view of it all, sliced into rows), a weak
    reference to the array lent over it, its rows' views by row size, the bytes all that
    holds, and when it was last lent (``time.monotonic``)."""

    __slots__ = ("lent", "memory", "nbytes", "rows", "size", "used", "view")

    def __init__(self, memory: bytearray) -> None:
        self.memory = memory
        self.size = len(memory)
        self.view = memoryview(memory)
        self.nbytes = sys.getsizeof(memory) + sys.getsizeof(self.view)
        self.lent: Callable[[], np.ndarray | None] = _gone
        self.rows: dict[int, list[tuple[memoryview]]] = {}
        self.used = 0.0


IntArray = npt.NDArray[np.int64]
# A block's arrays: a plan's window ids and epochs (or whatever an Order gives).
_Block = tuple[IntArray, ...]


class Order(Protocol):
    """What :class:`WindowBlocks` caches: a pure function of stream positions to arrays
    of the same length (a :class:`~tokenfeed.plan.Plan`: window ids and epochs; a
    mixture's whole order: source, window id, epoch and first token per row)."""

    @property
    def order_key(self) -> Hashable:
        """Everything :meth:`windows` depends on: equal keys give equal arrays."""
        ...

    def windows(self, positions: IntArray) -> tuple[IntArray, ...]:
        """The arrays for ``positions``."""
        ...


class _Entry:
    """One cached block: its arrays, the bytes they hold, when it was last used."""

    __slots__ = ("block", "nbytes", "used")

    def __init__(self, block: _Block, nbytes: int, used: float) -> None:
        self.block = block
        self.nbytes = nbytes
        self.used = used


class WindowBlocks:
    """The window ids of whole blocks of stream positions, computed once and shared.

    :meth:`Plan.windows <tokenfeed.plan.Plan.windows>` costs about as much for the 248
    rows of a chunk as for 8192 positions (numpy's per-call overhead, and cycle-walking
    passes until the last of the rows lands), so the server computes windows a block of
    :attr:`block` consecutive positions at a time and serves the next chunks from it:
    the same pure function of the position, evaluated in bigger batches, so the order is
    the plan's to the bit. Blocks are keyed by what the function depends on (the number
    of windows, the seed, the shuffle mode and sizes: :attr:`Plan.order_key`), so jobs
    with the same ones share them; the least recently used goes when there are
    ``max_blocks`` or they hold more than ``max_bytes`` (a mixture's block holds twice a
    plan's). A request whose rows are sparse in the positions they span (one rank of a
    large world, widely strided workers) is computed directly: a block would then mostly
    hold rows this server never sends. Any :class:`Order` is cached the same way (a
    mixture's, see :mod:`tokenfeed_server.store.mixing`).

    Thread-safe: a block is computed outside the lock (two threads asking for one missing
    block may both compute it; the later replaces the earlier, equal one), and held
    blocks are read-only. An order with a ``note_block()`` method is told of each block
    computed for it (a mixture counts where its blocks were computed).
    """

    def __init__(
        self, block: int = 8192, max_blocks: int = 1024, max_bytes: int = DEFAULT_WINDOW_BLOCK_BYTES
    ) -> None:
        self.block = block
        self.max_blocks = max_blocks
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[tuple[Hashable, int], _Entry] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Blocks held now."""
        return len(self._blocks)

    @property
    def held_bytes(self) -> int:
        """Bytes of the blocks held now (never more than ``max_bytes``)."""
        return self._held

    def windows(self, order: Order, positions: IntArray) -> tuple[IntArray, ...]:
        """``order.windows(positions)`` for sorted positions, from cached blocks if dense."""
        if positions.size == 0:
            return order.windows(positions)
        lo, hi = int(positions[0]), int(positions[-1])
        size = self.block
        first, last = lo // size, hi // size
        dense = positions.size * _DENSITY >= hi - lo + 1
        # a request may hold half the cache, at a plan block's 16 bytes a position
        span = min(self.max_blocks, self.max_bytes // (16 * size)) // 2
        if not dense or last - first >= span or (last + 1) * size > INT64_MAX:
            return order.windows(positions)
        base = first * size
        if first == last and hi - lo + 1 == positions.size:
            # One run of positions (the common case): views of the block, no copies.
            return tuple(part[lo - base : hi + 1 - base] for part in self._block(order, first))
        blocks = [self._block(order, b) for b in range(first, last + 1)]
        index = positions - base
        if len(blocks) == 1:
            return tuple(part[index] for part in blocks[0])
        return tuple(np.concatenate(parts)[index] for parts in zip(*blocks, strict=True))

    def cached(self, order: Order, b: int) -> bool:
        """True when block ``b`` (positions ``b*block`` onwards) of ``order`` is held now."""
        with self._lock:
            return (order.order_key, b) in self._blocks

    def fill(self, order: Order, b: int) -> None:
        """Compute block ``b`` of ``order`` now unless held, on the calling thread (a
        builder's: see :mod:`tokenfeed_server.store.mixture_tables`); any thread may call
        this and :meth:`windows` at once."""
        self._block(order, b)

    def release_idle(self, idle_s: float) -> int:
        """Drop the blocks no request used for ``idle_s`` seconds; the bytes given back."""
        cutoff = time.monotonic() - idle_s
        with self._lock:
            before = self._held
            while self._blocks:
                entry = next(iter(self._blocks.values()))
                if entry.used > cutoff:
                    break  # the rest were used more recently
                self._held -= self._blocks.popitem(last=False)[1].nbytes
            return before - self._held

    def resize(self, max_bytes: int) -> None:
        """Set the byte cap, dropping the least recently used blocks to fit it now."""
        with self._lock:
            self.max_bytes = max_bytes
            self._fit()

    def clear(self) -> None:
        """Drop every block."""
        with self._lock:
            self._blocks.clear()
            self._held = 0

    def _block(self, order: Order, b: int) -> _Block:
        key = (order.order_key, b)  # shuffle mode and sizes too: block/global never share
        now = time.monotonic()
        with self._lock:
            entry = self._blocks.get(key)
            if entry is not None:
                self._blocks.move_to_end(key)
                entry.used = now
                return entry.block
        size = self.block
        parts = order.windows(np.arange(b * size, (b + 1) * size, dtype=np.int64))
        # Owned arrays, so that the bytes counted are the bytes kept (a view would keep
        # its whole base alive, uncounted).
        block = tuple(part if part.base is None else part.copy() for part in parts)
        for part in block:
            part.flags.writeable = False  # shared by every job with this key
        note = getattr(order, "note_block", None)
        if note is not None:  # (outside our lock: the order counts under its own)
            note()
        nbytes = sum(sys.getsizeof(part) for part in block) + sys.getsizeof(block)
        with self._lock:
            old = self._blocks.pop(key, None)  # computed meanwhile by another thread
            if old is not None:
                self._held -= old.nbytes
            self._blocks[key] = _Entry(block, nbytes, now)
            self._held += nbytes
            self._fit()
        return block

    def _fit(self) -> None:
        while self._blocks and (len(self._blocks) > self.max_blocks or self._held > self.max_bytes):
            self._held -= self._blocks.popitem(last=False)[1].nbytes


# Rows per position spanned below which a request is computed directly (see WindowBlocks).
_DENSITY = 16

#: The pool every request's rows are read into (shared by single-dataset and mixed jobs).
row_buffers = RowBuffers()
#: The window blocks shared by every job (see :class:`WindowBlocks`).
window_blocks = WindowBlocks()
