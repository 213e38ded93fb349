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


#: The fingerprint of :func:`pinned_docs` written by ``write_dataset(..., shuffle_seed=5,
#: shard_tokens=8000)`` with the byte tokenizer, computed by the release before versions:
#: no later change (the version layout, format 3) may change it, or every checkpoint saved
#: on such a build would stop resuming.
PINNED = "82fae2e52c8c3b840f3e2522a17725e1"


def pinned_docs() -> list[np.ndarray]:
    """Documents made by arithmetic only (no random generator whose stream could change)."""
    return [(np.arange(20 + (i * 7) % 90) * (i + 3)) % 256 for i in range(400)]
