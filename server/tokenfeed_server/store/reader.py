"""Open a dataset validated and read-only; list and name the datasets of a store."""

from __future__ import annotations

import errno
import hashlib
import itertools
import os
import re
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

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
    pass

__all__ = [
    "Dataset",
    "MixedGather",
    "is_dataset_name",
    "list_datasets",
    "open_dataset",
    "validate_dataset_name",
]

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HASH_CHUNK = 1 << 24


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
            target = self._row_target(out, rows, row)
            self._gather_slowly(map(target, range(n)), starts_arr.tolist())
            return
        if crossing:
            target = self._row_target(out, rows, row)
            for i in crossing:
                k = int(np.searchsorted(self._bounds, starts_arr[i], side="right")) - 1
                self._read_into(target(i), int(starts_arr[i]), k)

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
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        if len(starts) == 0 or length == 0:
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
        if not is_dataset_name(entry.name):
            continue
        try:
            complete = (entry / MANIFEST_NAME).is_file()
        except OSError:  # e.g. EACCES: listed, so that opening it says what is wrong
            complete = True
        if complete:
            names.append(entry.name)
    return sorted(names)
