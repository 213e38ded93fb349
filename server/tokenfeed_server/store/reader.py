"""Open a dataset validated and read-only; list and name the datasets of a store."""

from __future__ import annotations

import bisect
import errno
import hashlib
import itertools
import os
import re
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, overload

import numpy as np
import numpy.typing as npt

from tokenfeed.dtypes import DTYPES
from tokenfeed.errors import (
    CorruptShard,
    DatasetNotFound,
    InvalidDatasetName,
    ManifestError,
    StoreError,
)
from tokenfeed_server.store.format import (
    CHECKSUM_ALGO,
    DTYPE_CODES,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    MANIFEST_NAME,
    ShardHeader,
    index_offset,
    is_plain_file_name,
    shard_size,
)
from tokenfeed_server.store.manifest import Manifest, ShardInfo

if TYPE_CHECKING:
    from tokenfeed_server.store.cache import PieceCache, PieceRef, Waiter
    from tokenfeed_server.store.objects import ObjectStore

__all__ = [
    "Dataset",
    "PieceList",
    "RemoteDataset",
    "list_datasets",
    "list_remote_datasets",
    "open_dataset",
    "open_remote_dataset",
    "read_blocking",
    "validate_dataset_name",
]

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HASH_CHUNK = 1 << 24


def validate_dataset_name(name: str) -> str:
    """Return ``name`` if it is a safe, portable dataset name, else raise InvalidDatasetName.

    Allowed: 1-128 characters of ``[A-Za-z0-9._-]``, starting with a letter or digit, and
    no ``..``: a name can never escape the store or hide as a temp/dot directory.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
        raise InvalidDatasetName(
            f"invalid dataset name {name!r}: use 1-128 characters of letters, digits, "
            "'.', '_' or '-', starting with a letter or digit, and no '..'"
        )
    return name


class Dataset:
    """An opened, validated dataset, read with ``pread`` from its shard files.

    Offsets are positions in the dataset's single global token stream. Nothing is
    memory-mapped: a shard truncated or damaged while the dataset is open makes a read
    raise :class:`~tokenfeed.errors.CorruptShard` naming the dataset and the file, where
    touching a map would kill the whole process with SIGBUS. The files stay open, so a
    dataset replaced on disk keeps reading its old files until it is closed.
    """

    def __init__(self, name: str, path: Path, manifest: Manifest) -> None:
        self.name = name
        self.path = path
        self.manifest = manifest
        self.dtype: np.dtype[Any] = DTYPES[manifest.dtype]
        self.n_tokens = manifest.total_tokens
        self.n_documents = manifest.documents
        self.fingerprint = manifest.fingerprint
        self._fds: list[int] = []
        # Closes the files when the dataset is dropped (a replaced one, its last job gone).
        self._finalizer = weakref.finalize(self, _close_all, self._fds)
        self._index: dict[int, np.ndarray] = {}  # shard -> its document index, read lazily
        bounds = [0]
        for shard in manifest.shards:
            bounds.append(bounds[-1] + shard.tokens)
        # bounds[k] = global offset of shard k's first token; bounds[-1] = n_tokens.
        self._bounds = np.asarray(bounds, dtype=np.int64)
        self._bounds_list = bounds

    def _attach(self, dir_fd: int) -> None:
        """Open every shard through ``dir_fd``, the directory the manifest was read from.

        Names are resolved in that directory, not by path: a ``prepare --overwrite`` that
        swaps the dataset directory meanwhile cannot pair this manifest with the new
        build's shards.
        """
        for shard in self.manifest.shards:
            path = self.path / shard.name
            try:
                fd = os.open(shard.name, _RDONLY, dir_fd=dir_fd)
            except FileNotFoundError:
                raise CorruptShard(f"{path}: shard file is missing; {_FIX}") from None
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    # Not a damaged dataset: the server holds one descriptor per shard.
                    raise StoreError(
                        f"dataset {self.name!r}: out of file descriptors opening shard "
                        f"{len(self._fds) + 1} of {len(self.manifest.shards)} (the server "
                        "keeps one per shard); raise the limit (`ulimit -n`, or "
                        "`nofile` in Docker/systemd) and restart the server"
                    ) from exc
                raise CorruptShard(f"{path}: cannot open shard: {exc}; {_FIX}") from exc
            self._fds.append(fd)
            # Checked through the descriptor that will be read: no window for a swap.
            _check_shard_file(fd, path, shard, self.manifest.dtype)
            # Windows are read at random: readahead would pull in pages nobody asked for.
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

    def __repr__(self) -> str:
        return (
            f"Dataset({self.name!r}, tokens={self.n_tokens}, documents={self.n_documents}, "
            f"shards={len(self.manifest.shards)}, dtype={self.manifest.dtype})"
        )

    def __enter__(self) -> Dataset:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_range(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= self.n_tokens:
            raise IndexError(
                f"token range [{start}, {stop}) is outside dataset {self.name!r} "
                f"of {self.n_tokens} tokens"
            )

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream, as a new array."""
        start, stop = int(start), int(stop)
        self._check_range(start, stop)
        out = np.empty(stop - start, dtype=self.dtype)
        if stop > start:
            k = int(np.searchsorted(self._bounds, start, side="right")) - 1
            self._read_into(out.data.cast("B"), start, k)
        return out

    def _read_into(self, buf: memoryview, start: int, k: int) -> None:
        """Fill ``buf`` with the stream from ``start``, beginning in shard ``k``."""
        itemsize = self.dtype.itemsize
        pos, done, n = start, 0, len(buf)
        while done < n:
            base, end = self._bounds_list[k], self._bounds_list[k + 1]
            take = min(n - done, (end - pos) * itemsize)
            self._pread(k, buf[done : done + take], HEADER_SIZE + (pos - base) * itemsize)
            done += take
            pos += take // itemsize
            k += 1

    def _pread(self, k: int, buf: memoryview, offset: int) -> None:
        try:
            got = os.preadv(self._fds[k], [buf], offset)
        except OSError as exc:
            raise self._read_error(k, f"{exc.strerror or exc}") from None
        except IndexError:
            raise StoreError(f"dataset {self.name!r} is closed") from None
        if got != len(buf):
            raise self._read_error(k, f"read {got} of {len(buf)} bytes at offset {offset}")

    def _read_error(self, k: int, what: str) -> CorruptShard:
        return CorruptShard(
            f"dataset {self.name!r}: cannot read {self.path / self.manifest.shards[k].name} "
            f"({what}): the file changed under the server; rebuild the dataset with "
            "tokenfeed-server prepare ... --overwrite"
        )

    def gather(
        self,
        starts: npt.ArrayLike,
        length: int,
        out: np.ndarray | None = None,
        *,
        rows: Sequence[tuple[memoryview]] | None = None,
    ) -> np.ndarray:
        """Rows ``out[i] = stream[starts[i] : starts[i] + length]`` (the server's hot path).

        One ``pread`` per row straight into ``out`` (rows are random windows: no two share
        a file range worth merging); a row that crosses a shard boundary is read in two.
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

    def _gather(
        self,
        starts_arr: npt.NDArray[np.int64],
        length: int,
        out: np.ndarray | None,
        rows: Sequence[tuple[Any]] | None,
    ) -> None:
        """Read the windows (checked, at least one of ``length`` > 0) into ``rows`` when
        given, else into ``out``'s rows: every row, also one read piecewise or again."""
        if not self._fds:
            raise StoreError(f"dataset {self.name!r} is closed")
        n = len(starts_arr)
        row = length * self.dtype.itemsize
        row_bufs: Iterator[tuple[Any]]
        if rows is None:
            assert out is not None
            row_bufs = zip(out)  # ndarray rows (typeshed: not buffers)
        else:
            row_bufs = iter(rows)
        crossing = _pread_rows(
            self._fds, self._bounds, starts_arr, length, itemsize=self.dtype.itemsize,
            row_bufs=row_bufs,
        )  # fmt: skip
        # The rows read piecewise or again go where the fast path puts them: through
        # ``rows`` when given (views of anywhere, e.g. a mixture's scattered rows of one
        # source), else into ``out``'s rows.
        if crossing is None:
            target = _row_target(out, rows, row)
            self._gather_slowly(map(target, range(n)), starts_arr.tolist())
            return
        if crossing:
            target = _row_target(out, rows, row)
            for i in crossing:
                k = int(np.searchsorted(self._bounds, starts_arr[i], side="right")) - 1
                self._read_into(target(i), int(starts_arr[i]), k)

    def _gather_slowly(self, targets: Iterable[memoryview], starts: list[int]) -> None:
        """Read row by row into ``targets``, raising CorruptShard naming the shard of the
        first failed read.

        The fast path only knows that some read failed; this names which (a file changed
        under the server). Rows that read in full this time are simply served.
        """
        bounds = self._bounds
        for target, s in zip(targets, starts, strict=True):
            k = int(np.searchsorted(bounds, s, side="right")) - 1
            self._read_into(target, s, k)

    def _document_index(self, k: int) -> np.ndarray:
        index = self._index.get(k)
        if index is None:
            shard = self.manifest.shards[k]
            index = np.empty(shard.documents, dtype="<u8")
            if shard.documents:
                offset = index_offset(shard.tokens, self.dtype.itemsize)
                self._pread(k, index.data.cast("B"), offset)
            self._index[k] = index
        return index

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        """int64 global offsets of the documents that start in ``[start, stop)``, sorted."""
        start, stop = int(start), int(stop)
        self._check_range(start, stop)
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

    def verify_checksums(self) -> None:
        """Hash every shard and compare with the manifest; raise CorruptShard naming the file."""
        if not self._fds:
            raise StoreError(f"dataset {self.name!r} is closed")
        for fd, shard in zip(self._fds, self.manifest.shards, strict=True):
            path = self.path / shard.name
            algo, _, expected = shard.checksum.partition(":")
            # Through the open file: the bytes hashed are the bytes served.
            actual = _file_checksum(fd, path, algo, HEADER_SIZE)
            if actual != expected:
                raise CorruptShard(
                    f"{path}: checksum mismatch ({algo} {actual} != manifest {expected}); the "
                    f"shard is corrupt: re-run tokenfeed-server prepare ... --dataset "
                    f"{self.name} --overwrite"
                )

    def read_extra_file(self, name: str) -> bytes:
        """The content of ``name``, one of the manifest's ``extra_files``, read in this
        dataset's directory (ValueError for any other name: nothing else is ever read)."""
        if name not in self.manifest.extra_files or not is_plain_file_name(name):
            raise ValueError(f"{name!r} is not one of dataset {self.name!r}'s files")
        fd = os.open(self.path, _RDONLY | os.O_DIRECTORY)
        try:
            file_fd = os.open(name, _RDONLY | getattr(os, "O_NOFOLLOW", 0), dir_fd=fd)
        finally:
            os.close(fd)
        with os.fdopen(file_fd, "rb") as f:
            return f.read()

    def close(self) -> None:
        """Close the shard files; reading afterwards raises StoreError."""
        self._finalizer()
        self._index.clear()


def _pread_rows(
    fds: Sequence[int],
    bounds: npt.NDArray[np.int64],
    starts: npt.NDArray[np.int64],
    length: int,
    *,
    itemsize: int,
    row_bufs: Iterator[tuple[Any]],
) -> list[int] | None:
    """Read row ``i`` (``length`` tokens from token ``starts[i]`` of the files ``fds``,
    file ``k`` holding tokens ``[bounds[k], bounds[k+1])``) into the next of ``row_bufs``
    with one ``preadv`` each: the indices of the rows that cross a file boundary (not
    read: the caller reads them piecewise), or None when some read failed or came short
    (the caller reads row by row to name the file).

    The loop over rows runs in C (map, zip, sum over os.preadv): no Python bytecode per
    row, which was most of the cost of reading small rows. preadv takes a sequence of
    buffers: a 1-tuple per row (iterating an array yields its rows as views; cheaper
    than slicing a memoryview).
    """
    n = len(starts)
    crossing: list[int] = []
    fd_iter: Iterable[int]
    if len(fds) == 1:
        fd_iter = itertools.repeat(fds[0], n)
        offsets = starts * itemsize + HEADER_SIZE
    else:
        first = np.searchsorted(bounds, starts, side="right") - 1
        last = np.searchsorted(bounds, starts + (length - 1), side="right") - 1
        offsets = (starts - bounds[first]) * itemsize + HEADER_SIZE
        fd_iter = np.asarray(fds, dtype=np.int64)[first].tolist()
        whole = first == last
        if not whole.all():  # rows across a file boundary: left to the caller
            crossing = np.flatnonzero(~whole).tolist()
            keep = whole.tolist()
            row_bufs = itertools.compress(row_bufs, keep)
            fd_iter = itertools.compress(fd_iter, keep)
            offsets = offsets[whole]
    # Every byte is counted: a short read anywhere shows in the total.
    expected = (n - len(crossing)) * length * itemsize
    try:
        got = sum(map(os.preadv, fd_iter, row_bufs, offsets.tolist()))
    except OSError:
        return None
    return crossing if got == expected else None


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
        self._local = all(type(ds) is Dataset for ds in self.datasets)
        sizes = np.asarray([ds.n_tokens for ds in self.datasets], dtype=np.int64)
        self._sizes = sizes
        self._base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self._bounds = np.concatenate(
            [ds._bounds[:-1] + b for ds, b in zip(self.datasets, self._base.tolist(), strict=True)]
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
        if len(starts) == 0 or length <= 0:
            return
        if rows is None:
            rows = list(zip(out))
        todo: npt.NDArray[np.int64] | None = None  # rows left to each dataset (None: all)
        fds = [fd for ds in self.datasets for fd in ds._fds] if self._local else []
        if len(fds) == len(self._bounds) - 1:  # every local dataset open
            inside = int(starts.min()) >= 0 and bool((starts + length <= self._sizes[which]).all())
            if inside:
                crossing = _pread_rows(
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


def _sorted_unique(a: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """``np.unique(a)`` of a small int array: a sort and a mask, a fraction of the cost
    of numpy's general path for the few hundred piece ids of a request."""
    a = np.sort(a)
    if a.size < 2:
        return a
    keep = np.empty(a.size, dtype=bool)
    keep[0] = True
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    return a[keep]


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


def _close_all(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


_RDONLY = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_FIX = "re-run tokenfeed-server prepare ... --overwrite to rebuild the dataset"


def _check_shard_file(fd: int, path: Path, shard: ShardInfo, dtype: str) -> None:
    itemsize = DTYPES[dtype].itemsize
    try:
        head = os.pread(fd, HEADER_SIZE, 0)
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise CorruptShard(f"{path}: cannot read shard: {exc}; {_FIX}") from exc
    if len(head) < HEADER_SIZE:
        raise CorruptShard(f"{path}: truncated header ({size} bytes); {_FIX}")
    header = ShardHeader.unpack(head)
    problems = []
    if header.magic != MAGIC:
        problems.append(f"bad magic {header.magic!r}, not a tokenfeed shard")
    elif header.version != FORMAT_VERSION:
        problems.append(f"format version {header.version}, expected {FORMAT_VERSION}")
    else:
        if header.dtype_code != DTYPE_CODES[dtype]:
            problems.append(f"dtype code {header.dtype_code}, manifest says {dtype}")
        if header.tokens != shard.tokens:
            problems.append(f"header has {header.tokens} tokens, manifest {shard.tokens}")
        if header.documents != shard.documents:
            problems.append(f"header has {header.documents} documents, manifest {shard.documents}")
        if header.index_offset != index_offset(shard.tokens, itemsize):
            problems.append(f"document index offset {header.index_offset} is inconsistent")
        expected = shard_size(shard.tokens, shard.documents, itemsize)
        if size != expected:
            what = "truncated" if size < expected else "has trailing bytes"
            problems.append(f"file {what}: {size} bytes, expected {expected}")
    if problems:
        raise CorruptShard(f"{path}: {'; '.join(problems)}; {_FIX}")


def _file_checksum(fd: int, path: Path, algo: str, skip: int) -> str:
    if algo != CHECKSUM_ALGO:
        raise CorruptShard(f"{path}: unknown checksum algorithm {algo!r}")
    hasher = hashlib.blake2b(digest_size=16)
    offset = skip
    try:
        while chunk := os.pread(fd, _HASH_CHUNK, offset):
            hasher.update(chunk)
            offset += len(chunk)
    except OSError as exc:
        raise CorruptShard(f"{path}: cannot read shard: {exc}; {_FIX}") from exc
    return hasher.hexdigest()


def _dataset_dir(store: str | os.PathLike[str], name: str) -> Path:
    return Path(store) / validate_dataset_name(name)


def open_dataset(
    store: str | os.PathLike[str], name: str, *, verify_checksums: bool = False
) -> Dataset:
    """Open ``<store>/<name>``: check the manifest and every shard's header and size.

    Raises DatasetNotFound, ManifestError or CorruptShard with the file named and what to
    do. ``verify_checksums`` also hashes every shard (reads the whole dataset).
    """
    path = _dataset_dir(store, name)
    manifest_path = path / MANIFEST_NAME
    try:
        # One directory descriptor for the manifest and every shard: one open, one build.
        dir_fd = os.open(path, _RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        known = ", ".join(list_datasets(store)) or "none"
        raise DatasetNotFound(
            f"no dataset {name!r} in store {store} (datasets: {known}); "
            "create it with tokenfeed-server prepare"
        ) from None
    except OSError as exc:
        raise StoreError(f"{path}: cannot open dataset directory: {exc}") from exc
    try:
        manifest = _read_manifest(dir_fd, manifest_path)
        dataset = Dataset(name, path, manifest)
        try:
            dataset._attach(dir_fd)
            if verify_checksums:
                dataset.verify_checksums()
        except BaseException:
            dataset.close()
            raise
    finally:
        os.close(dir_fd)
    return dataset


def _read_manifest(dir_fd: int, manifest_path: Path) -> Manifest:
    try:
        fd = os.open(MANIFEST_NAME, _RDONLY, dir_fd=dir_fd)
        with os.fdopen(fd, "rb") as f:
            text = f.read()
    except OSError as exc:
        raise ManifestError(
            f"{manifest_path}: cannot read manifest ({exc.strerror or exc}); the dataset is "
            "incomplete: re-run tokenfeed-server prepare ... --overwrite"
        ) from exc
    try:
        return Manifest.from_json(text)
    except ManifestError as exc:
        raise ManifestError(
            f"{manifest_path}: {exc}; re-run tokenfeed-server prepare ... --overwrite"
        ) from exc


def list_datasets(store: str | os.PathLike[str]) -> list[str]:
    """Names of the complete datasets in ``store``, sorted; [] if the store does not exist.

    Temp directories of running or crashed writers are never listed.
    """
    root = Path(store)
    if not root.exists():
        return []
    if not root.is_dir():
        raise StoreError(f"store {root} is not a directory")
    names = []
    for entry in root.iterdir():
        if not _NAME_RE.fullmatch(entry.name) or ".." in entry.name:
            continue
        try:
            complete = (entry / MANIFEST_NAME).is_file()
        except OSError:  # e.g. EACCES: listed, so that opening it says what is wrong
            complete = True
        if complete:
            names.append(entry.name)
    return sorted(names)


# ------------------------------------------------------------------------ remote datasets


class PieceList(Sequence["PieceRef"]):
    """The pieces of a remote dataset's shard files in order, as
    :class:`~tokenfeed_server.store.cache.PieceRef` objects made when asked for."""

    def __init__(self, name: str, manifest: Manifest, objects: ObjectStore) -> None:
        self._name = name
        self._manifest = manifest
        self._objects = objects
        self._piece = manifest.piece_bytes
        base = [0]
        for shard in manifest.shards:
            base.append(base[-1] + len(shard.pieces))
        #: base[k] = global id of shard k's first piece; base[-1] = the number of pieces
        self.base = base
        self._sizes = [s.file_size(manifest.itemsize) for s in manifest.shards]
        self._urls: dict[int, str] = {}

    def __len__(self) -> int:
        return self.base[-1]

    @overload
    def __getitem__(self, index: int) -> PieceRef: ...

    @overload
    def __getitem__(self, index: slice) -> list[PieceRef]: ...

    def __getitem__(self, index: int | slice) -> PieceRef | list[PieceRef]:
        if isinstance(index, slice):
            return [self._ref(i) for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"piece {index} of {len(self)}")
        return self._ref(index)

    def _ref(self, gid: int) -> PieceRef:
        from tokenfeed_server.store.cache import PieceRef

        k = bisect.bisect_right(self.base, gid) - 1
        i = gid - self.base[k]
        shard = self._manifest.shards[k]
        key = f"{self._name}/{shard.name}"
        url = self._urls.get(k)
        if url is None:
            url = self._urls[k] = self._objects.url(key)
        start = i * self._piece
        return PieceRef(shard.pieces[i], key, start, min(start + self._piece, self._sizes[k]), url)


class RemoteDataset(Dataset):
    """A dataset in object storage, read through a :class:`~tokenfeed_server.store.cache.
    PieceCache`: the same reading API as :class:`Dataset`, so the serving code is the same.

    Every read first checks that the pieces it needs are in the cache; if one is not, it
    raises :class:`~tokenfeed_server.store.cache.NotResident` before reading anything (the
    missing pieces are then on their way). Reads take the cache's lock, so no piece is
    evicted while being read. Every byte read was verified against the manifest's piece
    digest when it entered the cache.
    """

    def __init__(
        self, name: str, manifest: Manifest, objects: ObjectStore, cache: PieceCache
    ) -> None:
        super().__init__(name, Path(name), manifest)
        self.objects = objects
        self.cache = cache
        self.url = objects.url(name)
        self._closed = False
        self.piece_bytes = manifest.piece_bytes
        #: Every piece of the dataset, shard by shard, made on demand (a big dataset has
        #: millions): the global piece ids index it.
        self.pieces = PieceList(name, manifest, objects)
        #: The digest of every piece by global id (references to the manifest's strings).
        self.digests = [d for shard in manifest.shards for d in shard.pieces]
        self._piece_base = np.asarray(self.pieces.base, dtype=np.int64)
        self._piece_base_list = self.pieces.base
        #: Bytes of every shard file (what the whole dataset takes in a cache).
        self.nbytes = sum(s.file_size(manifest.itemsize) for s in manifest.shards)

    def __repr__(self) -> str:
        return (
            f"RemoteDataset({self.url!r}, tokens={self.n_tokens}, "
            f"shards={len(self.manifest.shards)}, pieces={len(self.pieces)})"
        )

    # -- which pieces -------------------------------------------------------------------

    def piece_range(self, start: int, stop: int) -> tuple[int, int]:
        """Global piece ids ``[first, last)`` holding the tokens ``[start, stop)`` (for the
        prefetch plan; the document index at the end of a shard is not included)."""
        start, stop = max(0, int(start)), min(self.n_tokens, int(stop))
        if stop <= start:
            return 0, 0
        first = self._piece_of(start)
        last = self._piece_of(stop - 1) + 1
        return first, last

    def range_bytes(self, first: int, end: int) -> int:
        """Bytes of the pieces ``[first, end)`` as cached (a shard's last piece, or its
        only one when the shard is smaller than a piece, is shorter than
        :attr:`piece_bytes`)."""
        bases, sizes, p = self.pieces.base, self.pieces._sizes, self.piece_bytes
        total, g = 0, max(0, first)
        k = bisect.bisect_right(bases, g) - 1
        while g < end and k < len(sizes):
            hi = min(end, bases[k + 1])
            total += min((hi - bases[k]) * p, sizes[k]) - (g - bases[k]) * p
            g, k = hi, k + 1
        return total

    def _piece_of(self, token: int) -> int:
        k = int(np.searchsorted(self._bounds, token, side="right")) - 1
        offset = HEADER_SIZE + (token - self._bounds_list[k]) * self.dtype.itemsize
        return self._piece_base_list[k] + offset // self.piece_bytes

    def _span_pieces(self, k: int, offset: int, nbytes: int) -> range:
        """Global piece ids of file bytes ``[offset, offset + nbytes)`` of shard ``k``."""
        base = self._piece_base_list[k]
        p = self.piece_bytes
        return range(base + offset // p, base + (offset + nbytes - 1) // p + 1)

    def _file_spans(self, start: int, nbytes: int) -> Iterator[tuple[int, int, int]]:
        """(shard, file offset, bytes) of the token bytes from stream offset ``start``."""
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

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"dataset {self.name!r} is closed")

    # -- reads --------------------------------------------------------------------------

    def _read_file(self, buf: memoryview, k: int, offset: int, fds: dict[int, int]) -> None:
        """Fill ``buf`` from shard ``k``'s file bytes at ``offset``, piece by piece."""
        p = self.piece_bytes
        base = self._piece_base_list[k]
        done, n = 0, len(buf)
        while done < n:
            i = (offset + done) // p
            inner = offset + done - i * p
            take = min(n - done, p - inner)
            self._pread_piece(fds[base + i], buf[done : done + take], inner, base + i)
            done += take

    def _pread_piece(self, fd: int, buf: memoryview, offset: int, gid: int) -> None:
        try:
            got = os.preadv(fd, [buf], offset)
        except OSError as exc:
            raise self._cache_error(gid, exc.strerror or str(exc)) from None
        if got != len(buf):
            raise self._cache_error(gid, f"read {got} of {len(buf)} bytes at {offset}")

    def _cache_error(self, gid: int, what: str) -> StoreError:
        return StoreError(
            f"dataset {self.name!r}: the cached piece {self.pieces[gid].digest} of "
            f"{self.pieces[gid].url} cannot be read ({what}): something changed the cache "
            f"directory {self.cache.directory}; restart the server"
        )

    def _acquire(self, gids: Iterable[int]) -> dict[int, int]:
        """gid -> descriptor of every piece (cache lock held by the caller)."""
        ids = sorted(set(gids))
        fds = self.cache.acquire_locked(
            [self.digests[g] for g in ids], lambda: [self.pieces[g] for g in ids]
        )
        return dict(zip(ids, fds, strict=True))

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream (NotResident if pieces are missing)."""
        start, stop = int(start), int(stop)
        self._check_range(start, stop)
        self._check_open()
        out = np.empty(stop - start, dtype=self.dtype)
        if stop == start:
            return out
        buf = out.data.cast("B")
        spans = list(self._file_spans(start, len(buf)))
        with self.cache.lock:
            fds = self._acquire(g for k, off, n in spans for g in self._span_pieces(k, off, n))
            done = 0
            for k, off, n in spans:
                self._read_file(buf[done : done + n], k, off, fds)
                done += n
        return out

    def _gather(
        self,
        starts_arr: npt.NDArray[np.int64],
        length: int,
        out: np.ndarray | None,
        rows: Sequence[tuple[Any]] | None,
    ) -> None:
        """:meth:`Dataset._gather` from the cache (NotResident, nothing read, if pieces
        are missing): every row into ``rows`` when given, else into ``out``'s rows."""
        self._check_open()
        n = len(starts_arr)
        itemsize = self.dtype.itemsize
        row = length * itemsize
        p = self.piece_bytes
        if len(self._bounds_list) == 2:  # one shard: no look-up of shards needed
            first = np.zeros(n, dtype=np.int64)
            offsets = starts_arr * itemsize + HEADER_SIZE
            whole = True
        else:
            first = np.searchsorted(self._bounds, starts_arr, side="right") - 1
            last = np.searchsorted(self._bounds, starts_arr + (length - 1), side="right") - 1
            offsets = (starts_arr - self._bounds[first]) * itemsize + HEADER_SIZE
            whole = first == last
        pieces = offsets // p
        g0 = self._piece_base[first] + pieces
        # Rows in one piece of one shard (nearly all when rows are small next to pieces)
        # are read in one pread each, in C; rows across one piece boundary of one shard
        # (the next most common) in two, their pieces found in bulk; the others (across
        # a shard boundary, or longer than a piece) span by span.
        ends = (offsets + (row - 1)) // p
        simple = whole & (pieces == ends)
        pairs: list[tuple[int, int, int, int]] = []  # (row, first piece, inner, bytes there)
        others: list[int] = []
        slow_spans: list[list[tuple[int, int, int]]] = []
        if not simple.all():
            pair = whole & (ends == pieces + 1)
            rest = ~(simple | pair)
            pair_rows = np.flatnonzero(pair)
            pair_g, pair_inner = g0[pair_rows], offsets[pair_rows] % p
            pairs = list(
                zip(
                    pair_rows.tolist(), pair_g.tolist(), pair_inner.tolist(),
                    (p - pair_inner).tolist(), strict=True,
                )
            )  # fmt: skip
            others = np.flatnonzero(rest).tolist()
            needed = [g0[simple], pair_g, pair_g + 1]
            for i in others:
                spans = list(self._file_spans(int(starts_arr[i]), row))
                slow_spans.append(spans)
                needed.append(
                    np.asarray(
                        [g for k, off, nb in spans for g in self._span_pieces(k, off, nb)],
                        dtype=np.int64,
                    )
                )
            ids = _sorted_unique(np.concatenate(needed))
            g0, inner = g0[simple], offsets[simple] % p
        else:
            ids = _sorted_unique(g0)
            inner = offsets % p
        with self.cache.lock:
            id_list = ids.tolist()
            digests = self.digests
            fd_list = self.cache.acquire_locked(
                [digests[g] for g in id_list], lambda: [self.pieces[g] for g in id_list]
            )
            fd_arr = np.asarray(fd_list, dtype=np.int64)
            fds_simple = fd_arr[np.searchsorted(ids, g0)].tolist()
            if rows is None:
                assert out is not None
                row_bufs: Iterator[Any] = zip(out)  # ndarray rows (typeshed: not buffers)
            else:
                row_bufs = iter(rows)
            if pairs or others:
                row_bufs = itertools.compress(row_bufs, simple.tolist())
            try:
                got = sum(map(os.preadv, fds_simple, row_bufs, inner.tolist()))
            except OSError:
                got = -1
            if got != len(fds_simple) * row:
                raise StoreError(
                    f"dataset {self.name!r}: a cached piece read short; something changed "
                    f"the cache directory {self.cache.directory}: restart the server"
                )
            if pairs or others:
                # Where the fast path would have put them: ``rows`` when given (maybe
                # views of anywhere), else ``out``'s rows.
                target = _row_target(out, rows, row)
                fd_of = dict(zip(id_list, fd_list, strict=True))
                for i, g, inner_i, cut in pairs:
                    buf = target(i)
                    self._pread_piece(fd_of[g], buf[:cut], inner_i, g)
                    self._pread_piece(fd_of[g + 1], buf[cut:], 0, g + 1)
                for i, spans in zip(others, slow_spans, strict=True):
                    buf, done = target(i), 0
                    for k, off, nb in spans:
                        self._read_file(buf[done : done + nb], k, off, fd_of)
                        done += nb

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        """As :meth:`Dataset.document_starts`, from the cache (NotResident if missing)."""
        self._check_open()
        return super().document_starts(start, stop)

    def _document_index(self, k: int) -> np.ndarray:
        index = self._index.get(k)
        if index is None:
            shard = self.manifest.shards[k]
            index = np.empty(shard.documents, dtype="<u8")
            if shard.documents:
                offset = index_offset(shard.tokens, self.dtype.itemsize)
                buf = index.data.cast("B")
                with self.cache.lock:
                    fds = self._acquire(self._span_pieces(k, offset, len(buf)))
                    self._read_file(buf, k, offset, fds)
            self._index[k] = index
        return index

    def verify_checksums(self) -> None:
        """Nothing to do: every piece is verified against the manifest as it is fetched."""
        self._check_open()

    def read_extra_file(self, name: str) -> bytes:
        """One of the manifest's ``extra_files``, fetched from the bucket (blocking: for
        the HTTP side, never the data plane's loop)."""
        if name not in self.manifest.extra_files or not is_plain_file_name(name):
            raise ValueError(f"{name!r} is not one of dataset {self.name!r}'s files")
        try:
            return self.objects.get(f"{self.name}/{name}")
        except StoreError as exc:  # what a reader of a local file would see: OSError
            raise OSError(str(exc)) from exc

    def close(self) -> None:
        """Forget the dataset (the cache keeps its pieces; they are shared by builds)."""
        self._closed = True
        self._index.clear()


_T = TypeVar("_T")


def read_blocking(ds: Dataset, read: Callable[[], _T], timeout: float | None = 60.0) -> _T:
    """``read()`` (a read of ``ds``), waiting for missing pieces instead of raising
    NotResident: for tools and tests, never for the data plane's loop."""
    from tokenfeed_server.store.cache import NotResident

    deadline = None if timeout is None else time.monotonic() + timeout
    held: tuple[PieceCache, Waiter] | None = None
    try:
        while True:
            try:
                return read()
            except NotResident as exc:
                # The pins of the last wait are kept until the retry has read: released
                # before, its pieces could be evicted for others again and again.
                if held is not None:
                    held[0].release(held[1])
                held = (exc.cache, exc.waiter)
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not exc.waiter.wait(left):
                    raise StoreError(
                        f"dataset {ds.name!r}: pieces did not arrive in {timeout} s"
                    ) from None
                if exc.waiter.error is not None:
                    raise exc.waiter.error from None
    finally:
        if held is not None:
            held[0].release(held[1])


def list_remote_datasets(objects: ObjectStore) -> dict[str, tuple[str, int]]:
    """``{name: (etag, size)}`` of every ``<name>/manifest.json`` in the store (a manifest
    is uploaded last, so only complete datasets are listed)."""
    found: dict[str, tuple[str, int]] = {}
    for info in objects.list():
        name, sep, rest = info.key.partition("/")
        if sep and rest == MANIFEST_NAME and _NAME_RE.fullmatch(name) and ".." not in name:
            found[name] = (info.etag, info.size)
    return found


def open_remote_dataset(objects: ObjectStore, cache: PieceCache, name: str) -> RemoteDataset:
    """Open dataset ``name`` of a remote store: read and check its manifest (version 2,
    with per-piece digests), and check that every shard object exists with its size.

    Nothing else is read: pieces come into the cache on demand, verified.
    """
    from tokenfeed_server.store.objects import ObjectNotFound

    validate_dataset_name(name)
    url = objects.url(f"{name}/{MANIFEST_NAME}")
    try:
        text = objects.get(f"{name}/{MANIFEST_NAME}")
    except ObjectNotFound:
        raise DatasetNotFound(
            f"no dataset {name!r} in store {objects.url()}; create it with "
            "tokenfeed-server prepare ... --store " + objects.url()
        ) from None
    try:
        manifest = Manifest.from_json(text)
    except ManifestError as exc:
        raise ManifestError(
            f"{url}: {exc}; re-run tokenfeed-server prepare ... --overwrite"
        ) from exc
    if manifest.format_version < 2 or not manifest.piece_bytes:
        raise ManifestError(
            f"{url}: format version {manifest.format_version} has no per-piece checksums, "
            "which serving from object storage needs; re-run tokenfeed-server prepare "
            "... --overwrite into the bucket with this tokenfeed"
        )
    sizes = {info.key: info.size for info in objects.list(f"{name}/")}
    itemsize = manifest.itemsize
    for shard in manifest.shards:
        key = f"{name}/{shard.name}"
        expected = shard.file_size(itemsize)
        size = sizes.get(key)
        if size is None:
            raise CorruptShard(
                f"{objects.url(key)}: shard object is missing (deleted by gc or by hand?); "
                "re-run tokenfeed-server prepare ... --overwrite"
            )
        if size != expected:
            raise CorruptShard(
                f"{objects.url(key)}: object has {size} bytes, the manifest says {expected}; "
                "re-run tokenfeed-server prepare ... --overwrite"
            )
    return RemoteDataset(name, manifest, objects, cache)
