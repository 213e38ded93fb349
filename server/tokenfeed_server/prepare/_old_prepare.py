"""The prepare pipeline: raw corpus -> tokenized, globally pre-shuffled dataset.

Two passes, memory bounded by ``PrepareConfig.memory_mb`` and never by the corpus size:

1. *Scatter*: documents are read in order and tokenized in chunks, in this process by
   default (``workers > 1``: by a process pool, at most ``2 * workers`` chunks in
   flight). A document longer than a chunk is encoded in pieces (see
   :meth:`~tokenfeed_server.prepare.tokenizer.Tokenizer.encode_batch`). Each document gets the
   random 64-bit key of its identity (:mod:`tokenfeed_server.prepare.doc_order`); its tokens go
   to the on-disk bucket named by the key's top bits. Bucket writes are buffered and
   flushed when the buffers reach a quarter of the budget.
2. *Gather*: buckets are loaded one at a time, their documents sorted by key, and
   streamed into :class:`~tokenfeed_server.store.writer.DatasetWriter`, which cuts shards
   at fixed offsets of the token stream. A bucket larger
   than its share of the budget is split on disk by the next key bits first
   (recursively).

A ``bpe:VOCAB`` tokenizer is first trained on the first ``bpe_train_mb`` of the inputs.

So the output order is "all documents sorted by ``(key, path, record)``": a uniform global
shuffle that depends only on the seed and the corpus, not on the memory budget, the
number of workers, how buckets were split, or the engine (``engine="ray"`` runs the same
steps on a Ray cluster: :mod:`tokenfeed_server.prepare.ray_engine`). The writer and all scratch
files live in ``.tmp-`` directories inside the store, removed on any error or interrupt
(and, after a SIGKILL, by the next run).

Object storage (:func:`prepare_objects`): ``s3://`` inputs are downloaded into a scratch
directory first (not streamed: the scatter pass reads each file once, but a download is
retried and resumable per object, and the same local code then runs unchanged); a
``s3://`` store gets the dataset written into a scratch store, then published by
:func:`~tokenfeed_server.store.publish.publish_dataset` (files first, the manifest last).
The scratch directory (``--scratch-dir``, default the system temp dir) needs room for the
downloaded inputs, the scratch buckets and the shards, and is removed in every case.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import multiprocessing
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from tokenfeed.errors import DatasetExists, PrepareError, StoreFull
from tokenfeed_server.prepare.corpus import (
    CorpusStats,
    estimate_text_bytes,
    expand_inputs,
    iter_documents,
    iter_records,
    walked,
)
from tokenfeed_server.prepare.doc_order import CorpusFiles, corpus_files, document_keys
from tokenfeed_server.prepare.progress import Progress
from tokenfeed_server.store.format import MANIFEST_NAME
from tokenfeed_server.store.manifest import Manifest
from tokenfeed_server.store.objects import ObjectStore, S3Location
from tokenfeed_server.store.publish import publish_dataset
from tokenfeed_server.store.reader import validate_dataset_name
from tokenfeed_server.store.writer import (
    DatasetWriter,
    clean_stale_temp_dirs,
    make_temp_dir,
    remove_temp_dir,
)
from tokenfeed_server.prepare.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, parse_spec, train_bpe

__all__ = [
    "PrepareConfig",
    "PrepareStats",
    "StoreFull",
    "demo_corpus_paths",
    "document_keys",
    "download_inputs",
    "prepare",
    "prepare_objects",
]

log = logging.getLogger(__name__)

_MAX_BUCKET_BITS = 12
_SPLIT_BITS = 4
_CHUNK_DOCS = 4096
# A bucket's index: per document its length, key, file rank and record number.
_IDX_COLUMNS = 4
_IDX_BYTES = 8 * _IDX_COLUMNS

Engine = Literal["local", "ray"]


# write() errors that mean "no room": a full disk, a full quota, a file-size limit.
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


@dataclass(frozen=True)
class PrepareConfig:
    """Everything one prepare run needs; built once (by the CLI) and passed down."""

    inputs: tuple[Path, ...]
    store: Path
    dataset: str
    tokenizer: str = "byte"
    seed: int = 0
    text_field: str = "text"
    skip_bad: bool = False
    overwrite: bool = False
    memory_mb: float = 512.0
    workers: int = 0  # 0 or 1: tokenize in this process; more: a pool of that many
    shard_tokens: int = 1 << 26
    eos_token: str | None = None
    progress: bool | None = None  # None: a bar on a terminal, log lines otherwise
    bpe_train_mb: float = 64.0  # bpe:VOCAB trains on this many MB, the inputs' first
    engine: Engine = "local"  # "ray": tokenize and sort on a Ray cluster (same bytes)
    ray_address: str | None = None  # a Ray cluster to join; None: RAY_ADDRESS, or a local one

    @property
    def memory_bytes(self) -> int:
        """The memory budget in bytes."""
        return int(self.memory_mb * (1 << 20))

    @property
    def bpe_train_bytes(self) -> int:
        """The cap on the text a ``bpe:VOCAB`` tokenizer trains on, in bytes."""
        return int(self.bpe_train_mb * (1 << 20))

    def resolved_workers(self) -> int:
        """Tokenizer processes (>= 1); auto (0) means tokenize in this process.

        In-process is the default because a pool measured slower for both tokenizers
        (benchmarks/bench_prepare.py): the byte tokenizer is a memcpy that a pool only adds
        IPC to, and tokenizers' Rust encode_batch already uses every core in-process.
        """
        return self.workers if self.workers > 0 else 1


@dataclass
class PrepareStats:
    """What a run did; filled in by :func:`prepare` for the CLI, tests and benchmarks."""

    corpus: CorpusStats = field(default_factory=CorpusStats)
    tokens: int = 0
    buckets: int = 0
    bucket_splits: int = 0
    peak_bucket_bytes: int = 0
    seconds: float = 0.0


# ------------------------------------------------------------------ buckets on disk


class _Buckets:
    """Documents scattered into ``n = 2**bits`` bucket files by bits of their key.

    Bucket ``b`` is ``b<b>.tok`` (tokens back to back) and ``b<b>.idx`` (per document:
    uint64 length, key, file rank, record). ``shift`` selects which key bits pick the
    bucket; documents with equal keys share a bucket, so each sorts completely on its own.
    """

    def __init__(
        self, directory: Path, bits: int, shift: int, dtype: np.dtype[Any], flush_bytes: int
    ) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.n = 1 << bits
        self.shift = np.uint64(shift)
        self.mask = np.uint64(self.n - 1)
        self.dtype = dtype
        self.flush_bytes = flush_bytes
        self._tok: list[list[np.ndarray]] = [[] for _ in range(self.n)]
        self._idx: list[list[np.ndarray]] = [[] for _ in range(self.n)]
        self._buffered = 0

    def paths(self, b: int) -> tuple[Path, Path]:
        return self.dir / f"b{b}.tok", self.dir / f"b{b}.idx"

    def add(self, tokens: np.ndarray, lengths: np.ndarray, ids: np.ndarray) -> None:
        """Add documents; ``ids`` is their (key, file rank, record) rows, uint64."""
        keys = ids[:, 0]
        if self.n == 1:
            which = np.zeros(len(lengths), dtype=np.uint16)
        else:
            which = ((keys >> self.shift) & self.mask).astype(np.uint16)
        # Group by bucket keeping input order inside each (stable radix sort on uint16).
        doc_order = np.argsort(which, kind="stable")
        tok_order = np.argsort(np.repeat(which, lengths), kind="stable")
        doc_counts = np.bincount(which, minlength=self.n)
        tok_counts = np.bincount(which, weights=lengths, minlength=self.n).astype(np.int64)
        idx = np.column_stack([lengths.astype(np.uint64), ids])[doc_order]
        grouped = tokens[tok_order]
        d = t = 0
        for b in np.flatnonzero(doc_counts).tolist():
            nd, nt = int(doc_counts[b]), int(tok_counts[b])
            self._idx[b].append(idx[d : d + nd])
            self._tok[b].append(grouped[t : t + nt])
            d += nd
            t += nt
        self._buffered += grouped.nbytes + idx.nbytes
        if self._buffered >= self.flush_bytes:
            self.flush()

    def flush(self) -> None:
        for b in range(self.n):
            if not self._idx[b]:
                continue
            tok_path, idx_path = self.paths(b)
            with tok_path.open("ab") as f:
                for arr in self._tok[b]:
                    f.write(arr.data.cast("B"))
            with idx_path.open("ab") as f:
                for arr in self._idx[b]:
                    f.write(np.ascontiguousarray(arr).data.cast("B"))
            self._tok[b].clear()
            self._idx[b].clear()
        self._buffered = 0


def _iter_bucket_pieces(
    tok_path: Path, idx_path: Path, dtype: np.dtype[Any], max_bytes: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Stream a bucket as (tokens, lengths, ids) pieces of about ``max_bytes``."""
    docs_per_read = max(1, max_bytes // _IDX_BYTES)
    with tok_path.open("rb") as tok_f, idx_path.open("rb") as idx_f:
        while True:
            idx = np.fromfile(idx_f, dtype=np.uint64, count=_IDX_COLUMNS * docs_per_read)
            idx = idx.reshape(-1, _IDX_COLUMNS)
            if len(idx) == 0:
                return
            lengths = idx[:, 0].astype(np.int64)
            ends = np.cumsum(lengths) * dtype.itemsize
            start = 0
            while start < len(idx):
                base = int(ends[start - 1]) if start else 0
                stop = int(np.searchsorted(ends, base + max_bytes, side="right"))
                stop = max(stop, start + 1)
                count = int(lengths[start:stop].sum())
                tokens = np.fromfile(tok_f, dtype=dtype, count=count)
                yield tokens, lengths[start:stop], idx[start:stop, 1:]
                start = stop


# ------------------------------------------------------------------ the pipeline


_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _WORKER_TOKENIZER
    # One Rust thread per worker process: the pool already uses every core.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_TOKENIZER = tokenizer


def _encode_chunk(texts: list[str], max_chars: int) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER_TOKENIZER is not None
    return _WORKER_TOKENIZER.encode_batch(texts, max_chars=max_chars)


Chunk = tuple[list[str], list[int], list[int]]


def chunks(records: Iterable[tuple[int, int, str]], max_bytes: int) -> Iterator[Chunk]:
    """Group ``(file, record, text)`` into ``(texts, files, records)`` of about ``max_bytes``."""
    texts: list[str] = []
    files: list[int] = []
    numbers: list[int] = []
    size = 0
    for file, record, text in records:
        texts.append(text)
        files.append(file)
        numbers.append(record)
        size += len(text)
        if size >= max_bytes or len(texts) >= _CHUNK_DOCS:
            yield texts, files, numbers
            texts, files, numbers, size = [], [], [], 0
    if texts:
        yield texts, files, numbers


def chunk_ids(seed: int, corpus: CorpusFiles, files: list[int], records: list[int]) -> np.ndarray:
    """The (key, file rank, record) rows of a chunk's documents, uint64: their sort order."""
    which = np.asarray(files, dtype=np.int64)
    numbers = np.asarray(records, dtype=np.uint64)
    keys = document_keys(seed, corpus.hashes[which], numbers)
    return np.column_stack([keys, corpus.ranks[which].astype(np.uint64), numbers])


def _encoded_chunks(
    tokenizer: Tokenizer,
    records: Iterable[tuple[int, int, str]],
    workers: int,
    chunk_bytes: int,
    call_chars: int,
) -> Iterator[tuple[np.ndarray, np.ndarray, Chunk]]:
    """Tokenize in order; with several workers, a bounded window of chunks in flight."""
    if workers <= 1:
        for chunk in chunks(records, chunk_bytes):
            yield (*tokenizer.encode_batch(chunk[0], max_chars=call_chars), chunk)
        return
    # spawn, not fork: the parent may hold Rust/tqdm threads that a fork would copy mid-lock.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        pending: deque[tuple[Any, Chunk]] = deque()
        for chunk in chunks(records, chunk_bytes):
            pending.append((pool.apply_async(_encode_chunk, (chunk[0], call_chars)), chunk))
            if len(pending) >= 2 * workers:
                result, done = pending.popleft()
                yield (*result.get(), done)
        while pending:
            result, done = pending.popleft()
            yield (*result.get(), done)


def build_tokenizer(config: PrepareConfig, files: list[Path]) -> Tokenizer:
    """The run's tokenizer; ``bpe:VOCAB`` is trained here on the inputs' first MB."""
    kind, arg = parse_spec(config.tokenizer)
    if kind == "byte":
        return ByteTokenizer()
    if kind == "file":
        return HFTokenizer.from_file(arg, eos_token=config.eos_token)
    if config.bpe_train_bytes <= 0:
        raise PrepareError(f"--bpe-train-mb must be > 0, got {config.bpe_train_mb}")
    log.info(
        "training a byte-level BPE with %d entries on the first %g MB of the corpus",
        arg,
        config.bpe_train_mb,
    )
    texts = iter_documents(files, text_field=config.text_field, skip_bad=config.skip_bad)
    return train_bpe(texts, arg, max_bytes=config.bpe_train_bytes, progress=config.progress)


def chunk_sizes(config: PrepareConfig, workers: int) -> tuple[int, int]:
    """Text per tokenized chunk and characters per tokenizer call, from the budget.

    Budget shares: scatter buffers 1/4, chunks in flight 1/8, a loaded bucket 1/4 (x2 for
    its sorted copy), leaving room for the interpreter's own overhead. One tokenizers call
    holds some 400 bytes per character (measured), so a call is held to about a tenth of
    the budget per worker.
    """
    budget = config.memory_bytes
    chunk_bytes = max(1 << 12, min(1 << 20, budget // (8 * 2 * max(workers, 1) * 4)))
    call_chars = max(1 << 12, min(chunk_bytes, budget // (4096 * max(workers, 1))))
    return chunk_bytes, call_chars


def _bucket_bits(estimated_bytes: int, bucket_bytes: int) -> int:
    if estimated_bytes <= bucket_bytes:
        return 0
    return min(_MAX_BUCKET_BITS, math.ceil(math.log2(estimated_bytes / bucket_bytes)))


def prepare(config: PrepareConfig, stats: PrepareStats | None = None) -> Manifest:
    """Build dataset ``config.dataset`` in ``config.store`` from ``config.inputs``.

    Raises PrepareError (BadRecord for bad input, StoreFull when the store's disk fills
    up), DatasetExists, InvalidDatasetName. Leaves nothing behind on failure.
    """
    stats = stats if stats is not None else PrepareStats()
    started = time.perf_counter()
    files = check_and_list_inputs(config)
    if config.engine == "ray":
        from tokenfeed_server.prepare.ray_engine import prepare_ray

        manifest = prepare_ray(config, files, stats)
        stats.seconds = time.perf_counter() - started
        return manifest
    tokenizer = build_tokenizer(config, files)
    text_bytes = estimate_text_bytes(files)
    scratch = make_temp_dir(config.store, config.dataset)
    try:
        extra: dict[str, Path] = {}
        with store_full_as_error(config, "scratch buckets", stats, text_bytes, tokenizer):
            tokenizer_json = tokenizer.json()
            if tokenizer_json is not None and tokenizer.info.file:
                (scratch / tokenizer.info.file).write_text(tokenizer_json, encoding="utf-8")
                extra[tokenizer.info.file] = scratch / tokenizer.info.file
            buckets = _scatter(config, files, tokenizer, scratch / "buckets", stats)
        if stats.corpus.documents == 0:
            raise empty_corpus_error(len(files), stats.corpus)
        with (
            store_full_as_error(config, "shards", stats, text_bytes, tokenizer),
            DatasetWriter.for_build(config, tokenizer.info, extra) as writer,
        ):
            for b in range(buckets.n):
                _gather_bucket(
                    buckets,
                    b,
                    writer=writer,
                    config=config,
                    stats=stats,
                    depth_bits=64 - int(buckets.shift),
                )
            manifest = writer.commit()
    finally:
        remove_temp_dir(scratch)  # and drop its lock, which outlives rmtree otherwise
    stats.seconds = time.perf_counter() - started
    assert (config.store / config.dataset / MANIFEST_NAME).is_file()
    return manifest


def prepare_objects(
    config: PrepareConfig,
    *,
    store: S3Location | None = None,
    s3_inputs: Sequence[S3Location] = (),
    scratch_dir: Path | None = None,
    stats: PrepareStats | None = None,
) -> Manifest:
    """:func:`prepare` with object storage: inputs from ``s3_inputs`` too (after
    ``config.inputs``), and the dataset published to ``store`` when given (then
    ``config.store`` is not used). Returns the manifest as published.

    Checks the bucket and an existing dataset before any work (DatasetExists unless
    ``config.overwrite``). Nothing is visible in the store unless the whole dataset was
    uploaded; the scratch directory is removed in every case.
    """
    validate_dataset_name(config.dataset)
    stats = stats if stats is not None else PrepareStats()
    started = time.perf_counter()
    target: ObjectStore | None = None
    if store is not None:
        target = ObjectStore(store)
        target.check_bucket()
        if not config.overwrite and target.head(f"{config.dataset}/{MANIFEST_NAME}"):
            raise DatasetExists(
                f"dataset {config.dataset!r} already exists at {target.url(config.dataset)}; "
                "pass --overwrite to replace it (its old shards stay until "
                "tokenfeed-server gc)"
            )
    if scratch_dir is not None:
        scratch_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="tokenfeed-prepare-", dir=scratch_dir))
    try:
        inputs = config.inputs + tuple(download_inputs(s3_inputs, scratch / "inputs"))
        local = replace(config, inputs=inputs)
        if target is not None:
            local = replace(local, store=scratch / "store", overwrite=False)
        manifest = prepare(local, stats)
        if target is not None:
            manifest = publish_dataset(
                local.store / config.dataset, target, config.dataset, overwrite=config.overwrite
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    stats.seconds = time.perf_counter() - started  # downloads and upload included
    return manifest


def download_inputs(inputs: Sequence[S3Location], into: Path) -> list[Path]:
    """Download ``s3://`` inputs under ``into/BUCKET/KEY``; return the local inputs.

    A location with objects below it (``PREFIX/...``) is a directory: the objects a walk
    of it would take (:func:`~tokenfeed_server.prepare.corpus.walked`) are downloaded. Otherwise
    it must be one object, a file. Mirroring the keys keeps every document's path
    relative to the inputs' root, so the order equals a prepare of the same local files.
    """
    local: list[Path] = []
    for location in inputs:
        bucket = ObjectStore(S3Location(location.bucket))
        root = into / location.bucket
        taken = 0
        listed = bucket.list(f"{location.prefix}/" if location.prefix else "")
        for info in listed:
            relative = info.key[len(location.prefix) + 1 :] if location.prefix else info.key
            if not walked(relative):
                continue
            path = root / info.key
            path.parent.mkdir(parents=True, exist_ok=True)
            bucket.get_to_file(info.key, path)
            taken += 1
        if taken:
            local.append(root / location.prefix if location.prefix else root)
            continue
        if location.prefix and bucket.head(location.prefix) is not None:
            path = root / location.prefix
            path.parent.mkdir(parents=True, exist_ok=True)
            bucket.get_to_file(location.prefix, path)
            local.append(path)
            continue
        raise PrepareError(
            f"input {location.url()} has no objects to read (neither an object nor a "
            "prefix with .txt/.jsonl/.parquet/... objects below it)"
        )
    return local


def check_and_list_inputs(config: PrepareConfig) -> list[Path]:
    """Check what can be checked before any work; clean stale temp dirs; list the files."""
    validate_dataset_name(config.dataset)
    if config.memory_bytes < 1 << 20:
        raise PrepareError(f"--memory-mb must be at least 1, got {config.memory_mb}")
    if config.engine not in ("local", "ray"):
        raise PrepareError(f"--engine must be local or ray, got {config.engine!r}")
    target = config.store / config.dataset
    if target.exists() and not config.overwrite:
        raise DatasetExists(
            f"dataset {config.dataset!r} already exists in {config.store}; pass --overwrite"
        )
    files = expand_inputs(config.inputs)
    if not files:
        raise PrepareError(
            f"no input files found in {', '.join(map(str, config.inputs)) or '(no inputs)'}"
        )
    config.store.mkdir(parents=True, exist_ok=True)
    for stale in clean_stale_temp_dirs(config.store):
        log.info("removed stale temp dir %s of an interrupted run", stale)
    return files


def empty_corpus_error(n_files: int, corpus: CorpusStats) -> PrepareError:
    """The error for a corpus with no non-empty document."""
    return PrepareError(
        f"empty corpus: no non-empty documents in {n_files} input file(s) "
        f"({corpus.bad_records} bad records, {corpus.empty_documents} empty documents)"
    )


@contextlib.contextmanager
def store_full_as_error(
    config: PrepareConfig, what: str, stats: PrepareStats, text_bytes: int, tokenizer: Tokenizer
) -> Iterator[None]:
    """Turn a write refused for lack of space into StoreFull saying how much is needed.

    The need: the scratch buckets and the shards each hold every token once, and the
    shards are written while the buckets they come from still exist, so about twice the
    tokens' size (the tokens are extrapolated from what was read so far).
    """
    try:
        yield
    except OSError as exc:
        if exc.errno not in _NO_SPACE:
            raise
        read = stats.corpus.text_bytes
        tokens = stats.tokens if not read else max(stats.tokens, stats.tokens * text_bytes // read)
        token_bytes = tokens * tokenizer.dtype.itemsize
        raise StoreFull(
            f"store {config.store} ran out of space while writing {what} ({exc.strerror}): "
            f"prepare needs about {_size(2 * token_bytes)} free there for this corpus "
            f"(scratch buckets and shards, about {_size(token_bytes)} of tokens each; "
            "with --overwrite also the old dataset until the new one replaces it); free "
            "some space or pass a --store on a larger disk"
        ) from exc


def _size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{max(1, round(n / (1 << 20)))} MiB"


def _scatter(
    config: PrepareConfig,
    files: list[Path],
    tokenizer: Tokenizer,
    directory: Path,
    stats: PrepareStats,
) -> _Buckets:
    budget = config.memory_bytes
    workers = config.resolved_workers()
    itemsize = tokenizer.dtype.itemsize
    bucket_bytes = budget // 4
    chunk_bytes, call_chars = chunk_sizes(config, workers)
    estimated = estimate_text_bytes(files) * itemsize
    bits = _bucket_bits(estimated, bucket_bytes)
    buckets = _Buckets(directory, bits, 64 - bits, tokenizer.dtype, flush_bytes=budget // 4)
    stats.buckets = buckets.n
    corpus = corpus_files(config.inputs, files)
    records = iter_records(
        files, text_field=config.text_field, skip_bad=config.skip_bad, stats=stats.corpus
    )
    encoded = _encoded_chunks(tokenizer, records, workers, chunk_bytes, call_chars)
    with Progress(enabled=config.progress, desc=f"prepare {config.dataset}") as progress:
        for tokens, lengths, (_, in_files, numbers) in encoded:
            buckets.add(tokens, lengths, chunk_ids(config.seed, corpus, in_files, numbers))
            stats.tokens += len(tokens) + len(lengths)
            progress.update(len(lengths), len(tokens) + len(lengths), stats.corpus.text_bytes)
    buckets.flush()
    return buckets


def _gather_bucket(
    buckets: _Buckets,
    b: int,
    *,
    writer: DatasetWriter,
    config: PrepareConfig,
    stats: PrepareStats,
    depth_bits: int,
) -> None:
    """Write bucket ``b`` sorted by key; split it first if it exceeds its memory share."""
    tok_path, idx_path = buckets.paths(b)
    if not idx_path.exists():
        return
    size = tok_path.stat().st_size + idx_path.stat().st_size
    limit = config.memory_bytes // 4
    n_docs = idx_path.stat().st_size // _IDX_BYTES
    if size > limit and n_docs > 1 and depth_bits < 64:
        bits = min(_SPLIT_BITS, 64 - depth_bits)
        sub = _Buckets(
            tok_path.parent / f"split-{b}",
            bits,
            64 - depth_bits - bits,
            buckets.dtype,
            flush_bytes=config.memory_bytes // 4,
        )
        for tokens, lengths, ids in _iter_bucket_pieces(
            tok_path, idx_path, buckets.dtype, limit // 2
        ):
            sub.add(tokens, lengths, ids)
        sub.flush()
        tok_path.unlink()
        idx_path.unlink()
        stats.bucket_splits += 1
        for s in range(sub.n):
            _gather_bucket(
                sub, s, writer=writer, config=config, stats=stats, depth_bits=depth_bits + bits
            )
        shutil.rmtree(sub.dir, ignore_errors=True)
        return
    stats.peak_bucket_bytes = max(stats.peak_bucket_bytes, size)
    idx = np.fromfile(idx_path, dtype=np.uint64).reshape(-1, _IDX_COLUMNS)
    tokens = np.fromfile(tok_path, dtype=buckets.dtype)
    lengths = idx[:, 0].astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    # (key, file rank, record): unique, so the order is the same however docs arrived.
    order = np.lexsort((idx[:, 3], idx[:, 2], idx[:, 1])).tolist()
    del idx
    # Emit in pieces so the copy in sorted order never holds a second whole bucket.
    piece_tokens = max(1, config.memory_bytes // (16 * buckets.dtype.itemsize))
    parts: list[np.ndarray] = []
    part_lengths: list[int] = []
    held = 0
    for d in order:
        a, z = offsets[d], offsets[d + 1]
        parts.append(tokens[a:z])
        part_lengths.append(z - a)
        held += z - a
        if held >= piece_tokens:
            writer.add_batch(np.concatenate(parts), np.asarray(part_lengths, dtype=np.int64))
            parts, part_lengths, held = [], [], 0
    if parts:
        writer.add_batch(np.concatenate(parts), np.asarray(part_lengths, dtype=np.int64))
    tok_path.unlink()
    idx_path.unlink()


# ------------------------------------------------------------------ demo corpus


def demo_corpus_paths(max_bytes: int = 30 << 20) -> list[Path]:
    """Real text that needs no download: this interpreter's standard library sources.

    The ``.py`` files (and any ``.txt``/``.rst`` docs) under the stdlib directory, in
    sorted order, up to ``max_bytes`` in total; site-packages and test data excluded.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    picked: list[Path] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")
        )
        for name in sorted(filenames):
            if not name.endswith((".py", ".txt", ".rst")):
                continue
            path = Path(dirpath) / name
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if size == 0 or total + size > max_bytes or not _is_utf8(path):
                continue
            picked.append(path)
            total += size
    if not picked:
        raise PrepareError(f"no standard library sources found under {root} ({sys.executable})")
    return picked


def _is_utf8(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return True
