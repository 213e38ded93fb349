"""Datasets in a local store directory: open one validated and read-only, list them."""

from __future__ import annotations

import hashlib
import itertools
import os
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenfeed.dtypes import DTYPES
from tokenfeed.errors import CorruptShard, DatasetNotFound, ManifestError, StoreError
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
from tokenfeed_server.store.handles import HANDLES, HandleTable, ShardFiles
from tokenfeed_server.store.manifest import Manifest, ShardInfo
from tokenfeed_server.store.reader import (
    Dataset,
    FileSpan,
    is_dataset_name,
    pread_exact,
    validate_dataset_name,
)
from tokenfeed_server.store.rows import read_rows

__all__ = ["LocalDataset", "list_datasets", "open_dataset", "pread_rows"]

_HASH_CHUNK = 1 << 24
_RDONLY = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: A dataset of at most this many shards has every shard's header checked when opened
#: (bigger ones: when each shard is first read; sizes are checked at open either way).
EAGER_HEADER_SHARDS = 256
_FIX = "re-run tokenfeed-server prepare ... --overwrite to rebuild the dataset"


class LocalDataset(Dataset):
    """A dataset in a local directory, read with ``pread`` from its shard files.

    Nothing is memory-mapped: a shard truncated or damaged while the dataset is open makes a
    read raise :class:`~tokenfeed.errors.CorruptShard` naming the dataset and the file,
    where touching a map would kill the whole process with SIGBUS. The dataset holds its
    directory open; its shard files are opened on demand into the server's bounded set
    (:mod:`~tokenfeed_server.store.handles`), by name in that directory and checked to be
    the files first seen, so a dataset replaced on disk keeps reading its own build (moved
    aside, not changed) until it is closed, or fails clearly if that build was removed.
    """

    def __init__(self, name: str, path: Path, manifest: Manifest) -> None:
        super().__init__(name, path, manifest)
        self._files: ShardFiles | None = None
        self._table = HandleTable(0, _no_file)
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def shard_files(self) -> ShardFiles | None:
        """The dataset's shard files (None once closed, or before it is attached)."""
        return None if self._closed else self._files

    def _attach(self, dir_fd: int) -> None:
        """Take the shard files of ``dir_fd``, the directory the manifest was read from:
        each is ``stat``-ed (missing, a link, a wrong size: CorruptShard), none opened
        (but for a small dataset, whose headers are checked at once).

        Names are resolved in that directory, not by path: a ``prepare --overwrite`` that
        swaps the dataset directory meanwhile cannot pair this manifest with the new
        build's shards.
        """
        shards, dtype, path = self.manifest.shards, self.manifest.dtype, self.path
        names = [shard.name for shard in shards]
        sizes = np.asarray([shard.file_size(self.dtype.itemsize) for shard in shards], np.int64)

        def check(fd: int, k: int) -> None:  # no reference to self: the finalizer must run
            _check_shard_file(fd, path / names[k], shards[k], dtype)

        files = ShardFiles(dir_fd, path, names, sizes, check)
        table = HandleTable(len(names), files.open)
        self._files, self._table = files, table
        # Closes the directory and files when the dataset is dropped (a replaced one, its
        # last job gone) or closed.
        self._finalizer = weakref.finalize(self, HANDLES.release_table, table, files)
        files.stat_all()
        if len(names) <= EAGER_HEADER_SHARDS:
            files.check_all()

    def __repr__(self) -> str:
        return (
            f"Dataset({self.name!r}, tokens={self.n_tokens}, documents={self.n_documents}, "
            f"shards={len(self.manifest.shards)}, dtype={self.manifest.dtype})"
        )

    def _read_spans(self, buf: memoryview, spans: Sequence[FileSpan]) -> None:
        done = 0
        for k, offset, nbytes in spans:
            self._pread(k, buf[done : done + nbytes], offset)
            done += nbytes

    def _pread(self, k: int, buf: memoryview, offset: int) -> None:
        self._check_open()
        fds, tick = HANDLES.acquire(self._table, np.asarray([k], dtype=np.int64))
        try:
            problem = pread_exact(fds[0], buf, offset)
        finally:
            HANDLES.release(tick)
        if problem is not None:
            raise self._read_error(k, problem)

    def _read_error(self, k: int, what: str) -> CorruptShard:
        return CorruptShard(
            f"dataset {self.name!r}: cannot read {self.path / self.manifest.shards[k].name} "
            f"({what}): the file changed under the server; rebuild the dataset with "
            "tokenfeed-server prepare ... --overwrite"
        )

    def _gather(
        self,
        starts_arr: npt.NDArray[np.int64],
        length: int,
        out: np.ndarray | None,
        rows: Sequence[tuple[Any]] | None,
    ) -> None:
        """One ``pread`` per row straight into its place (rows are random windows: no two
        share a file range worth merging); a row that crosses a shard boundary is read in
        two."""
        self._check_open()
        row = length * self.dtype.itemsize
        row_bufs: Iterator[tuple[Any]]
        if rows is None:
            assert out is not None
            row_bufs = zip(out)  # ndarray rows (typeshed: not buffers)
        else:
            row_bufs = iter(rows)
        crossing = pread_rows(
            self._table, self._bounds, starts_arr, length, itemsize=self.dtype.itemsize,
            row_bufs=row_bufs,
        )  # fmt: skip
        # The rows read piecewise or again go where the fast path puts them: through
        # ``rows`` when given (views of anywhere, e.g. a mixture's scattered rows of one
        # source), else into ``out``'s rows.
        # Some read failed: row by row, to raise CorruptShard naming the shard of the
        # first failed read (rows that read in full this time are simply served).
        again = range(len(starts_arr)) if crossing is None else crossing
        if again:
            target = self._row_target(out, rows, row)
            for i in again:
                self._read_spans(target(i), list(self._file_spans(int(starts_arr[i]), row)))

    def verify_checksums(self) -> None:
        """Hash every shard and compare with the manifest; raise CorruptShard naming the file."""
        files = self.shard_files
        if files is None:
            raise StoreError(f"dataset {self.name!r} is closed")
        for k, shard in enumerate(self.manifest.shards):
            path = self.path / shard.name
            algo, _, expected = shard.checksum.partition(":")
            # The file served (same inode), one at a time: the shared set is not churned.
            fd = HANDLES.open_one(files, k)
            try:
                actual = _file_checksum(fd, path, algo, HEADER_SIZE)
            finally:
                os.close(fd)
            if actual != expected:
                raise CorruptShard(
                    f"{path}: checksum mismatch ({algo} {actual} != manifest {expected}); the "
                    f"shard is corrupt: re-run tokenfeed-server prepare ... --dataset "
                    f"{self.name} --overwrite"
                )

    def read_extra_file(self, name: str) -> bytes:
        """One of the manifest's ``extra_files``, read in this dataset's directory."""
        if name not in self.manifest.extra_files or not is_plain_file_name(name):
            raise ValueError(f"{name!r} is not one of dataset {self.name!r}'s files")
        files = self.shard_files
        if files is None:
            raise StoreError(f"dataset {self.name!r} is closed")
        # In this build's directory (followed through a rename), not whatever is at path.
        file_fd = HANDLES.open_name(files, name)
        with os.fdopen(file_fd, "rb") as f:
            return f.read()

    def close(self) -> None:
        """Close the shard files; reading afterwards raises StoreError."""
        super().close()
        if self._finalizer is not None:
            self._finalizer()


def pread_rows(
    table: HandleTable,
    bounds: npt.NDArray[np.int64],
    starts: npt.NDArray[np.int64],
    length: int,
    *,
    itemsize: int,
    row_bufs: Iterator[tuple[Any]],
) -> list[int] | None:
    """Read row ``i`` (``length`` tokens from token ``starts[i]`` of the files of
    ``table``, file ``k`` holding tokens ``[bounds[k], bounds[k+1])``) into the next of
    ``row_bufs`` with one ``preadv`` each: the indices of the rows that cross a file
    boundary (not read: the caller reads them piecewise), or None when some read failed or
    came short (the caller reads row by row to name the file).

    The loop over rows runs in C (map, zip, sum over os.preadv): no Python bytecode per
    row, which was most of the cost of reading small rows. preadv takes a sequence of
    buffers: a 1-tuple per row (iterating an array yields its rows as views; cheaper
    than slicing a memoryview). The files' descriptors come from :data:`HANDLES`, held for
    the read.
    """
    n = len(starts)
    crossing: list[int] = []
    if len(bounds) == 2:
        first = np.zeros(n, dtype=np.int64)
        offsets = starts * itemsize + HEADER_SIZE
    else:
        first = np.searchsorted(bounds, starts, side="right") - 1
        last = np.searchsorted(bounds, starts + (length - 1), side="right") - 1
        offsets = (starts - bounds[first]) * itemsize + HEADER_SIZE
        whole = first == last
        if not whole.all():  # rows across a file boundary: left to the caller
            crossing = np.flatnonzero(~whole).tolist()
            row_bufs = itertools.compress(row_bufs, whole.tolist())
            first, offsets = first[whole], offsets[whole]
    # Every byte is counted: a short read anywhere shows in the total.
    expected = (n - len(crossing)) * length * itemsize
    try:
        got = _read_files(table, first, offsets, row_bufs)
    except OSError:
        return None
    return crossing if got == expected else None


def _read_files(
    table: HandleTable,
    files: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    row_bufs: Iterator[tuple[Any]],
) -> int:
    """Bytes read by one ``preadv`` per row (file ``files[i]`` at ``offsets[i]``), the
    rows taken in groups of at most ``HANDLES.limit`` files when they touch more."""
    if len(files) == 0:
        return 0
    if table.slot_of.size == 1:  # one file: one descriptor for every row
        fds, tick = HANDLES.acquire(table, files[:1])
        try:
            return read_rows(fds[0], row_bufs, offsets.tolist())
        finally:
            HANDLES.release(tick)
    limit = HANDLES.limit
    if len(files) <= limit or len(groups := np.unique(files)) <= limit:
        fds, tick = HANDLES.acquire(table, files)
        try:
            return read_rows(fds, row_bufs, offsets.tolist())
        finally:
            HANDLES.release(tick)
    # More files than may be open at once: a group of files at a time (rare: a request
    # of many rows over a dataset of many more shards than the bound).
    bufs = list(row_bufs)
    group = np.searchsorted(groups, files) // limit
    got = 0
    for g in range(int(group.max()) + 1):
        rows = np.flatnonzero(group == g)
        fds, tick = HANDLES.acquire(table, files[rows])
        try:
            picked = map(bufs.__getitem__, rows.tolist())
            got += read_rows(fds, picked, offsets[rows].tolist())
        finally:
            HANDLES.release(tick)
    return got


def _no_file(k: int) -> int:
    raise StoreError("the dataset is not open")


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


def open_dataset(
    store: str | os.PathLike[str],
    name: str,
    *,
    verify_checksums: bool = False,
    path: str | os.PathLike[str] | None = None,
) -> LocalDataset:
    """Open ``<store>/<name>`` (or the build of ``name`` at ``path``: a kept older version,
    see :mod:`~tokenfeed_server.store.versions`): check the manifest and every shard's
    header and size.

    Raises DatasetNotFound, ManifestError or CorruptShard with the file named and what to
    do. ``verify_checksums`` also hashes every shard (reads the whole dataset).
    """
    validate_dataset_name(name)
    path = Path(store) / name if path is None else Path(path)
    _check_inside(Path(store), path, name)
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
        manifest = _read_manifest(dir_fd, path / MANIFEST_NAME)
        dataset = LocalDataset(name, path, manifest)
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


def _check_inside(store: Path, path: Path, name: str) -> None:
    """Refuse a dataset directory that is a symbolic link out of the store: serving it
    would read whatever the link names on the host (a link within the store is fine)."""
    try:
        real, root = path.resolve(), store.resolve()
    except (OSError, RuntimeError):  # a loop of links
        real, root = Path("/"), store
    if real != root and root not in real.parents and path.is_symlink():
        raise StoreError(
            f"dataset {name!r}: {path} is a symbolic link out of the store (to {real}), "
            "which is refused; move the dataset into the store, or serve the store it is in"
        )


def _read_manifest(dir_fd: int, manifest_path: Path) -> Manifest:
    try:
        fd = os.open(MANIFEST_NAME, _RDONLY | _NOFOLLOW, dir_fd=dir_fd)
        with os.fdopen(fd, "rb") as f:
            text = f.read()
    except OSError as exc:
        raise ManifestError(
            f"{manifest_path}: cannot read manifest ({exc.strerror or exc}); the dataset is "
            "incomplete: re-run tokenfeed-server prepare ... --overwrite"
        ) from exc
    try:
        manifest = Manifest.from_json(text)
    except ManifestError as exc:
        raise ManifestError(
            f"{manifest_path}: {exc}; re-run tokenfeed-server prepare ... --overwrite"
        ) from exc
    # version 3: the piece sidecar is checked for its size now, read only when needed
    from tokenfeed_server.store.sidecar import attach_local_pieces

    attach_local_pieces(manifest, dir_fd, manifest_path.parent)
    return manifest


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
