"""The reader interface: a dataset's token stream, read from wherever its shards are.

:class:`Dataset` is what serving code reads (rows for a request, a token range, the
documents' starts). It holds the read path that does not depend on where the bytes are:
argument checks, the mapping of stream offsets to shard file spans, the document index.
Its two implementations supply the bytes: :class:`~tokenfeed_server.store.local.
LocalDataset` with ``pread`` from the shard files in a directory, and
:class:`~tokenfeed_server.store.remote.RemoteDataset` from verified pieces in the cache of
a store in object storage. Dataset names (:func:`validate_dataset_name`) are checked here
too: every way to a dataset goes through them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenfeed.dtypes import DTYPES
from tokenfeed.errors import InvalidDatasetName, StoreError
from tokenfeed.protocol.bounds import brief
from tokenfeed_server.store.format import HEADER_SIZE, index_offset
from tokenfeed_server.store.manifest import Manifest

__all__ = [
    "pread_exact",
    "Dataset",
    "FileSpan",
    "is_dataset_name",
    "validate_dataset_name",
]

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

#: (shard, byte offset in the shard file, bytes): one stretch of a read within one file
FileSpan = tuple[int, int, int]


def is_dataset_name(name: object) -> bool:
    """Whether ``name`` is a dataset name :func:`validate_dataset_name` accepts."""
    return isinstance(name, str) and bool(_NAME_RE.fullmatch(name)) and ".." not in name


def validate_dataset_name(name: str) -> str:
    """Return ``name`` if it is a safe, portable dataset name, else raise InvalidDatasetName.

    Allowed: 1-128 characters of ``[A-Za-z0-9._-]``, starting with a letter or digit, and
    no ``..``: a name can never escape the store or hide as a temp/dot directory.
    """
    if not is_dataset_name(name):
        raise InvalidDatasetName(
            f"invalid dataset name {brief(name)!r}: use 1-128 characters of letters, digits, "
            "'.', '_' or '-', starting with a letter or digit, and no '..'"
        )
    return name


class Dataset:
    """An opened, validated dataset: its manifest and its single global token stream.

    Offsets are positions in that stream. A subclass says where bytes come from:
    :meth:`_read_spans` (stretches of shard files into a buffer) and :meth:`_gather`
    (many rows of one length, the server's hot path), plus the checks and files that
    differ by place (:meth:`verify_checksums`, :meth:`read_extra_file`, :meth:`close`).
    A read of a closed dataset raises StoreError.
    """

    def __init__(self, name: str, path: Path, manifest: Manifest) -> None:
        self.name = name
        self.path = path
        self.manifest = manifest
        self.dtype: np.dtype[Any] = DTYPES[manifest.dtype]
        self.n_tokens = manifest.total_tokens
        self.n_documents = manifest.documents
        self.fingerprint = manifest.fingerprint
        self._closed = False
        self._index: dict[int, np.ndarray] = {}  # shard -> its document index, read lazily
        bounds = [0]
        for shard in manifest.shards:
            bounds.append(bounds[-1] + shard.tokens)
        # bounds[k] = global offset of shard k's first token; bounds[-1] = n_tokens.
        self._bounds = np.asarray(bounds, dtype=np.int64)
        self._bounds_list = bounds

    @property
    def bounds(self) -> npt.NDArray[np.int64]:
        """int64 stream offsets of every shard's first token, then ``n_tokens``."""
        return self._bounds

    def __enter__(self) -> Dataset:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- where the bytes are (subclasses) ---------------------------------------------

    def _read_spans(self, buf: memoryview, spans: Sequence[FileSpan]) -> None:
        """Fill ``buf`` with the file bytes of ``spans``, back to back."""
        raise NotImplementedError

    def _gather(
        self,
        starts_arr: npt.NDArray[np.int64],
        length: int,
        out: np.ndarray | None,
        rows: Sequence[tuple[Any]] | None,
    ) -> None:
        """Read the windows (checked, at least one of ``length`` > 0) into ``rows`` when
        given, else into ``out``'s rows: every row, also one read piecewise or again."""
        raise NotImplementedError

    def verify_checksums(self) -> None:
        """Check every byte against the manifest; raise CorruptShard naming the file."""
        raise NotImplementedError

    def read_extra_file(self, name: str) -> bytes:
        """The content of ``name``, one of the manifest's ``extra_files`` (ValueError for
        any other name: nothing else is ever read)."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop reading; reading afterwards raises StoreError."""
        self._closed = True
        self._index.clear()

    # -- the shared read path -----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"dataset {self.name!r} is closed")

    def _check_range(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= self.n_tokens:
            raise IndexError(
                f"token range [{start}, {stop}) is outside dataset {self.name!r} "
                f"of {self.n_tokens} tokens"
            )

    def _file_spans(self, start: int, nbytes: int) -> Iterator[FileSpan]:
        """The file spans of the ``nbytes`` token bytes from stream offset ``start``."""
        itemsize = self.dtype.itemsize
        k = int(np.searchsorted(self._bounds, start, side="right")) - 1
        pos, left = start, nbytes
        while left > 0:
            base, end = self._bounds_list[k], self._bounds_list[k + 1]
            take = min(left, (end - pos) * itemsize)
            yield k, HEADER_SIZE + (pos - base) * itemsize, take
            left -= take
            pos += take // itemsize
            k += 1

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream, as a new array."""
        start, stop = int(start), int(stop)
        self._check_range(start, stop)
        self._check_open()
        out = np.empty(stop - start, dtype=self.dtype)
        if stop > start:
            buf = out.data.cast("B")
            self._read_spans(buf, list(self._file_spans(start, len(buf))))
        return out

    def gather(
        self,
        starts: npt.ArrayLike,
        length: int,
        out: np.ndarray | None = None,
        *,
        rows: Sequence[tuple[memoryview]] | None = None,
    ) -> np.ndarray:
        """Rows ``out[i] = stream[starts[i] : starts[i] + length]`` (the server's hot path).

        ``out``, if given, must be a C-contiguous ``(len(starts), length)`` array of the
        store's dtype; ``rows``, if given, ``out``'s rows as 1-tuples of writable views of
        its memory, in order (kept by the caller, e.g. the server's pooled buffers, to spare
        making them on every call). A failed or short read raises CorruptShard naming the
        dataset.
        """
        starts_arr = np.asarray(starts, dtype=np.int64).reshape(-1)
        length = int(length)
        n = len(starts_arr)
        if out is None:
            out = np.empty((n, length), dtype=self.dtype)
        elif out.shape != (n, length) or out.dtype != self.dtype or not out.flags.c_contiguous:
            raise ValueError(
                f"out has shape {out.shape} and dtype {out.dtype}; expected a C-contiguous "
                f"{(n, length)} array of {self.dtype}"
            )
        if n == 0 or length == 0:
            return out
        if rows is not None and len(rows) != n:
            raise ValueError(f"rows has {len(rows)} rows, out {n}")
        self._check_windows(starts_arr, length)
        self._gather(starts_arr, length, out, rows)
        return out

    def gather_rows(self, starts: npt.ArrayLike, length: int, rows: Sequence[tuple[Any]]) -> None:
        """Write ``stream[starts[i] : starts[i] + length]`` into ``rows[i][0]``, a writable
        C-contiguous buffer of exactly ``length`` tokens' bytes anywhere in memory (a
        mixture's rows of one source, scattered over the request's buffer): every row is
        written there and nowhere else, whatever path its read takes. Errors as
        :meth:`gather`.
        """
        starts_arr = np.asarray(starts, dtype=np.int64).reshape(-1)
        length = int(length)
        n = len(starts_arr)
        if len(rows) != n:
            raise ValueError(f"rows has {len(rows)} rows for {n} starts")
        if n == 0 or length == 0:
            return
        self._check_windows(starts_arr, length)
        # Only the first row's size is checked: a per-row check would cost Python per row.
        got = memoryview(rows[0][0]).nbytes
        if got != length * self.dtype.itemsize:
            raise ValueError(
                f"rows[0] has {got} bytes; a row of {length} tokens of {self.dtype} has "
                f"{length * self.dtype.itemsize}"
            )
        self._gather(starts_arr, length, None, rows)

    def _check_windows(self, starts_arr: npt.NDArray[np.int64], length: int) -> None:
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        lo, hi = int(starts_arr.min()), int(starts_arr.max())
        if lo < 0 or hi + length > self.n_tokens:
            bad = lo if lo < 0 else hi
            raise IndexError(
                f"window [{bad}, {bad + length}) is outside dataset {self.name!r} "
                f"of {self.n_tokens} tokens"
            )

    @staticmethod
    def _row_target(
        out: np.ndarray | None, rows: Sequence[tuple[Any]] | None, row: int
    ) -> Callable[[int], memoryview]:
        """Where row ``i`` of a gather goes, as bytes: ``rows[i][0]`` when rows are given
        (they may be views of anywhere, not of ``out``), else row ``i`` of ``out``."""
        if rows is not None:
            return lambda i: memoryview(rows[i][0]).cast("B")
        assert out is not None
        buf = out.data.cast("B")
        return lambda i: buf[i * row : (i + 1) * row]

    def _document_index(self, k: int) -> np.ndarray:
        index = self._index.get(k)
        if index is None:
            shard = self.manifest.shards[k]
            index = np.empty(shard.documents, dtype="<u8")
            if shard.documents:
                offset = index_offset(shard.tokens, self.dtype.itemsize)
                buf = index.data.cast("B")
                self._read_spans(buf, [(k, offset, len(buf))])
            self._index[k] = index
        return index

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        """int64 global offsets of the documents that start in ``[start, stop)``, sorted."""
        start, stop = int(start), int(stop)
        self._check_range(start, stop)
        self._check_open()
        parts: list[np.ndarray] = []
        for k, shard in enumerate(self.manifest.shards):
            base, end = self._bounds_list[k], self._bounds_list[k + 1]
            if end <= start or base >= stop or shard.documents == 0:
                continue
            index = self._document_index(k)
            a = int(np.searchsorted(index, max(start - base, 0), side="left"))
            b = int(np.searchsorted(index, stop - base, side="left"))
            parts.append(index[a:b].astype(np.int64) + base)
        if not parts:
            return np.empty(0, dtype=np.int64)
        return np.concatenate(parts)


def pread_exact(fd: int, buf: memoryview, offset: int) -> str | None:
    """Fill ``buf`` from ``fd`` at ``offset``; None, or what went wrong (an OS error, a
    short read) for the caller's own error, which names the file it reads."""
    try:
        got = os.preadv(fd, [buf], offset)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None if got == len(buf) else f"read {got} of {len(buf)} bytes at offset {offset}"
