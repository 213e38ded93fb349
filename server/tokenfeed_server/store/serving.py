"""The serving Store: the datasets of one directory, opened once and shared by every job.

A dataset is validated when first opened (see
:func:`~tokenfeed_server.store.reader.open_dataset`); it is then shared by all jobs, so
the page cache holds one copy whatever the number of trainers.

The data plane's loop thread never touches the file system to look a dataset up: a
watcher thread rescans the store every ``scan_interval_s`` and (re)opens what changed,
and :meth:`Store.get` only reads the result. A dataset that appears is served from the
next scan on; one replaced on disk (``prepare --overwrite``, noticed by the identity of
its manifest file) is reopened for new jobs, while running jobs keep the old files and
their clients see the fingerprint change when they reconnect; one removed is no longer
found.

A store in object storage (``s3://BUCKET/PREFIX``) works the same way: the watcher lists
``PREFIX/*/manifest.json`` every ``scan_interval_s`` (a replaced manifest has a new ETag)
and opens :class:`~tokenfeed_server.store.remote.RemoteDataset` objects, which read
verified pieces through the server's :class:`~tokenfeed_server.store.cache.PieceCache`.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from tokenfeed.errors import DatasetNotFound, StoreError
from tokenfeed.plan import INT64_MAX, Plan
from tokenfeed_server.logbudget import LogBudget
from tokenfeed_server.store.format import MANIFEST_NAME
from tokenfeed_server.store.local import list_datasets, open_dataset
from tokenfeed_server.store.objects import ObjectStoreError, S3Location
from tokenfeed_server.store.reader import Dataset, validate_dataset_name
from tokenfeed_server.store.remote import list_remote_datasets, open_remote_dataset

if TYPE_CHECKING:
    from tokenfeed_server.store.cache import PieceCache
    from tokenfeed_server.store.objects import ObjectStore

log = logging.getLogger(__name__)

#: Seconds between two scans of the store directory by the watcher.
DEFAULT_SCAN_INTERVAL_S = 0.5

# The identity of a manifest file: a dataset published again gets a new inode (local),
# a new ETag (object storage).
_Signature = tuple[object, ...]


@dataclass(frozen=True)
class _Listing:
    """One dataset as the last scan found it: opened, or the error that stops it."""

    signature: _Signature
    dataset: Dataset | None
    error: StoreError | None


class Store:
    """The datasets of one store directory, by name, kept current by a watcher thread.

    :meth:`open_all` opens every dataset and starts the watcher; :meth:`close` stops it.
    """

    def __init__(
        self,
        root: Path | S3Location,
        *,
        verify_checksums: bool = False,
        scan_interval_s: float = DEFAULT_SCAN_INTERVAL_S,
        objects: ObjectStore | None = None,
        cache: PieceCache | None = None,
    ) -> None:
        if scan_interval_s <= 0:
            raise ValueError(f"scan_interval_s must be > 0, got {scan_interval_s}")
        if isinstance(root, S3Location) and (objects is None or cache is None):
            raise ValueError("a store in object storage needs its ObjectStore and a PieceCache")
        self.root = root
        #: For a store in object storage: its objects, and the cache its datasets read from.
        self.objects = objects if isinstance(root, S3Location) else None
        self.cache = cache if isinstance(root, S3Location) else None
        self.verify_checksums = verify_checksums
        self.scan_interval_s = scan_interval_s
        # Replaced whole by the watcher, never mutated: readers need no lock.
        self._entries: dict[str, _Listing] = {}
        self._scans = threading.Condition()
        self._started = 0  # scans begun
        self._finished = 0  # scans completed
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log_budget = LogBudget(per_s=5)

    # -- lifecycle -------------------------------------------------------------------

    def open_all(self, *, watch: bool = True) -> None:
        """Open and validate every dataset now (problems show in the start-up log), then
        start the watcher unless ``watch`` is false.

        Checksums are verified here when the Store was made with ``verify_checksums``;
        never for datasets that appear or change later, so a rescan stays cheap.
        """
        if self.objects is not None:
            self.objects.check_bucket()
        elif not isinstance(self.root, Path) or not self.root.is_dir():
            raise StoreError(
                f"store directory {self.root} does not exist; create it with "
                "`tokenfeed-server prepare ... --store DIR` or point --store at an existing one"
            )
        self.scan(verify_checksums=self.verify_checksums, initial=True)
        if watch and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._watch, name="tokenfeed-store-watcher", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        """Stop the watcher and close every open dataset."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        entries, self._entries = self._entries, {}
        for entry in entries.values():
            if entry.dataset is not None:
                entry.dataset.close()

    # -- look-ups (memory only) ------------------------------------------------------

    def get(self, name: str) -> Dataset:
        """The open dataset ``name``; raises DatasetNotFound or the error that stops it."""
        validate_dataset_name(name)
        entry = self._entries.get(name)
        if entry is None:
            raise DatasetNotFound(
                f"dataset {name!r} is not in store {self.root}; available: "
                f"{', '.join(self.names()) or 'none'}"
            )
        if entry.error is not None:
            raise entry.error
        assert entry.dataset is not None
        return entry.dataset

    def names(self) -> list[str]:
        """Names of the complete datasets on disk at the last scan, sorted."""
        return sorted(self._entries)

    def summaries(self) -> list[dict[str, Any]]:
        """One summary per dataset on disk, including those that fail to open."""
        out = []
        for name, entry in sorted(self._entries.items()):
            if entry.dataset is not None:
                out.append(summary(entry.dataset))
            else:
                out.append({"name": name, "ok": False, "error": str(entry.error)})
        return out

    # -- scanning (off the data plane's thread) -------------------------------------

    def wait_for_scan(self, timeout: float | None = None) -> bool:
        """Wait until a scan that began after this call has finished; False on timeout.

        What was on disk when this is called is then what :meth:`get` answers from. The
        watcher is woken at once, so this takes one scan, not one interval.
        """
        with self._scans:
            target = self._started + 1
            self._wake.set()
            return self._scans.wait_for(lambda: self._finished >= target, timeout)

    def scan(self, *, verify_checksums: bool = False, initial: bool = False) -> None:
        """Rescan the directory: open datasets that are new or whose manifest changed,
        forget removed ones. The watcher calls this; it is safe from one thread at a time.
        """
        with self._scans:
            self._started += 1
        try:
            self._entries = self._rescan(verify_checksums, initial)
        finally:
            with self._scans:
                self._finished += 1
                self._scans.notify_all()

    def _rescan(self, verify_checksums: bool, initial: bool) -> dict[str, _Listing]:
        old = self._entries
        new: dict[str, _Listing] = {}
        if self.objects is not None:
            return self._rescan_remote(old, initial)
        assert isinstance(self.root, Path)
        for name in list_datasets(self.root) if self.root.is_dir() else []:
            entry = old.get(name)
            try:
                st = os.stat(self.root / name / MANIFEST_NAME)
            except FileNotFoundError:
                continue  # removed between the listing and now
            except OSError as exc:  # e.g. EACCES: listed as broken, the others served
                signature: _Signature = (-1, -1, exc.errno or 0)
                if entry is None or entry.signature != signature:
                    error = StoreError(f"dataset {name!r}: cannot read its manifest: {exc}")
                    entry = _Listing(signature, None, error)
                    self._report(name, entry, True)
                new[name] = entry
                continue
            signature = (st.st_ino, st.st_mtime_ns, st.st_size)
            if entry is None or entry.signature != signature:
                # Running jobs hold the old Dataset and keep reading the old files.
                entry = self._open(name, signature, verify_checksums)
                self._report(name, entry, initial or name not in old)
            new[name] = entry
        return new

    def _rescan_remote(self, old: dict[str, _Listing], initial: bool) -> dict[str, _Listing]:
        """One listing of ``<prefix>/*/manifest.json``; (re)open what is new or changed."""
        assert self.objects is not None
        new: dict[str, _Listing] = {}
        for name, signature in list_remote_datasets(self.objects).items():
            entry = old.get(name)
            if entry is None or entry.signature != signature:
                # Running jobs hold the old Dataset: its pieces are content-addressed
                # objects that stay in the bucket until gc, so they never mix builds.
                entry = self._open(name, signature, False)
                self._report(name, entry, initial or name not in old)
                if isinstance(entry.error, ObjectStoreError):
                    # Object storage failed (after retries), not the dataset: try again
                    # at the next scan instead of keeping it broken until it changes.
                    entry = _Listing((), None, entry.error)
            new[name] = entry
        return new

    def _open(self, name: str, signature: _Signature, verify_checksums: bool) -> _Listing:
        # A failure is kept under its signature: a damaged dataset is not re-read on every
        # scan, only once its manifest changes (a rebuild).
        try:
            if self.objects is not None:
                assert self.cache is not None
                ds: Dataset = open_remote_dataset(self.objects, self.cache, name)
            else:
                assert isinstance(self.root, Path)
                ds = open_dataset(self.root, name, verify_checksums=verify_checksums)
        except StoreError as exc:
            return _Listing(signature, None, exc)
        except Exception as exc:
            # An OSError the reader did not expect, a manifest nested too deep to parse, a
            # bug: the dataset is listed broken and every other one is still served.
            error = StoreError(f"dataset {name!r} cannot be opened: {type(exc).__name__}: {exc}")
            return _Listing(signature, None, error)
        return _Listing(signature, ds, None)

    def _report(self, name: str, entry: _Listing, new: bool) -> None:
        if entry.error is not None:
            log.error("dataset %s is not served: %s", name, entry.error)
            return
        ds = entry.dataset
        assert ds is not None
        log.info(
            "dataset %s %s: %d tokens, %d shards",
            name,
            "opened" if new else "replaced on disk, reopened",
            ds.n_tokens,
            len(ds.manifest.shards),
        )

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.scan_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.scan()
            except Exception:  # a bug or an unreadable store: keep the last good view
                if self._log_budget.take():
                    log.exception("cannot rescan store %s", self.root)


def summary(ds: Dataset) -> dict[str, Any]:
    """The manifest summary served at /v1/datasets."""
    m = ds.manifest
    return {
        "name": ds.name,
        "ok": True,
        "fingerprint": ds.fingerprint,
        "tokens": ds.n_tokens,
        "documents": ds.n_documents,
        "dtype": m.dtype,
        "shards": len(m.shards),
        "tokenizer": {
            "kind": m.tokenizer.kind,
            "vocab_size": m.tokenizer.vocab_size,
            "eos_id": m.tokenizer.eos_id,
        },
        "shuffle_seed": m.shuffle_seed,
        "format_version": m.format_version,
        "created": m.created,
    }


#: Bytes RowBuffers keeps pooled at most (16 chunks of the default max_chunk_bytes).
DEFAULT_POOL_BYTES = 256 * 1024 * 1024


class RowBuffers:
    """Reusable token buffers for the rows the data plane sends.

    Chunks leave with zero-copy sends, so ZeroMQ may still hold a buffer after the send
    returns. A buffer is lent as a fresh array over pooled memory; every view of it, and
    ZeroMQ's hold on it, keeps that array alive, so the memory is lent again only once the
    array is gone (tracked by a weak reference). Reuse spares the page faults of fresh
    allocations on every chunk, and :meth:`take_rows` the making of one view per row.

    Clients choose the sizes (sequence length, batch, chunk), so pooled memory is bounded:
    sizes are rounded up to power-of-two classes, at most ``per_size`` buffers are kept
    per class, and at most ``max_bytes`` in all; the least recently used classes are
    dropped to make room (a dropped buffer still lent lives on until its array is gone).
    """

    def __init__(self, per_size: int = 32, max_bytes: int = DEFAULT_POOL_BYTES) -> None:
        self.per_size = per_size
        self.max_bytes = max_bytes
        self._pools: OrderedDict[int, list[_Slot]] = OrderedDict()  # class -> slots, LRU first
        self._pooled = 0  # bytes held by the pools
        self._lock = threading.Lock()

    @property
    def pooled_bytes(self) -> int:
        """Bytes of the buffers pooled now (never more than ``max_bytes``)."""
        return self._pooled

    def take_rows(
        self, shape: tuple[int, int], dtype: np.dtype[Any]
    ) -> tuple[np.ndarray, list[tuple[memoryview]] | None]:
        """A C-contiguous array of ``shape`` and ``dtype`` whose content is undefined, and
        its rows as 1-tuples of memoryviews of its memory (what :meth:`Dataset.gather
        <tokenfeed_server.store.reader.Dataset.gather>` reads into), made once per pooled
        buffer and row size; None for a buffer not pooled.

        The views hold the pooled memory, never the lent array, so they do not keep a
        buffer lent.
        """
        nbytes = shape[0] * shape[1] * dtype.itemsize
        row = shape[1] * dtype.itemsize
        size = _size_class(nbytes)
        with self._lock:
            pool = self._pools.get(size)
            if pool is None:
                pool = self._pools[size] = []
            self._pools.move_to_end(size)
            for slot in pool:
                if slot.lent() is None:
                    break
            else:
                slot = _Slot(bytearray(size))
                if len(pool) >= self.per_size or not self._make_room(size):
                    if not pool:
                        del self._pools[size]
                    return np.ndarray(shape, dtype, buffer=slot.memory), None
                pool.append(slot)
                self._pooled += size
            array = np.ndarray(shape, dtype, buffer=slot.memory)
            slot.lent = weakref.ref(array)
            if not row:
                return array, None
            rows = slot.rows.get(row)
            if rows is None:
                if len(slot.rows) >= _ROW_SIZES:
                    slot.rows.pop(next(iter(slot.rows)))
                view = memoryview(slot.memory)
                rows = slot.rows[row] = [
                    (view[a : a + row],) for a in range(0, size - row + 1, row)
                ]
            return array, rows[: shape[0]]

    def _make_room(self, size: int) -> bool:
        """Drop least recently used classes (never ``size``'s) until ``size`` more bytes fit."""
        for other in list(self._pools):
            if self._pooled + size <= self.max_bytes:
                break
            if other != size:
                self._pooled -= other * len(self._pools.pop(other))
        return self._pooled + size <= self.max_bytes


# Row sizes whose views one pooled buffer keeps; the oldest goes first.
_ROW_SIZES = 4


def _size_class(nbytes: int) -> int:
    """The power of two at or above ``nbytes`` (at least 1)."""
    return 1 << max(nbytes - 1, 0).bit_length()


def _gone() -> None:
    return None


class _Slot:
    """One pooled buffer: its memory, a weak reference to the array lent over it, and
    its rows' views by row size."""

    __slots__ = ("lent", "memory", "rows")

    def __init__(self, memory: bytearray) -> None:
        self.memory = memory
        self.lent: Callable[[], np.ndarray | None] = _gone
        self.rows: dict[int, list[tuple[memoryview]]] = {}


#: The pool every request's rows are read into (shared by single-dataset and mixed jobs).
row_buffers = RowBuffers()


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


class WindowBlocks:
    """The window ids of whole blocks of stream positions, computed once and shared.

    :meth:`Plan.windows <tokenfeed.plan.Plan.windows>` costs about as much for the 248
    rows of a chunk as for 8192 positions (numpy's per-call overhead, and cycle-walking
    passes until the last of the rows lands), so the server computes windows a block of
    :attr:`block` consecutive positions at a time and serves the next chunks from it:
    the same pure function of the position, evaluated in bigger batches, so the order is
    the plan's to the bit. Blocks are keyed by what the function depends on (the number
    of windows, the seed, the shuffle mode and sizes: :attr:`Plan.order_key`), so jobs
    with the same ones share them; the least recently
    used goes when there are ``max_blocks``. A request whose rows are sparse in the
    positions they span (one rank of a large world, widely strided workers) is computed
    directly: a block would then mostly hold rows this server never sends. Any
    :class:`Order` is cached the same way (a mixture's, see
    :mod:`tokenfeed_server.store.mixing`).
    """

    def __init__(self, block: int = 8192, max_blocks: int = 64) -> None:
        self.block = block
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[tuple[Hashable, int], _Block] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Blocks held now."""
        return len(self._blocks)

    def windows(self, order: Order, positions: IntArray) -> tuple[IntArray, ...]:
        """``order.windows(positions)`` for sorted positions, from cached blocks if dense."""
        if positions.size == 0:
            return order.windows(positions)
        lo, hi = int(positions[0]), int(positions[-1])
        size = self.block
        first, last = lo // size, hi // size
        dense = positions.size * _DENSITY >= hi - lo + 1
        if not dense or last - first >= self.max_blocks // 2 or (last + 1) * size > INT64_MAX:
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

    def _block(self, order: Order, b: int) -> _Block:
        key = (order.order_key, b)  # shuffle mode and sizes too: block/global never share
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)
                return block
        size = self.block
        block = order.windows(np.arange(b * size, (b + 1) * size, dtype=np.int64))
        for part in block:
            part.flags.writeable = False  # shared by every job with this key
        with self._lock:
            self._blocks[key] = block
            while len(self._blocks) > self.max_blocks:
                self._blocks.popitem(last=False)
        return block


# Rows per position spanned below which a request is computed directly (see WindowBlocks).
_DENSITY = 16
#: The window blocks shared by every job (see :class:`WindowBlocks`).
window_blocks = WindowBlocks()


def assemble(
    ds: Dataset, plan: Plan, rank: int, pos: int, *, count: int, stride: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of one request: tokens ``[count*B, L+1]``, window ids and epochs ``[count*B]``.

    The tokens are read into a pooled buffer (see :class:`RowBuffers`); a shard that
    cannot be read raises CorruptShard naming the dataset.
    """
    positions = plan.rank_positions(rank, pos, count, stride)  # sorted, as blocks need
    window_ids, epochs = window_blocks.windows(plan, positions)
    out, rows = row_buffers.take_rows((len(window_ids), plan.seq_len + 1), ds.dtype)
    tokens = ds.gather(plan.token_starts(window_ids), plan.seq_len + 1, out=out, rows=rows)
    return tokens, window_ids, epochs
