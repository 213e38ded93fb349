"""Open a dataset validated and read-only; list and name the datasets of a store."""

from __future__ import annotations

import hashlib
import mmap
import os
import re
from pathlib import Path
from types import TracebackType
from typing import Any

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
    shard_size,
)
from tokenfeed_server.store.manifest import Manifest, ShardInfo

__all__ = ["Dataset", "list_datasets", "open_dataset", "validate_dataset_name"]

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
    """An opened, validated dataset: read-only memmaps over its shards.

    Offsets are positions in the dataset's single global token stream.
    """

    def __init__(self, name: str, path: Path, manifest: Manifest) -> None:
        self.name = name
        self.path = path
        self.manifest = manifest
        self.dtype: np.dtype[Any] = DTYPES[manifest.dtype]
        self.n_tokens = manifest.total_tokens
        self.n_documents = manifest.documents
        self.fingerprint = manifest.fingerprint
        self._tokens: list[np.ndarray] = []
        self._index: list[np.ndarray] = []
        self._raw: list[np.memmap[Any, np.dtype[np.uint8]]] = []
        bounds = [0]
        for shard in manifest.shards:
            bounds.append(bounds[-1] + shard.tokens)
        # bounds[k] = global offset of shard k's first token; bounds[-1] = n_tokens.
        self._bounds = np.asarray(bounds, dtype=np.int64)
        self._bounds_list = bounds

    def _attach(self) -> None:
        itemsize = self.dtype.itemsize
        for shard in self.manifest.shards:
            path = self.path / shard.name
            _check_shard_file(path, shard, self.manifest.dtype)
            raw = np.memmap(path, dtype=np.uint8, mode="r")
            # Windows are read at random: readahead and fault-around would map (and
            # count in the server's PSS) whole neighbourhoods of pages nobody asked for.
            handle = getattr(raw, "_mmap", None)  # the mmap.mmap numpy keeps behind it
            if handle is not None and hasattr(mmap, "MADV_RANDOM"):
                handle.madvise(mmap.MADV_RANDOM)
            tok_end = HEADER_SIZE + shard.tokens * itemsize
            idx_start = index_offset(shard.tokens, itemsize)
            self._raw.append(raw)
            self._tokens.append(raw[HEADER_SIZE:tok_end].view(self.dtype))
            self._index.append(raw[idx_start : idx_start + 8 * shard.documents].view("<u8"))

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
        """Tokens ``[start, stop)`` of the stream: a read-only view, or a copy across shards."""
        start, stop = int(start), int(stop)
        self._check_range(start, stop)
        k = int(np.searchsorted(self._bounds, start, side="right")) - 1
        k = min(k, len(self._tokens) - 1)
        base = self._bounds_list[k]
        if stop <= self._bounds_list[k + 1]:
            return self._tokens[k][start - base : stop - base]
        out = np.empty(stop - start, dtype=self.dtype)
        self._copy_into(out, start, k)
        return out

    def _copy_into(self, out: np.ndarray, start: int, k: int) -> None:
        """Fill ``out`` with the stream from ``start``, beginning in shard ``k``."""
        pos, done, n = start, 0, len(out)
        while done < n:
            base, end = self._bounds_list[k], self._bounds_list[k + 1]
            take = min(n - done, end - pos)
            out[done : done + take] = self._tokens[k][pos - base : pos - base + take]
            done += take
            pos += take
            k += 1

    def gather(
        self, starts: npt.ArrayLike, length: int, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Rows ``out[i] = stream[starts[i] : starts[i] + length]`` (the server's hot path).

        One slice copy per row straight from the memmap; a row that crosses a shard
        boundary is stitched from both shards. ``out``, if given, must be a C-contiguous
        ``(len(starts), length)`` array of the store's dtype.
        """
        starts_arr = np.asarray(starts, dtype=np.int64).reshape(-1)
        length = int(length)
        n = len(starts_arr)
        if out is None:
            out = np.empty((n, length), dtype=self.dtype)
        elif out.shape != (n, length) or out.dtype != self.dtype:
            raise ValueError(
                f"out has shape {out.shape} and dtype {out.dtype}; expected "
                f"{(n, length)} and {self.dtype}"
            )
        if n == 0 or length == 0:
            return out
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        lo, hi = int(starts_arr.min()), int(starts_arr.max())
        if lo < 0 or hi + length > self.n_tokens:
            bad = lo if lo < 0 else hi
            raise IndexError(
                f"window [{bad}, {bad + length}) is outside dataset {self.name!r} "
                f"of {self.n_tokens} tokens"
            )
        if len(self._tokens) == 1:
            tokens = self._tokens[0]
            for i, s in enumerate(starts_arr.tolist()):
                out[i] = tokens[s : s + length]
            return out
        first = np.searchsorted(self._bounds, starts_arr, side="right") - 1
        last = np.searchsorted(self._bounds, starts_arr + (length - 1), side="right") - 1
        bounds = self._bounds_list
        for i, (s, k, k_last) in enumerate(
            zip(starts_arr.tolist(), first.tolist(), last.tolist(), strict=True)
        ):
            if k == k_last:
                base = bounds[k]
                out[i] = self._tokens[k][s - base : s - base + length]
            else:
                self._copy_into(out[i], s, k)
        return out

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        """int64 global offsets of the documents that start in ``[start, stop)``, sorted."""
        start, stop = int(start), int(stop)
        self._check_range(start, stop)
        parts: list[np.ndarray] = []
        for k, index in enumerate(self._index):
            base, end = self._bounds_list[k], self._bounds_list[k + 1]
            if end <= start or base >= stop or len(index) == 0:
                continue
            a = int(np.searchsorted(index, max(start - base, 0), side="left"))
            b = int(np.searchsorted(index, stop - base, side="left"))
            parts.append(index[a:b].astype(np.int64) + base)
        if not parts:
            return np.empty(0, dtype=np.int64)
        return np.concatenate(parts)

    def verify_checksums(self) -> None:
        """Hash every shard and compare with the manifest; raise CorruptShard naming the file."""
        for shard in self.manifest.shards:
            path = self.path / shard.name
            algo, _, expected = shard.checksum.partition(":")
            actual = _file_checksum(path, algo, HEADER_SIZE)
            if actual != expected:
                raise CorruptShard(
                    f"{path}: checksum mismatch ({algo} {actual} != manifest {expected}); the "
                    f"shard is corrupt: re-run tokenfeed-server prepare ... --dataset "
                    f"{self.name} --overwrite"
                )

    def close(self) -> None:
        """Drop the memmaps (views already handed out stay valid until they are freed)."""
        self._tokens.clear()
        self._index.clear()
        self._raw.clear()


def _check_shard_file(path: Path, shard: ShardInfo, dtype: str) -> None:
    fix = "re-run tokenfeed-server prepare ... --overwrite to rebuild the dataset"
    itemsize = DTYPES[dtype].itemsize
    try:
        with path.open("rb") as f:
            head = f.read(HEADER_SIZE)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise CorruptShard(f"{path}: shard file is missing; {fix}") from None
    except OSError as exc:
        raise CorruptShard(f"{path}: cannot read shard: {exc}; {fix}") from exc
    if len(head) < HEADER_SIZE:
        raise CorruptShard(f"{path}: truncated header ({size} bytes); {fix}")
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
        raise CorruptShard(f"{path}: {'; '.join(problems)}; {fix}")


def _file_checksum(path: Path, algo: str, skip: int) -> str:
    if algo != CHECKSUM_ALGO:
        raise CorruptShard(f"{path}: unknown checksum algorithm {algo!r}")
    hasher = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        f.seek(skip)
        while chunk := f.read(_HASH_CHUNK):
            hasher.update(chunk)
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
    if not path.is_dir():
        known = ", ".join(list_datasets(store)) or "none"
        raise DatasetNotFound(
            f"no dataset {name!r} in store {store} (datasets: {known}); "
            "create it with tokenfeed-server prepare"
        )
    try:
        text = manifest_path.read_bytes()
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
    dataset = Dataset(name, path, manifest)
    dataset._attach()
    if verify_checksums:
        dataset.verify_checksums()
    return dataset


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
        valid = _NAME_RE.fullmatch(entry.name) and ".." not in entry.name
        if valid and (entry / MANIFEST_NAME).is_file():
            names.append(entry.name)
    return sorted(names)
