"""Rows of several local datasets in one pass: what a mixture's request reads."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenfeed_server.store.handles import HANDLES, HandleTable, ShardFiles
from tokenfeed_server.store.local import LocalDataset, pread_rows
from tokenfeed_server.store.reader import Dataset

__all__ = ["MixedGather"]


class MixedGather:
    """Rows of several datasets of one dtype in one pass (a mixture's requests):
    :meth:`gather` reads ``out[i] = datasets[which[i]]``'s tokens ``[starts[i],
    starts[i] + length)``.

    Local datasets are read as one list of files (each dataset's shards after the
    previous one's, offsets shifted to match), so a whole request is one pass of
    ``preadv`` in row order straight into ``out``: a mixture costs about what one dataset
    costs. A dataset in object storage, a closed one, a failed read or a row across a
    shard boundary goes through that dataset's own :meth:`Dataset.gather_rows`, which
    raises naming it. The one list of files has its own handles in the server's bounded
    set (:mod:`~tokenfeed_server.store.handles`), opened through each dataset's files.
    """

    def __init__(self, datasets: Sequence[Dataset]) -> None:
        self.datasets = tuple(datasets)
        self._local = [ds for ds in self.datasets if isinstance(ds, LocalDataset)]
        if len(self._local) != len(self.datasets):
            self._local = []  # one pass only when every source is a local file set
        files = [ds.shard_files for ds in self._local]
        self._table = HandleTable(0, _no_file)
        if self._local and all(f is not None for f in files):
            self._table = _joined_table([f for f in files if f is not None])
            weakref.finalize(self, HANDLES.release_table, self._table)
        else:
            self._local = []
        sizes = np.asarray([ds.n_tokens for ds in self.datasets], dtype=np.int64)
        self._sizes = sizes
        self._base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self._bounds = np.concatenate(
            [ds.bounds[:-1] + b for ds, b in zip(self.datasets, self._base.tolist(), strict=True)]
            + [sizes.sum(keepdims=True)]
        )

    def gather(
        self,
        which: npt.NDArray[np.int64],
        starts: npt.NDArray[np.int64],
        length: int,
        *,
        out: np.ndarray,
        rows: Sequence[tuple[Any]] | None = None,
    ) -> None:
        """Fill ``out`` (``[len(starts), length]``, C-contiguous, the datasets' dtype;
        ``rows`` its rows as for :meth:`Dataset.gather`). Errors as :meth:`Dataset.gather`,
        naming the dataset."""
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        if len(starts) == 0 or length == 0:
            return
        if rows is None:
            rows = list(zip(out))
        todo: npt.NDArray[np.int64] | None = None  # rows left to each dataset (None: all)
        if self._local and all(ds.shard_files is not None for ds in self._local):
            inside = int(starts.min()) >= 0 and bool((starts + length <= self._sizes[which]).all())
            if inside:
                crossing = pread_rows(
                    self._table, self._bounds, starts + self._base[which], length,
                    itemsize=self.datasets[0].dtype.itemsize, row_bufs=iter(rows),
                )  # fmt: skip
                if crossing == []:
                    return
                if crossing is not None:  # only the rows across a shard boundary
                    todo = np.asarray(crossing, dtype=np.int64)
        for s, ds in enumerate(self.datasets):
            picked = np.flatnonzero(which == s)
            if todo is not None:
                picked = picked[np.isin(picked, todo)]
            if picked.size:
                ds.gather_rows(starts[picked], length, [rows[i] for i in picked.tolist()])


def _joined_table(files: Sequence[ShardFiles]) -> HandleTable:
    """One table over the files of ``files`` one after the other: file ``g`` is file
    ``g - base[s]`` of ``files[s]``."""
    base = np.cumsum([0] + [len(f.names) for f in files])

    def opener(g: int) -> int:
        s = int(np.searchsorted(base, g, side="right")) - 1
        return files[s].open(g - int(base[s]))

    return HandleTable(int(base[-1]), opener)


def _no_file(k: int) -> int:
    raise AssertionError("not a one-pass mixture")
