"""The prepare pipeline: raw corpus -> tokenized, globally pre-shuffled dataset.

Entry points: :func:`prepare` and :func:`prepare_objects` (:mod:`.pipeline`). The rooms
of the pipeline, one job per module:

- :mod:`.corpus` reads the inputs (text, JSON lines, Parquet, compressed) as records;
- :mod:`.tokenizer` turns text into token ids (byte, a ``tokenizer.json``, or a BPE
  trained on the inputs);
- :mod:`.doc_order` gives every document the random 64-bit key of its identity;
- :mod:`.steps` holds what both engines share (checks, chunks, keys, a full disk);
- :mod:`.local` (with :mod:`.buckets`) is the default engine: scatter to on-disk buckets
  by key, gather each bucket sorted; :mod:`.ray_engine` runs the same steps on Ray Data;
- :mod:`.progress` reports a run's progress, :mod:`.demo` finds the demo corpus.

A ``bpe:VOCAB`` tokenizer is first trained on the first ``bpe_train_mb`` of the inputs.

So the output order is "all documents sorted by ``(key, path, record)``": a uniform global
shuffle that depends only on the seed and the corpus, not on the memory budget, the
number of workers, how buckets were split, or the engine. The writer and all scratch
files live in ``.tmp-`` directories inside the store, removed on any error or interrupt
(and, after a SIGKILL, by the next run).
"""

from __future__ import annotations

from tokenfeed_server.prepare.config import PrepareConfig, PrepareStats
from tokenfeed_server.prepare.demo import demo_corpus_paths
from tokenfeed_server.prepare.pipeline import download_inputs, prepare, prepare_objects

__all__ = [
    "PrepareConfig",
    "PrepareStats",
    "demo_corpus_paths",
    "download_inputs",
    "prepare",
    "prepare_objects",
]
