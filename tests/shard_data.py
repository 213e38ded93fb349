"""Small token datasets for the store's tests: random documents and the stream they make."""

from __future__ import annotations

import numpy as np

from tokenfeed_server.store import TokenizerInfo

BYTE = TokenizerInfo(kind="byte", vocab_size=257, eos_id=256)


def random_docs(n: int, seed: int = 0, vocab: int = 256) -> list[np.ndarray]:
    """``n`` documents of 0-39 random token ids below ``vocab`` (no EOS)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(0, 40))) for _ in range(n)]


def stream(docs: list[np.ndarray], eos: int) -> np.ndarray:
    """The dataset's token stream: every document followed by ``eos``."""
    return np.concatenate([np.append(d, eos) for d in docs])
