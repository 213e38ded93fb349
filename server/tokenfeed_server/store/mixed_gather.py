"""Rows of several local datasets in one pass: what a mixture's request reads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

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
    raises naming it.
    """

    def __init__(self, datasets: Sequence[Dataset]) -> None:
        self.datasets = tuple(datasets)
        self._local = [ds for ds in self.datasets if isinstance(ds, LocalDataset)]
        if len(self._local) != len(self.datasets):
            self._local = []  # one pass only when every source is a local file set
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
        fds = [fd for ds in self._local for fd in ds.fds]
        if len(fds) == len(self._bounds) - 1:  # every local dataset open
            inside = int(starts.min()) >= 0 and bool((starts + length <= self._sizes[which]).all())
            if inside:
                crossing = pread_rows(
                    fds, self._bounds, starts + self._base[which], length,
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
