"""Write a dataset atomically: build it in a temp directory, publish it with one rename.

Readers never see a half-written dataset: everything goes to ``<store>/.tmp-<name>-...``
and appears under its name only once complete and fsynced. A replaced dataset is
swapped out atomically where the kernel allows it, so a reader opens either version,
never a mix; the build swapped out is kept as a version under
``<store>/_tokenfeed/versions/<name>/<fingerprint>/`` (see
:mod:`~tokenfeed_server.store.versions`), since jobs may be pinned to it. Temp
directories left by writers that died are removed by :func:`clean_stale_temp_dirs`.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import os
import secrets
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import IO, Protocol

import numpy as np
import numpy.typing as npt

from tokenfeed.dtypes import DTYPES, dtype_for_vocab
from tokenfeed.errors import DatasetExists, PrepareError, StoreError
from tokenfeed_server.store.format import (
    CHECKSUM_ALGO,
    DEFAULT_PIECE_BYTES,
    DIGEST_BYTES,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    MIN_PIECE_BYTES,
    PIECES_NAME,
    TEMP_PREFIX,
    is_plain_file_name,
)
from tokenfeed_server.store.manifest import Manifest, ShardInfo, TokenizerInfo
from tokenfeed_server.store.reader import validate_dataset_name
from tokenfeed_server.store.shard_file import ShardFile
from tokenfeed_server.store.versions import build_fingerprint, retire_local_build

__all__ = [
    "BuildTarget",
    "DatasetWriter",
    "clean_stale_temp_dirs",
    "make_temp_dir",
    "release_temp_dir",
    "remove_temp_dir",
    "write_dataset",
]

#: The lock file a writer holds in its temp dir for its lifetime.
LOCK_NAME = ".lock"
_STAGING_PREFIX = ".init-"
# temp dir -> the descriptor holding its lock, for the temp dirs of this process
_held_locks: dict[Path, int] = {}
# add() batches small documents so the per-document cost is a list append, not numpy calls.
_PENDING_TOKENS = 1 << 20
#: the manifest versions a writer can write (1 has no piece checksums: never written)
_WRITABLE = (2, 3)


def make_temp_dir(store: str | os.PathLike[str], label: str) -> Path:
    """Create ``<store>/.tmp-<label>-<pid>-<random>`` and hold its lock until released.

    The directory holds a lock file, locked (``flock``) by this process from before the
    directory appears under its temp name until :func:`release_temp_dir` or the process
    ends, so :func:`clean_stale_temp_dirs` never removes a live writer's directory, from
    whatever host or container it runs. The pid in the name is only for people.
    """
    root = Path(store)
    root.mkdir(parents=True, exist_ok=True)
    suffix = f"{label}-{os.getpid()}-{secrets.token_hex(4)}"
    # Built under a name the cleaner ignores, renamed once locked: no unlocked moment.
    staging = root / f"{_STAGING_PREFIX}{suffix}"
    staging.mkdir()
    fd = os.open(staging / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path = root / f"{TEMP_PREFIX}{suffix}"
        os.rename(staging, path)
    except BaseException:
        os.close(fd)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _held_locks[path] = fd
    return path


def release_temp_dir(path: Path) -> None:
    """Drop the lock of a temp dir made by :func:`make_temp_dir` (idempotent)."""
    fd = _held_locks.pop(path, None)
    if fd is not None:
        os.close(fd)


def remove_temp_dir(path: Path) -> None:
    """Delete a temp dir made by :func:`make_temp_dir`, then drop its lock."""
    shutil.rmtree(path, ignore_errors=True)
    release_temp_dir(path)


def clean_stale_temp_dirs(store: str | os.PathLike[str]) -> list[Path]:
    """Remove the temp dirs whose writer is gone: those whose lock can be taken.

    A directory without a lock file is left alone: a dataset being published (its lock
    file is removed just before the rename) or one from an older tokenfeed.
    """
    root = Path(store)
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        if not entry.name.startswith(TEMP_PREFIX) or entry in _held_locks:
            continue
        try:
            fd = os.open(entry / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # EWOULDBLOCK: its writer is alive
            os.close(fd)
            continue
        try:  # removed while locked, so that two cleaners never race on it
            shutil.rmtree(entry, ignore_errors=True)
        finally:
            os.close(fd)
        removed.append(entry)
    return removed


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


class BuildTarget(Protocol):
    """What :meth:`DatasetWriter.for_build` reads of a prepare run's settings."""

    @property
    def store(self) -> Path: ...

    @property
    def dataset(self) -> str: ...

    @property
    def seed(self) -> int: ...

    @property
    def shard_tokens(self) -> int: ...

    @property
    def overwrite(self) -> bool: ...


class _Sidecar:
    """The version-3 sidecar being written: each shard's raw piece digests appended as
    the shard is finished (nothing held in memory), hashed on the way."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: IO[bytes] = path.open("wb")
        self.hasher = hashlib.blake2b(digest_size=16)
        self.count = 0

    def write(self, raw: bytes) -> None:
        self.file.write(raw)
        self.hasher.update(raw)
        self.count += len(raw) // DIGEST_BYTES

    def finish(self) -> str:
        """fsync and close; the checksum the manifest lists."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return f"{CHECKSUM_ALGO}:{self.hasher.hexdigest()}"


class DatasetWriter:
    """Streams documents into a new dataset, atomically.

    Everything goes to ``<store>/.tmp-<name>-...``; :meth:`commit` fsyncs and renames it
    into place, :meth:`abort` (or leaving the ``with`` block by an exception) removes it.
    Documents are given *without* EOS: the writer appends ``tokenizer.eos_id`` to each.
    The manifest is version 3 unless ``format_version=2``: the checksums of every piece
    of ``piece_bytes`` in the sidecar :data:`~tokenfeed_server.store.format.PIECES_NAME`
    (version 2: in the manifest, per shard).
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
        piece_bytes: int = DEFAULT_PIECE_BYTES,
        format_version: int = MANIFEST_VERSION,
    ) -> None:
        self.store = Path(store)
        if format_version not in _WRITABLE:
            raise ValueError(f"format_version must be one of {_WRITABLE}, got {format_version}")
        self.format_version = format_version
        self.name = validate_dataset_name(name)
        self.final_path = self.store / name
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
        if piece_bytes < MIN_PIECE_BYTES:
            raise ValueError(f"piece_bytes must be >= {MIN_PIECE_BYTES}, got {piece_bytes}")
        self.piece_bytes = int(piece_bytes)
        self.tokenizer = tokenizer
        self.shuffle_seed = int(shuffle_seed)
        self.shard_tokens = int(shard_tokens)
        self.overwrite = overwrite
        self.extra_files = dict(extra_files or {})
        for extra in self.extra_files:
            if (
                not is_plain_file_name(extra)
                or extra in (MANIFEST_NAME, PIECES_NAME)
                or extra.startswith("shard-")
            ):
                raise ValueError(f"extra file name {extra!r} is not allowed")
        self.dtype_name = dtype_for_vocab(tokenizer.vocab_size)
        self.dtype = DTYPES[self.dtype_name]
        self._check_exists()
        self.tmp = make_temp_dir(self.store, name)
        self._shards: list[ShardInfo] = []
        self._current: ShardFile | None = None
        try:
            self._sidecar = _Sidecar(self.tmp / PIECES_NAME) if format_version >= 3 else None
        except BaseException:
            remove_temp_dir(self.tmp)
            raise
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._documents = 0
        self._done = False

    @classmethod
    def for_build(
        cls,
        build: BuildTarget,
        tokenizer: TokenizerInfo,
        extra_files: Mapping[str, Path] | None = None,
    ) -> DatasetWriter:
        """The writer of a prepare run ``build`` (its store, dataset name, seed, shard
        size and overwrite flag): the one way every prepare engine opens its writer."""
        return cls(
            build.store,
            build.dataset,
            tokenizer=tokenizer,
            shuffle_seed=build.seed,
            shard_tokens=build.shard_tokens,
            overwrite=build.overwrite,
            extra_files=extra_files,
        )

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
                self._current = ShardFile(shard_path, self.dtype_name, self.piece_bytes)
            take = min(self.shard_tokens - self._current.tokens, n - pos)
            a = int(np.searchsorted(starts, pos, side="left"))
            b = int(np.searchsorted(starts, pos + take, side="left"))
            self._current.write(tokens[pos : pos + take], starts[a:b] - pos)
            pos += take
            if self._current.tokens >= self.shard_tokens:
                self._finish_shard()

    def _finish_shard(self) -> None:
        assert self._current is not None
        info, raw = self._current.finish()
        self._current = None
        if self._sidecar is not None:
            self._sidecar.write(raw)
        else:
            digests = tuple(
                raw[i : i + DIGEST_BYTES].hex() for i in range(0, len(raw), DIGEST_BYTES)
            )
            info = replace(info, pieces=digests)
        self._shards.append(info)

    def commit(self) -> Manifest:
        """Finish the last shard, write the manifest, fsync, and rename into place."""
        self._flush_pending()
        if self._current is not None:
            self._finish_shard()
        if not self._shards:
            self.abort()
            raise PrepareError(f"dataset {self.name!r} would be empty: no documents were given")
        try:
            for extra, source in self.extra_files.items():
                shutil.copyfile(source, self.tmp / extra)
                with (self.tmp / extra).open("rb") as f:
                    os.fsync(f.fileno())
            sidecar = self._sidecar.finish() if self._sidecar is not None else ""
            manifest = Manifest(
                format_version=self.format_version,
                name=self.name,
                dtype=self.dtype_name,
                tokenizer=self.tokenizer,
                total_tokens=sum(s.tokens for s in self._shards),
                documents=self._documents,
                shuffle_seed=self.shuffle_seed,
                shards=tuple(self._shards),
                created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                extra_files=tuple(sorted(self.extra_files)),
                piece_bytes=self.piece_bytes,
                pieces_file=PIECES_NAME if sidecar else "",
                pieces_checksum=sidecar,
            )
            with (self.tmp / MANIFEST_NAME).open("w", encoding="utf-8") as f:
                f.write(manifest.to_json())
                f.flush()
                os.fsync(f.fileno())
            # The lock file must not be published; the lock itself stays held (the open
            # descriptor) and a cleaner leaves a temp dir without a lock file alone.
            os.unlink(self.tmp / LOCK_NAME)
            _fsync_dir(self.tmp)
            self._publish()
        except BaseException:
            self.abort()
            raise
        self._done = True
        release_temp_dir(self.tmp)
        if self._sidecar is not None:
            path = self.final_path / PIECES_NAME
            manifest.attach_pieces(path.read_bytes, str(path))
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
            self._retire(self.tmp)
        else:
            old = self.store / f"{TEMP_PREFIX}{self.name}-{os.getpid()}-old{secrets.token_hex(2)}"
            os.rename(self.final_path, old)
            os.rename(self.tmp, self.final_path)
            self._retire(old)
        _fsync_dir(self.store)

    def _retire(self, old: Path) -> None:
        """Keep the build just swapped out as a version: a job (or a checkpoint) may be
        pinned to it. Kept too when it has this build's content (same fingerprint): a job
        reading it reopens its files by name in its directory, so deleting it would fail
        that job (see :func:`~tokenfeed_server.store.versions.retire_local_build`)."""
        retire_local_build(self.store, self.name, old, build_fingerprint(old))

    def abort(self) -> None:
        """Discard everything written so far (idempotent)."""
        self._done = True
        if self._current is not None:
            self._current.close()
            self._current = None
        if self._sidecar is not None:
            self._sidecar.file.close()
        self._pending.clear()
        remove_temp_dir(self.tmp)


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
    piece_bytes: int = DEFAULT_PIECE_BYTES,
    format_version: int = MANIFEST_VERSION,
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
        piece_bytes=piece_bytes,
        format_version=format_version,
    ) as writer:
        for document in documents:
            writer.add(document)
        return writer.commit()
