"""The local engine: tokenize and shuffle in this process (or a process pool), on disk.

Two passes, memory bounded by ``PrepareConfig.memory_mb`` and never by the corpus size:

1. *Scatter*: documents are read in order and tokenized in chunks, in this process by
   default (``workers > 1``: by a process pool, at most ``2 * workers`` chunks in
   flight). A document longer than a chunk is encoded in pieces (see
   :meth:`~tokenfeed_server.prepare.tokenizer.Tokenizer.encode_batch`). Each document
   gets the random 64-bit key of its identity (:mod:`tokenfeed_server.prepare.doc_order`);
   its tokens go to the on-disk bucket named by the key's top bits
   (:mod:`tokenfeed_server.prepare.buckets`). Bucket writes are buffered and flushed when
   the buffers reach a quarter of the budget.
2. *Gather*: buckets are loaded one at a time, their documents sorted by key, and
   streamed into :class:`~tokenfeed_server.store.writer.DatasetWriter`, which cuts shards
   at fixed offsets of the token stream.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tokenfeed_server.prepare.buckets import Buckets, bucket_bits, gather_bucket
from tokenfeed_server.prepare.config import PrepareConfig, PrepareStats
from tokenfeed_server.prepare.corpus import estimate_text_bytes, iter_records
from tokenfeed_server.prepare.doc_order import corpus_files
from tokenfeed_server.prepare.progress import Progress
from tokenfeed_server.prepare.steps import (
    Chunk,
    build_tokenizer,
    chunk_ids,
    chunk_sizes,
    chunks,
    empty_corpus_error,
    store_full_as_error,
)
from tokenfeed_server.prepare.tokenizer import Tokenizer
from tokenfeed_server.store.manifest import Manifest
from tokenfeed_server.store.writer import DatasetWriter, make_temp_dir, remove_temp_dir

__all__ = ["prepare_local"]


def prepare_local(config: PrepareConfig, files: list[Path], stats: PrepareStats) -> Manifest:
    """Build the dataset of ``config`` from ``files`` here (see the module docstring)."""
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
                gather_bucket(
                    buckets,
                    b,
                    writer=writer,
                    config=config,
                    stats=stats,
                    depth_bits=64 - int(buckets.shift),
                )
            return writer.commit()
    finally:
        remove_temp_dir(scratch)  # and drop its lock, which outlives rmtree otherwise


def _scatter(
    config: PrepareConfig,
    files: list[Path],
    tokenizer: Tokenizer,
    directory: Path,
    stats: PrepareStats,
) -> Buckets:
    budget = config.memory_bytes
    workers = config.resolved_workers()
    chunk_bytes, call_chars = chunk_sizes(config, workers)
    estimated = estimate_text_bytes(files) * tokenizer.dtype.itemsize
    bits = bucket_bits(estimated, budget // 4)
    buckets = Buckets(directory, bits, 64 - bits, tokenizer.dtype, flush_bytes=budget // 4)
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


# ------------------------------------------------------------------ tokenizing


_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _WORKER_TOKENIZER
    # One Rust thread per worker process: the pool already uses every core.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_TOKENIZER = tokenizer


def _encode_chunk(texts: list[str], max_chars: int) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER_TOKENIZER is not None
    return _WORKER_TOKENIZER.encode_batch(texts, max_chars=max_chars)


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
