"""The on-disk dataset format: write a dataset atomically, open it validated and read-only.

A *store* is a directory; a *dataset* is ``<store>/<name>/`` holding ``manifest.json``,
the shard files it lists, and optional extra files (for example the ``tokenizer.json``
that produced the tokens). The dataset is one global token stream: its shards
concatenated in manifest order. Every document ends with the tokenizer's EOS id; a
document may continue from one shard into the next.

Shard file ``shard-NNNNNN.bin`` (all integers little-endian)::

    offset  size  field
    0       8     magic  b"TKFSHARD"
    8       4     format version (uint32, = FORMAT_VERSION)
    12      4     dtype code (uint32: 1 = uint16, 2 = uint32)
    16      8     token count T (uint64)
    24      8     document count D (uint64)
    32      8     byte offset of the document index (uint64)
    40      24    reserved, zero
    64      T*s   tokens (s = 2 or 4 bytes), then zero padding to a multiple of 8 bytes
    ...     D*8   document index: uint64 start offsets of the documents that *start* in
                  this shard, local to the shard, increasing

So a shard's exact size is ``64 + pad8(T*s) + 8*D``, which :func:`open_dataset` checks
along with every header field against the manifest. The checksum in the manifest
(``blake2b-128:<hex>``) covers every byte after the header; it is computed while
writing, so writing never reads a shard back. blake2b is in the standard library, so
``tokenfeed`` (the client distribution) can verify a store without xxhash; at ~1 GB/s it
is fast enough for a check that runs once per open, and only when asked.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import mmap
import os
import re
import secrets
import shutil
import struct
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenfeed.errors import (
    CorruptShard,
    DatasetExists,
    DatasetNotFound,
    InvalidDatasetName,
    ManifestError,
    PrepareError,
    StoreError,
)

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MANIFEST_NAME",
    "TEMP_PREFIX",
    "Dataset",
    "DatasetWriter",
    "Manifest",
    "ShardInfo",
    "TokenizerInfo",
    "clean_stale_temp_dirs",
    "list_datasets",
    "make_temp_dir",
    "open_dataset",
    "validate_dataset_name",
    "write_dataset",
]

FORMAT_VERSION: int = 1
MAGIC = b"TKFSHARD"
HEADER_SIZE = 64
MANIFEST_NAME = "manifest.json"
TEMP_PREFIX = ".tmp-"
CHECKSUM_ALGO = "blake2b-128"

_HEADER = struct.Struct("<8sIIQQQ24x")
_DTYPE_CODES: dict[str, int] = {"uint16": 1, "uint32": 2}
_DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HASH_CHUNK = 1 << 24
# add() batches small documents so the per-document cost is a list append, not numpy calls.
_PENDING_TOKENS = 1 << 20


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


def dtype_for_vocab(vocab_size: int) -> str:
    """The token dtype name for a vocabulary: uint16 when every id fits, else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(frozen=True)
class TokenizerInfo:
    """Identity of the tokenizer that produced a dataset's tokens."""

    kind: str
    vocab_size: int
    eos_id: int
    file_hash: str | None = None
    file: str | None = None

    def __post_init__(self) -> None:
        if self.vocab_size < 1 or self.vocab_size > 1 << 32:
            raise ValueError(f"vocab_size must be in [1, 2**32], got {self.vocab_size}")
        if not 0 <= self.eos_id < self.vocab_size:
            raise ValueError(
                f"eos_id {self.eos_id} is outside the vocabulary [0, {self.vocab_size})"
            )


@dataclass(frozen=True)
class ShardInfo:
    """One shard as listed in the manifest."""

    name: str
    tokens: int
    documents: int
    checksum: str


@dataclass(frozen=True)
class Manifest:
    """The content of ``manifest.json``: everything needed to open and trust a dataset."""

    format_version: int
    name: str
    dtype: str
    tokenizer: TokenizerInfo
    total_tokens: int
    documents: int
    shuffle_seed: int
    shards: tuple[ShardInfo, ...]
    created: str
    extra_files: tuple[str, ...] = field(default=())

    def _content(self) -> dict[str, Any]:
        data = asdict(self)
        data["shards"] = [asdict(s) for s in self.shards]
        data["extra_files"] = list(self.extra_files)
        return data

    def to_json(self) -> str:
        """Serialize to the JSON text of ``manifest.json``."""
        return json.dumps(self._content(), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse and check ``manifest.json`` text; raise ManifestError on any problem."""
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise TypeError("top level is not an object")
            version = data["format_version"]
            if version != FORMAT_VERSION:
                raise ManifestError(
                    f"format version {version!r} is not supported (this tokenfeed reads "
                    f"version {FORMAT_VERSION}); re-run prepare with this version"
                )
            manifest = cls(
                format_version=int(version),
                name=str(data["name"]),
                dtype=str(data["dtype"]),
                tokenizer=TokenizerInfo(**data["tokenizer"]),
                total_tokens=_int(data["total_tokens"]),
                documents=_int(data["documents"]),
                shuffle_seed=_int(data["shuffle_seed"]),
                shards=tuple(
                    ShardInfo(
                        name=str(s["name"]),
                        tokens=_int(s["tokens"]),
                        documents=_int(s["documents"]),
                        checksum=str(s["checksum"]),
                    )
                    for s in data["shards"]
                ),
                created=str(data["created"]),
                extra_files=tuple(str(f) for f in data.get("extra_files", ())),
            )
        except ManifestError:
            raise
        except (ValueError, TypeError, KeyError) as exc:
            raise ManifestError(f"malformed manifest: {type(exc).__name__}: {exc}") from exc
        manifest._check()
        return manifest

    def _check(self) -> None:
        if self.dtype not in _DTYPES:
            raise ManifestError(f"unknown dtype {self.dtype!r} (expected uint16 or uint32)")
        if self.dtype != dtype_for_vocab(self.tokenizer.vocab_size) and self.dtype != "uint32":
            raise ManifestError(
                f"dtype {self.dtype} cannot hold vocab_size {self.tokenizer.vocab_size}"
            )
        if not self.shards:
            raise ManifestError("manifest lists no shards")
        if sum(s.tokens for s in self.shards) != self.total_tokens:
            raise ManifestError("total_tokens differs from the sum of the shards' tokens")
        if sum(s.documents for s in self.shards) != self.documents:
            raise ManifestError("documents differs from the sum of the shards' documents")
        names = [s.name for s in self.shards] + list(self.extra_files)
        for name in names:
            if not _is_plain_file_name(name):
                raise ManifestError(f"file name {name!r} in the manifest is not a plain name")
        if len(set(names)) != len(names) or MANIFEST_NAME in names:
            raise ManifestError("manifest lists a file twice")

    @property
    def fingerprint(self) -> str:
        """A stable hash of the content (not of ``created``): equal iff same token stream.

        Clients compare it across reconnects to notice that a dataset was replaced.
        """
        content = self._content()
        del content["created"]
        blob = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(blob, digest_size=16).hexdigest()


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


def _is_plain_file_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name


def _padded(nbytes: int) -> int:
    return (nbytes + 7) & ~7


def _shard_size(tokens: int, documents: int, itemsize: int) -> int:
    return HEADER_SIZE + _padded(tokens * itemsize) + 8 * documents


# ---------------------------------------------------------------------------- reading


class Dataset:
    """An opened, validated dataset: read-only memmaps over its shards.

    Offsets are positions in the dataset's single global token stream.
    """

    def __init__(self, name: str, path: Path, manifest: Manifest) -> None:
        self.name = name
        self.path = path
        self.manifest = manifest
        self.dtype: np.dtype[Any] = _DTYPES[manifest.dtype]
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
            idx_start = HEADER_SIZE + _padded(shard.tokens * itemsize)
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
    itemsize = _DTYPES[dtype].itemsize
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
    magic, version, code, tokens, documents, index_offset = _HEADER.unpack(head)
    problems = []
    if magic != MAGIC:
        problems.append(f"bad magic {magic!r}, not a tokenfeed shard")
    elif version != FORMAT_VERSION:
        problems.append(f"format version {version}, expected {FORMAT_VERSION}")
    else:
        if code != _DTYPE_CODES[dtype]:
            problems.append(f"dtype code {code}, manifest says {dtype}")
        if tokens != shard.tokens:
            problems.append(f"header has {tokens} tokens, manifest {shard.tokens}")
        if documents != shard.documents:
            problems.append(f"header has {documents} documents, manifest {shard.documents}")
        if index_offset != HEADER_SIZE + _padded(shard.tokens * itemsize):
            problems.append(f"document index offset {index_offset} is inconsistent")
        expected = _shard_size(shard.tokens, shard.documents, itemsize)
        if size != expected:
            what = "truncated" if size < expected else "has trailing bytes"
            problems.append(f"file {what}: {size} bytes, expected {expected}")
    if problems:
        raise CorruptShard(f"{path}: {'; '.join(problems)}; {fix}")


def _file_checksum(path: Path, algo: str, skip: int) -> str:
    if algo == CHECKSUM_ALGO:
        hasher: Any = hashlib.blake2b(digest_size=16)
    elif algo == "xxh3_64":
        try:
            import xxhash
        except ImportError:
            raise CorruptShard(f"{path}: checksum {algo} needs the xxhash package") from None
        hasher = xxhash.xxh3_64()
    else:
        raise CorruptShard(f"{path}: unknown checksum algorithm {algo!r}")
    with path.open("rb") as f:
        f.seek(skip)
        while chunk := f.read(_HASH_CHUNK):
            hasher.update(chunk)
    return str(hasher.hexdigest())


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


# ---------------------------------------------------------------------------- writing


def make_temp_dir(store: str | os.PathLike[str], label: str) -> Path:
    """Create ``<store>/.tmp-<label>-<pid>-<random>``; the pid lets a later run spot orphans."""
    root = Path(store)
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{TEMP_PREFIX}{label}-{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def clean_stale_temp_dirs(store: str | os.PathLike[str]) -> list[Path]:
    """Remove temp dirs left by writers that died (pid no longer alive on this host)."""
    root = Path(store)
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        if not entry.name.startswith(TEMP_PREFIX) or not entry.is_dir():
            continue
        try:
            pid = int(entry.name.rsplit("-", 2)[-2])
        except (ValueError, IndexError):
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


class _ShardFile:
    """One shard being written: body streamed and hashed, header written last."""

    def __init__(self, path: Path, dtype: str) -> None:
        self.path = path
        self.dtype = dtype
        self.tokens = 0
        self.starts: list[np.ndarray] = []
        self.hasher = hashlib.blake2b(digest_size=16)
        self.file = path.open("wb")
        self.file.write(b"\0" * HEADER_SIZE)

    def write(self, tokens: np.ndarray, starts: np.ndarray) -> None:
        data = np.ascontiguousarray(tokens).data.cast("B")
        self.file.write(data)
        self.hasher.update(data)
        if len(starts):
            self.starts.append(starts + self.tokens)
        self.tokens += len(tokens)

    def finish(self) -> ShardInfo:
        itemsize = _DTYPES[self.dtype].itemsize
        pad = _padded(self.tokens * itemsize) - self.tokens * itemsize
        index = (
            np.concatenate(self.starts).astype("<u8") if self.starts else np.empty(0, dtype="<u8")
        )
        tail = b"\0" * pad + index.tobytes()
        self.file.write(tail)
        self.hasher.update(tail)
        header = _HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            _DTYPE_CODES[self.dtype],
            self.tokens,
            len(index),
            HEADER_SIZE + _padded(self.tokens * itemsize),
        )
        self.file.seek(0)
        self.file.write(header)
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return ShardInfo(
            name=self.path.name,
            tokens=self.tokens,
            documents=len(index),
            checksum=f"{CHECKSUM_ALGO}:{self.hasher.hexdigest()}",
        )

    def close(self) -> None:
        self.file.close()


class DatasetWriter:
    """Streams documents into a new dataset, atomically.

    Everything goes to ``<store>/.tmp-<name>-...``; :meth:`commit` fsyncs and renames it
    into place, :meth:`abort` (or leaving the ``with`` block by an exception) removes it.
    Documents are given *without* EOS: the writer appends ``tokenizer.eos_id`` to each.
    """

    def __init__(
        self,
        store: str | os.PathLike[str],
        name: str,
        *,
        tokenizer: TokenizerInfo,
        shuffle_seed: int,
        shard_tokens: int = 1 << 26,
        overwrite: bool = False,
        extra_files: Mapping[str, Path] | None = None,
    ) -> None:
        self.store = Path(store)
        self.name = validate_dataset_name(name)
        self.final_path = self.store / name
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
        self.tokenizer = tokenizer
        self.shuffle_seed = int(shuffle_seed)
        self.shard_tokens = int(shard_tokens)
        self.overwrite = overwrite
        self.extra_files = dict(extra_files or {})
        for extra in self.extra_files:
            if (
                not _is_plain_file_name(extra)
                or extra == MANIFEST_NAME
                or extra.startswith("shard-")
            ):
                raise ValueError(f"extra file name {extra!r} is not allowed")
        self.dtype_name = dtype_for_vocab(tokenizer.vocab_size)
        self.dtype = _DTYPES[self.dtype_name]
        self._check_exists()
        self.tmp = make_temp_dir(self.store, name)
        self._shards: list[ShardInfo] = []
        self._current: _ShardFile | None = None
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._documents = 0
        self._done = False

    def _check_exists(self) -> None:
        if not self.overwrite and self.final_path.exists():
            raise DatasetExists(
                f"dataset {self.name!r} already exists in {self.store}; pass --overwrite "
                "(overwrite=True) to replace it"
            )

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._done:
            self.abort()

    def add(self, document: npt.ArrayLike) -> None:
        """Append one document (a 1-D array of token ids, without EOS)."""
        doc = np.asarray(document)
        if doc.ndim != 1:
            raise ValueError(f"a document must be a 1-D array, got shape {doc.shape}")
        if doc.size == 0:
            doc = doc.astype(self.dtype)  # [] arrives as float64
        self._pending.append(doc)
        self._pending_tokens += len(doc) + 1
        if self._pending_tokens >= _PENDING_TOKENS:
            self._flush_pending()

    def _flush_pending(self) -> None:
        if not self._pending:
            return
        docs, self._pending, self._pending_tokens = self._pending, [], 0
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        tokens = np.concatenate(docs) if len(docs) > 1 else docs[0]
        self.add_batch(tokens, lengths)

    def add_batch(self, tokens: npt.ArrayLike, lengths: npt.ArrayLike) -> None:
        """Append ``len(lengths)`` documents stored back to back in ``tokens`` (no EOS)."""
        if self._done:
            raise StoreError("the writer is already committed or aborted")
        # Keep document order when add() and add_batch() are mixed.
        self._flush_pending()
        self._write_batch(np.asarray(tokens), np.asarray(lengths, dtype=np.int64))

    def _write_batch(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        if tokens.ndim != 1 or lengths.ndim != 1:
            raise ValueError("tokens and lengths must be 1-D arrays")
        if len(lengths) == 0:
            if len(tokens):
                raise ValueError("tokens given without lengths")
            return
        if int(lengths.min()) < 0 or int(lengths.sum()) != len(tokens):
            raise ValueError(
                f"lengths sum to {int(lengths.sum())} but there are {len(tokens)} tokens"
            )
        tokens = self._as_store_dtype(tokens)
        ends = np.cumsum(lengths)
        with_eos = np.insert(tokens, ends, self.tokenizer.eos_id)
        starts = ends - lengths + np.arange(len(lengths))
        self._documents += len(lengths)
        self._write_stream(with_eos, starts)

    def _as_store_dtype(self, tokens: np.ndarray) -> np.ndarray:
        if len(tokens) == 0:
            return tokens.astype(self.dtype)
        if tokens.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got dtype {tokens.dtype}")
        full_range = self.tokenizer.vocab_size == 1 << (8 * self.dtype.itemsize)
        if tokens.dtype == self.dtype and full_range:
            return tokens
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.tokenizer.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"token id {bad} is outside the vocabulary [0, {self.tokenizer.vocab_size})"
            )
        return tokens.astype(self.dtype, copy=False)

    def _write_stream(self, tokens: np.ndarray, starts: np.ndarray) -> None:
        """Append to the stream, cutting shards at exactly ``shard_tokens`` tokens."""
        pos = 0
        n = len(tokens)
        while pos < n:
            if self._current is None:
                shard_path = self.tmp / f"shard-{len(self._shards):06d}.bin"
                self._current = _ShardFile(shard_path, self.dtype_name)
            take = min(self.shard_tokens - self._current.tokens, n - pos)
            a = int(np.searchsorted(starts, pos, side="left"))
            b = int(np.searchsorted(starts, pos + take, side="left"))
            self._current.write(tokens[pos : pos + take], starts[a:b] - pos)
            pos += take
            if self._current.tokens >= self.shard_tokens:
                self._shards.append(self._current.finish())
                self._current = None

    def commit(self) -> Manifest:
        """Finish the last shard, write the manifest, fsync, and rename into place."""
        self._flush_pending()
        if self._current is not None:
            self._shards.append(self._current.finish())
            self._current = None
        if not self._shards:
            self.abort()
            raise PrepareError(f"dataset {self.name!r} would be empty: no documents were given")
        try:
            for extra, source in self.extra_files.items():
                shutil.copyfile(source, self.tmp / extra)
                with (self.tmp / extra).open("rb") as f:
                    os.fsync(f.fileno())
            manifest = Manifest(
                format_version=FORMAT_VERSION,
                name=self.name,
                dtype=self.dtype_name,
                tokenizer=self.tokenizer,
                total_tokens=sum(s.tokens for s in self._shards),
                documents=self._documents,
                shuffle_seed=self.shuffle_seed,
                shards=tuple(self._shards),
                created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                extra_files=tuple(sorted(self.extra_files)),
            )
            with (self.tmp / MANIFEST_NAME).open("w", encoding="utf-8") as f:
                f.write(manifest.to_json())
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(self.tmp)
            self._publish()
        except BaseException:
            self.abort()
            raise
        self._done = True
        return manifest

    def _publish(self) -> None:
        self._check_exists()
        if not self.final_path.exists():
            # rename() onto a missing path is atomic; a racing writer that got there first
            # makes it fail (ENOTEMPTY/EEXIST) rather than be silently replaced.
            try:
                os.rename(self.tmp, self.final_path)
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise DatasetExists(
                        f"dataset {self.name!r} appeared in {self.store} while writing; "
                        "pass --overwrite to replace it"
                    ) from exc
                raise
        elif _exchange(self.tmp, self.final_path):
            # The old dataset now sits in our temp dir: readers never see a gap.
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            old = self.store / f"{TEMP_PREFIX}{self.name}-{os.getpid()}-old{secrets.token_hex(2)}"
            os.rename(self.final_path, old)
            os.rename(self.tmp, self.final_path)
            shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(self.store)

    def abort(self) -> None:
        """Discard everything written so far (idempotent)."""
        self._done = True
        if self._current is not None:
            self._current.close()
            self._current = None
        self._pending.clear()
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)


def write_dataset(
    store: str | os.PathLike[str],
    name: str,
    documents: Iterable[npt.ArrayLike],
    *,
    tokenizer: TokenizerInfo,
    shuffle_seed: int,
    shard_tokens: int = 1 << 26,
    overwrite: bool = False,
    extra_files: Mapping[str, Path] | None = None,
) -> Manifest:
    """Write ``documents`` (token arrays without EOS) as dataset ``name``, atomically.

    The dtype is uint16 when ``tokenizer.vocab_size <= 65536``, else uint32. An existing
    dataset raises DatasetExists unless ``overwrite``; then it is swapped out atomically.
    On any exception nothing is left behind.
    """
    with DatasetWriter(
        store,
        name,
        tokenizer=tokenizer,
        shuffle_seed=shuffle_seed,
        shard_tokens=shard_tokens,
        overwrite=overwrite,
        extra_files=extra_files,
    ) as writer:
        for document in documents:
            writer.add(document)
        return writer.commit()
