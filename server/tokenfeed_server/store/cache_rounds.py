"""Reads too big for the cache at once, done in rounds that fit.

A request of a remote dataset reads its rows from pieces that must all be in the cache
while they are read (:meth:`~tokenfeed_server.store.remote.RemoteDataset._gather`). When
the distinct pieces of a request's rows take more than
:func:`round_bytes` (half the cache), the rows
are read in *rounds*: first every row whose pieces are all in the cache now, else the
next rows in piece order, as many as fit. A round that misses raises
:class:`~tokenfeed_server.store.waiters.NotResident` for its own pieces only, so the
data plane parks the request as for any miss and retries it once they are in; the rows
read so far wait here (:class:`Rounds`, keyed by the request's rows), so the retry goes
on where it stopped rather than starting over (which, with a small cache, would evict
the first round's pieces to fetch the last's, and so on without end).

The only refusal: one row whose pieces do not fit in the whole cache
(:class:`~tokenfeed_server.store.errors.CacheTooSmall`, naming ``--cache-size``).

Rows kept between rounds are bounded, per dataset, by the server setting
``--max-partial-read-bytes`` (default :data:`DEFAULT_MAX_PARTIAL_READ_BYTES`); beyond it
the oldest partial read is dropped (logged once per dataset, naming the setting, and
counted in :attr:`Rounds.dropped`), and its request then reads again from the start:
slower, never different data (every row comes from verified pieces of the same version).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from tokenfeed_server.store.cache_policy import one_row_fits
from tokenfeed_server.store.errors import CacheTooSmall

if TYPE_CHECKING:
    from tokenfeed_server.store.cache import PieceCache
    from tokenfeed_server.store.remote import RemoteDataset

__all__ = ["DEFAULT_MAX_PARTIAL_READ_BYTES", "Rounds", "round_bytes"]

log = logging.getLogger(__name__)

#: Default bytes of rows kept for requests read in rounds, per dataset
#: (``--max-partial-read-bytes``; a request's chunk is at most the server's
#: ``max_chunk_bytes``, so this holds several parked requests).
DEFAULT_MAX_PARTIAL_READ_BYTES = 64 << 20

Reader = Callable[[npt.NDArray[np.int64], int, np.ndarray], None]


@dataclass(eq=False)
class _Partial:
    """The rows of one request read so far."""

    data: np.ndarray  # [n, length]
    done: npt.NDArray[np.bool_]
    pieces: list[tuple[int, ...]]  # the piece ids of each row


class Rounds:
    """The partial reads of one remote dataset (see the module docstring)."""

    def __init__(self, limit_bytes: int = DEFAULT_MAX_PARTIAL_READ_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self._partials: collections.OrderedDict[tuple[int, bytes], _Partial] = (
            collections.OrderedDict()
        )
        self._bytes = 0
        #: rounds read (for tests and tools: a request that needed them counts them)
        self.rounds = 0
        #: partial reads dropped for the bound (their requests start over)
        self.dropped = 0

    def needed(self, ds: RemoteDataset, n_pieces: int) -> bool:
        """True when a read of ``n_pieces`` distinct pieces must go in rounds."""
        return n_pieces * ds.piece_bytes > round_bytes(ds.cache)

    def gather(
        self,
        ds: RemoteDataset,
        starts: npt.NDArray[np.int64],
        length: int,
        read: Reader,
    ) -> np.ndarray:
        """Every row ``ds[starts[i] : starts[i] + length]``, read round by round with
        ``read(starts, length, out)`` (which raises NotResident, nothing read, for a round
        whose pieces are not in): the rows, once all are read."""
        key = (length, starts.tobytes())
        partial = self._partials.pop(key, None)
        if partial is None:
            partial = self._start(ds, starts, length)
        else:
            self._bytes -= partial.data.nbytes
        try:
            while not partial.done.all():
                rows = self._next_round(ds, partial)
                chunk = np.empty((len(rows), length), dtype=ds.dtype)
                read(starts[rows], length, chunk)
                partial.data[rows] = chunk
                partial.done[rows] = True
                self.rounds += 1
        except BaseException:
            self._keep(ds, key, partial)
            raise
        return partial.data

    def _start(self, ds: RemoteDataset, starts: npt.NDArray[np.int64], length: int) -> _Partial:
        row_bytes = length * ds.dtype.itemsize
        problem = one_row_fits(ds.cache.capacity, ds.largest_piece, row_bytes)
        pieces = [row_piece_ids(ds, int(s), row_bytes) for s in starts.tolist()]
        worst = max(map(len, pieces))
        if problem is not None and worst * ds.largest_piece > ds.cache.capacity:
            raise CacheTooSmall(f"dataset {ds.name!r}: {problem}")
        n = len(starts)
        return _Partial(np.empty((n, length), dtype=ds.dtype), np.zeros(n, dtype=bool), pieces)

    def _next_round(self, ds: RemoteDataset, partial: _Partial) -> list[int]:
        """The rows of the next round: those whose pieces are all in the cache now, else
        the next rows in piece order; as many as fit in a round (at least one)."""
        todo = np.flatnonzero(~partial.done).tolist()
        ids = sorted({g for i in todo for g in partial.pieces[i]})
        here = dict(zip(ids, ds.cache.resident_many([ds.digests[g] for g in ids]), strict=True))
        ready = [i for i in todo if all(here[g] for g in partial.pieces[i])]
        order = ready or sorted(todo, key=lambda i: partial.pieces[i])
        room = max(1, round_bytes(ds.cache) // ds.largest_piece)
        chosen: list[int] = []
        held: set[int] = set()
        for i in order:
            more = held.union(partial.pieces[i])
            if chosen and len(more) > room:
                if ready:
                    continue  # a later ready row may share the pieces held
                break
            chosen.append(i)
            held = more
        return chosen

    def _keep(self, ds: RemoteDataset, key: tuple[int, bytes], partial: _Partial) -> None:
        """Keep ``partial`` for the retry, dropping the oldest beyond the bound."""
        if not partial.done.any():
            return  # nothing read yet: nothing to keep
        self._partials[key] = partial
        self._bytes += partial.data.nbytes
        while self._bytes > self.limit_bytes and len(self._partials) > 1:
            _, old = self._partials.popitem(last=False)
            self._bytes -= old.data.nbytes
            self.dropped += 1
            if self.dropped == 1:  # once per dataset: it repeats while the load lasts
                log.warning(
                    "dataset %s: reads in rounds (a cache too small for whole requests) "
                    "hold more than --max-partial-read-bytes (%d bytes): the oldest starts "
                    "over (slower, same data); raise --max-partial-read-bytes or "
                    "--cache-size",
                    ds.name,
                    self.limit_bytes,
                )

    def clear(self) -> None:
        """Forget every partial read (the dataset is closed)."""
        self._partials.clear()
        self._bytes = 0


def round_bytes(cache: PieceCache) -> int:
    """Most piece bytes one read pins at once: half the cache, leaving room for the next."""
    return cache.capacity // 2


def row_piece_ids(ds: RemoteDataset, start: int, row_bytes: int) -> tuple[int, ...]:
    """The global ids of the pieces holding the ``row_bytes`` token bytes from ``start``."""
    return tuple(
        g for k, off, nb in ds._file_spans(start, row_bytes) for g in ds._span_pieces(k, off, nb)
    )


def write_rows(data: np.ndarray, out: np.ndarray | None, rows: Sequence[tuple[Any]] | None) -> None:
    """Copy ``data``'s rows into ``rows`` when given (buffers anywhere), else ``out``."""
    if rows is None:
        assert out is not None
        out[...] = data
        return
    for i, (buf,) in enumerate(rows):
        memoryview(buf).cast("B")[:] = data[i].data.cast("B")
