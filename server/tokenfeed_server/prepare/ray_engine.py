"""The prepare pipeline on Ray Data: the local engine's steps on a cluster, the same bytes.

1. The driver lists the input files, trains ``bpe:VOCAB`` once on the inputs' first
   ``bpe_train_mb`` (as the local engine does) and ships the tokenizer to the workers.
2. ``ray.data`` holds the file list, in blocks of files holding about one output block of
   tokens (at least two per CPU); ``map_batches`` reads, parses
   and tokenizes each file in chunks bounded by ``--memory-mb`` and yields one row per
   document: its key, file rank, record number and tokens (see
   :mod:`tokenfeed_server.prepare.doc_order`). Bad records and each file's counts are rows too
   (*notes*), sorted before every document in input order, so the driver reports the
   same first bad record, the same logged ones and the same counts as the local engine.
3. Ray Data's distributed sort orders the rows by ``(kind, key, rank, record)``: it
   range-partitions by sampled boundaries, each partition about one block, spilled to
   disk by Ray's object store when memory runs short.
4. The driver streams the sorted blocks, one at a time, into the
   :class:`~tokenfeed_server.store.writer.DatasetWriter`, which cuts shards at fixed
   offsets of the token stream and publishes with one rename.

Each task is a pure function of its file, so a task Ray retries after a lost worker
yields exactly the rows the lost attempt would have: nothing duplicated or dropped. An
error, Ctrl-C, SIGTERM or a failed retry leaves the writer's temp dir only, which it
removes (or, after a SIGKILL, the next run does): nothing is published.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tokenfeed.errors import BadRecord, PrepareError
from tokenfeed_server.prepare.config import PrepareConfig, PrepareStats
from tokenfeed_server.prepare.corpus import count_bad, estimate_text_bytes, iter_file_records
from tokenfeed_server.prepare.doc_order import CorpusFiles, corpus_files
from tokenfeed_server.prepare.progress import Progress
from tokenfeed_server.prepare.steps import (
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

__all__ = ["prepare_ray"]

log = logging.getLogger(__name__)

# Row kinds: notes (bad records, a file's counts) sort before every document.
_NOTE, _DOC = 0, 1
# A file's counts note comes after its bad records (record numbers are smaller).
_COUNTS_RECORD = (1 << 64) - 1
# More tasks than this and the sort's overhead beats balance: files share a task.
_MAX_FILE_BLOCKS = 4096
_SORT_KEY = ["kind", "key", "rank", "record"]


@dataclass(frozen=True)
class _Job:
    """What every tokenize task needs; pickled once and shipped to the workers."""

    tokenizer: Tokenizer
    corpus: CorpusFiles
    seed: int
    text_field: str
    skip_bad: bool
    chunk_bytes: int
    call_chars: int


def prepare_ray(config: PrepareConfig, files: list[Path], stats: PrepareStats) -> Manifest:
    """Build the dataset of ``config`` from ``files`` on Ray (see the module docstring)."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise PrepareError(
            "--engine ray needs Ray Data: pip install 'tokenfeed-server[ray]'"
        ) from None
    tokenizer = build_tokenizer(config, files)
    corpus = corpus_files(config.inputs, files)
    chunk_bytes, call_chars = chunk_sizes(config, 1)
    job = _Job(
        tokenizer, corpus, config.seed, config.text_field, config.skip_bad, chunk_bytes, call_chars
    )
    stats.corpus.files = len(files)
    with _cluster(config), _data_context(config):
        rows = [{"file": i} for i in range(len(files))]
        blocks = _file_blocks(config, files, tokenizer, int(ray.cluster_resources().get("CPU", 1)))
        listing = ray.data.from_items(rows, override_num_blocks=blocks)
        documents = listing.map_batches(
            partial(_tokenize_files, job),
            batch_size=None,  # a whole block: its files, read one after the other
            batch_format="numpy",
            memory=config.memory_bytes,  # reserve the budget: no oversubscribed node
            # A lost worker: Ray Data runs the task again (its default for system
            # failures); the task is pure, so nothing is duplicated or dropped.
        )
        ordered = documents.sort(_SORT_KEY)
        return _write(config, tokenizer, ordered, stats)


def _file_blocks(config: PrepareConfig, files: list[Path], tokenizer: Tokenizer, cpus: int) -> int:
    """How many tasks read the files: about one output block of tokens each, at least
    two per CPU. The sort cuts as many partitions, and its cost grows with their square:
    a task per small file measured 50x slower than this on 545 files.
    """
    block_bytes = max(1 << 20, config.memory_bytes // 8)
    by_size = estimate_text_bytes(files) * tokenizer.dtype.itemsize // block_bytes
    return max(1, min(len(files), _MAX_FILE_BLOCKS, max(2 * cpus, by_size)))


@contextlib.contextmanager
def _cluster(config: PrepareConfig) -> Iterator[None]:
    """Join ``--ray-address`` (or ``RAY_ADDRESS``), or start a local cluster for the run.

    A cluster this process already joined (a notebook, a test) is used as it is.
    """
    import ray

    if ray.is_initialized():
        yield
        return
    address = config.ray_address or os.environ.get("RAY_ADDRESS")
    # Workers tokenize one chunk per core already: tokenizers' own threads would contend.
    runtime_env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
    if address:
        log.info("joining the Ray cluster at %s", address)
        ray.init(
            address=address,
            runtime_env=runtime_env,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    else:
        cpus = config.workers if config.workers > 0 else os.cpu_count() or 1
        log.info("starting a local Ray cluster on %d CPU(s)", cpus)
        ray.init(
            address="local",
            num_cpus=cpus,
            include_dashboard=False,
            runtime_env=runtime_env,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def _data_context(config: PrepareConfig) -> Iterator[None]:
    """Ray Data settings for this run, restored after it (the context is per process)."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    saved = (ctx.target_max_block_size, ctx.execution_options.preserve_order)
    saved_bars = ctx.enable_progress_bars
    # Blocks of an eighth of the budget: a task holds a chunk, a block being built and
    # the block it sends; a sort partition is about one block.
    ctx.target_max_block_size = max(1 << 20, config.memory_bytes // 8)
    ctx.execution_options.preserve_order = True  # the sorted blocks reach us in order
    bars = config.progress if config.progress is not None else sys.stderr.isatty()
    ctx.enable_progress_bars = bars
    try:
        yield
    finally:
        ctx.target_max_block_size, ctx.execution_options.preserve_order = saved
        ctx.enable_progress_bars = saved_bars


# ------------------------------------------------------------------ on the workers


def _tokenize_files(job: _Job, batch: dict[str, np.ndarray]) -> Iterator[pa.Table]:
    """One block's files: a table of document rows per chunk, then each file's notes."""
    for index in batch["file"].tolist():
        yield from _tokenize_file(job, int(index))


def _tokenize_file(job: _Job, index: int) -> Iterator[pa.Table]:
    path = job.corpus.paths[index]
    bad: list[tuple[int, BadRecord]] = []
    counts = {"documents": 0, "chars": 0, "empty": 0}

    def kept() -> Iterator[tuple[int, int, str]]:
        # Read by absolute path (a worker's directory is not ours), named as given.
        absolute = Path(os.path.abspath(path))
        for record, item in iter_file_records(absolute, text_field=job.text_field, label=path):
            if isinstance(item, BadRecord):
                bad.append((record, item))
                if not job.skip_bad:
                    return  # the driver raises the first one in input order
                continue
            if not item:
                counts["empty"] += 1
                continue
            counts["documents"] += 1
            counts["chars"] += len(item)
            yield index, record, item

    for texts, in_files, records in chunks(kept(), job.chunk_bytes):
        tokens, lengths = job.tokenizer.encode_batch(texts, max_chars=job.call_chars)
        ids = chunk_ids(job.seed, job.corpus, in_files, records)
        yield _table(_DOC, ids, tokens, lengths, chars=[len(t) for t in texts])
    # Notes sort by (input index, record): the file's bad records, then its counts.
    numbers = [record for record, _ in bad] + [_COUNTS_RECORD]
    ids = np.zeros((len(numbers), 3), dtype=np.uint64)
    ids[:, 0] = index
    ids[:, 1] = numbers
    zeros = [0] * len(bad)
    yield _table(
        _NOTE,
        ids,
        np.empty(0, dtype=job.tokenizer.dtype),
        np.zeros(len(numbers), dtype=np.int64),
        chars=[*zeros, counts["chars"]],
        documents=[*zeros, counts["documents"]],
        empty=[*zeros, counts["empty"]],
        notes=[str(exc) for _, exc in bad] + [""],
    )


def _table(
    kind: int,
    ids: np.ndarray,
    tokens: np.ndarray,
    lengths: np.ndarray,
    *,
    chars: list[int],
    documents: list[int] | None = None,
    empty: list[int] | None = None,
    notes: list[str] | None = None,
) -> pa.Table:
    """Rows of one kind; a document's tokens are its bytes in the store's dtype (no copy)."""
    n = len(ids)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    offsets *= tokens.dtype.itemsize
    token_bytes = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(tokens)]
    )
    zeros = np.zeros(n, dtype=np.int64)
    return pa.table(
        {
            "kind": pa.array(np.full(n, kind, dtype=np.uint8)),
            # For notes, key is the file's input index and rank the record number.
            "key": pa.array(ids[:, 0]),
            "rank": pa.array(ids[:, 1]),
            "record": pa.array(ids[:, 2]),
            "tokens": token_bytes,
            "chars": pa.array(np.asarray(chars, dtype=np.int64)),
            "documents": pa.array(zeros if documents is None else documents, pa.int64()),
            "empty": pa.array(zeros if empty is None else empty, pa.int64()),
            "note": pa.array([""] * n if notes is None else notes, pa.string()),
        }
    )


# ------------------------------------------------------------------ on the driver


def _write(
    config: PrepareConfig, tokenizer: Tokenizer, ordered: Any, stats: PrepareStats
) -> Manifest:
    """Stream the sorted rows: notes first (errors, counts), then documents to the writer."""
    dtype = tokenizer.dtype
    writer: DatasetWriter | None = None
    with contextlib.ExitStack() as stack:
        progress = stack.enter_context(
            Progress(enabled=config.progress, desc=f"write {config.dataset}")
        )
        for batch in ordered.iter_batches(batch_size=None, batch_format="pyarrow"):
            table = batch
            if writer is None:  # notes sort first: once a document came, only documents
                kinds = batch.column("kind").to_numpy()
                notes = batch.filter(kinds == _NOTE)
                _read_notes(notes, config, stats)
                if len(notes) == len(batch):
                    continue
                if stats.corpus.documents == 0:
                    raise empty_corpus_error(stats.corpus.files, stats.corpus)
                writer = stack.enter_context(_open_writer(config, tokenizer, stack))
                table = batch.filter(kinds == _DOC)
            tokens, lengths = _documents(table, dtype)
            with store_full_as_error(config, "shards", stats, stats.corpus.text_bytes, tokenizer):
                writer.add_batch(tokens, lengths)
            stats.tokens += len(tokens) + len(lengths)
            progress.update(len(lengths), len(tokens) + len(lengths), stats.corpus.text_bytes)
        if writer is None:
            raise empty_corpus_error(stats.corpus.files, stats.corpus)
        with store_full_as_error(config, "shards", stats, stats.corpus.text_bytes, tokenizer):
            return writer.commit()
    raise AssertionError("unreachable")  # pragma: no cover


def _read_notes(notes: Any, config: PrepareConfig, stats: PrepareStats) -> None:
    """Raise the first bad record (input order) or count it; add up the files' counts."""
    for note, chars, documents, empty, record in zip(
        notes.column("note").to_pylist(),
        notes.column("chars").to_pylist(),
        notes.column("documents").to_pylist(),
        notes.column("empty").to_pylist(),
        notes.column("rank").to_pylist(),
        strict=True,
    ):
        if record == _COUNTS_RECORD:
            stats.corpus.documents += documents
            stats.corpus.empty_documents += empty
            stats.corpus.text_bytes += chars
        else:
            count_bad(BadRecord(note), skip_bad=config.skip_bad, stats=stats.corpus)


def _open_writer(
    config: PrepareConfig, tokenizer: Tokenizer, stack: contextlib.ExitStack
) -> DatasetWriter:
    """The dataset's writer; a tokenizer.json goes with it (from a scratch temp dir)."""
    extra: dict[str, Path] = {}
    tokenizer_json = tokenizer.json()
    if tokenizer_json is not None and tokenizer.info.file:
        scratch = make_temp_dir(config.store, config.dataset)
        stack.callback(remove_temp_dir, scratch)
        extra[tokenizer.info.file] = scratch / tokenizer.info.file
        extra[tokenizer.info.file].write_text(tokenizer_json, encoding="utf-8")
    return DatasetWriter.for_build(config, tokenizer.info, extra)


def _documents(table: Any, dtype: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray]:
    """A table's documents as (tokens back to back, lengths), without copying per row."""
    column = table.column("tokens").combine_chunks()
    n = len(column)
    buffers = column.buffers()
    offset_type = np.int64 if str(column.type).startswith("large") else np.int32
    offsets = np.frombuffer(buffers[1], dtype=offset_type)[column.offset : column.offset + n + 1]
    offsets = offsets.astype(np.int64)
    if n == 0 or buffers[2] is None:
        return np.empty(0, dtype=dtype), np.zeros(n, dtype=np.int64)
    data = np.frombuffer(buffers[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    return data.view(dtype), np.diff(offsets) // dtype.itemsize
