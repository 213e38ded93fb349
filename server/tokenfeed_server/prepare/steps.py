"""The steps both engines share (local and Ray): check the inputs, build the tokenizer,
cut the corpus into chunks, give each document its sort key, and report a full disk.

Both engines import these and nothing of each other, so the same input yields the same
bytes whichever engine runs it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from tokenfeed.errors import DatasetExists, PrepareError, StoreFull
from tokenfeed_server.prepare.config import PrepareConfig, PrepareStats
from tokenfeed_server.prepare.corpus import CorpusStats, expand_inputs, iter_documents
from tokenfeed_server.prepare.doc_order import CorpusFiles, document_keys
from tokenfeed_server.prepare.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    parse_spec,
    train_bpe,
)
from tokenfeed_server.store.reader import validate_dataset_name
from tokenfeed_server.store.writer import clean_stale_temp_dirs

__all__ = [
    "Chunk",
    "build_tokenizer",
    "check_and_list_inputs",
    "chunk_ids",
    "chunk_sizes",
    "chunks",
    "empty_corpus_error",
    "store_full_as_error",
]

log = logging.getLogger(__name__)

_CHUNK_DOCS = 4096

# write() errors that mean "no room": a full disk, a full quota, a file-size limit.
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

#: a chunk of documents: (texts, file indices, record numbers)
Chunk = tuple[list[str], list[int], list[int]]


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
            f"no input files found in {', '.join(map(str, config.inputs)) or '(no inputs)'}: "
            "a directory contributes only .txt .text .md .rst .jsonl .ndjson .parquet files "
            "(and .gz/.zst forms); name other files explicitly"
        )
    config.store.mkdir(parents=True, exist_ok=True)
    for stale in clean_stale_temp_dirs(config.store):
        log.info("removed stale temp dir %s of an interrupted run", stale)
    return files


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
