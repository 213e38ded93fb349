"""What one prepare run is asked to do (:class:`PrepareConfig`) and what it did
(:class:`PrepareStats`): the two values every step of both engines passes along."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tokenfeed_server.prepare.corpus import CorpusStats

__all__ = ["Engine", "PrepareConfig", "PrepareStats"]

Engine = Literal["local", "ray"]


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
    """What a run did; filled in by :func:`~tokenfeed_server.prepare.prepare` for the CLI,
    tests and benchmarks."""

    corpus: CorpusStats = field(default_factory=CorpusStats)
    tokens: int = 0
    buckets: int = 0
    bucket_splits: int = 0
    peak_bucket_bytes: int = 0
    seconds: float = 0.0
