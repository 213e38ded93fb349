"""Tokenizers for prepare: exact piecewise encoding of big documents, capped BPE training."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers

from tokenfeed_server.prepare.tokenizer import BPE_EOS, HFTokenizer, split_text, train_bpe

# Every kind of whitespace the pre-tokenizer's \s knows, and some it does not (\x1c is
# isspace() in Python but not Unicode White_Space), next to letters, digits, marks,
# punctuation and contractions: where a cut could go wrong.
_ATOMS = [
    "word", "Wörter", "日本語", "😀", "e\u0301", "42", "3.14", "'s", "'ll", "don't", "--",
    "(x)", "<|endoftext|>", " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", " \n ", "\u00a0",
    "\u3000", "\u2028", "\u2009", "\x85", "\x1c", "\x0b", "\f", " \t ", ".", ",",
]  # fmt: skip


def _text(n_atoms: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return "".join(rng.choice(_ATOMS, size=n_atoms))


@pytest.fixture(scope="module")
def bpe() -> HFTokenizer:
    return train_bpe([_text(20_000, seed) for seed in range(5)], 600, progress=False)


def test_split_text_cuts_only_before_a_space_after_non_whitespace() -> None:
    text = _text(5000, seed=9)
    for max_chars in (100, 1000):
        pieces = split_text(text, max_chars)
        assert "".join(pieces) == text
        for piece in pieces[1:]:
            assert piece[0] == " "
        for before in pieces[:-1]:
            assert not before[-1].isspace()
    assert split_text("short", 100) == ["short"]


@pytest.mark.parametrize("max_chars", [800, 8072, 40_000])  # pieces of max_chars // 8
def test_piecewise_encoding_equals_whole_document_encoding(
    bpe: HFTokenizer, max_chars: int
) -> None:
    assert bpe.cuts_exactly
    texts = [_text(n, seed=100 + n) for n in (3, 400, 9000, 30_000)]
    whole_ids, whole_lengths = bpe.encode_batch(texts)
    ids, lengths = bpe.encode_batch(texts, max_chars=max_chars)
    assert len(split_text(texts[-1], max_chars // 8)) > 1  # it really cut
    assert lengths.tolist() == whole_lengths.tolist()
    assert ids.dtype == whole_ids.dtype and np.array_equal(ids, whole_ids)
    assert bpe.decode(ids[: lengths[0]]) == texts[0]


def test_a_run_without_spaces_is_cut_hard_to_bound_memory() -> None:
    text = "x" * 1000 + " tail"
    pieces = split_text(text, 100)
    assert "".join(pieces) == text and max(map(len, pieces)) <= 400


def test_other_pre_tokenizers_are_encoded_whole() -> None:
    # Metaspace prepends "▁" to every piece it is given: cutting would change the ids.
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.Metaspace()
    rust.add_special_tokens([BPE_EOS])
    tok = HFTokenizer(rust.to_str(), kind="hf:test")
    assert not tok.cuts_exactly
    text = "a b c d e f " * 50
    assert np.array_equal(tok.encode_batch([text], max_chars=5)[0], tok.encode_batch([text])[0])


def test_bpe_training_reads_only_the_first_max_bytes(caplog: pytest.LogCaptureFixture) -> None:
    first = _text(6000, seed=1)
    cap = len(first.encode("utf-8"))
    later = ["zzzq qqzz " * 2000, "xyxyxy " * 2000]  # would create merges of their own
    with caplog.at_level(logging.INFO, logger="tokenfeed_server.prepare.tokenizer"):
        capped = train_bpe([first, *later], 400, max_bytes=cap)
    alone = train_bpe([first], 400, progress=False)
    assert capped.json() == alone.json()
    assert "zzzq" not in (capped.json() or "")
    # Not a terminal here: log lines say how much it read and that merges follow.
    assert any("computing 400 merges" in r.message for r in caplog.records)
    assert any("done in" in r.message for r in caplog.records)
