"""Tokenizers for prepare: the built-in byte tokenizer, a tokenizer.json file, or a BPE
trained on the corpus. Nothing is ever downloaded.

Spec strings (``--tokenizer``):

* ``byte`` (default): ids 0-255 are the UTF-8 bytes, EOS = 256, vocabulary 257.
* ``bpe:VOCAB``: a byte-level BPE with ``VOCAB`` entries trained on the corpus itself
  with the ``tokenizers`` library; EOS is ``<|endoftext|>``. Byte-level, so every text
  round-trips exactly.
* any other value: the path of a Hugging Face ``tokenizer.json``.

Every tokenizer encodes a batch of texts into one flat array plus per-document lengths,
the shape the pipeline moves between processes and into the writer.

Big documents are encoded in pieces of at most ``max_chars`` characters, so memory does
not grow with a document's size (the Rust side holds about a hundred bytes per token of
whatever it encodes at once). For a byte-level BPE (``bpe:VOCAB``, and any tokenizer.json
with the same ``ByteLevel`` pre-tokenizer and no normalizer) the cuts are exact: see
:func:`split_text`. Other tokenizer files are encoded whole, whatever the size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenfeed.dtypes import DTYPES, dtype_for_vocab
from tokenfeed.errors import PrepareError
from tokenfeed_server.store.manifest import TokenizerInfo

__all__ = [
    "BPE_EOS",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "parse_spec",
    "split_text",
    "train_bpe",
]

log = logging.getLogger(__name__)

_PIECES_PER_CALL = 8

BPE_EOS = "<|endoftext|>"
# Names a tokenizer.json may use for its end-of-document token, most specific first.
_EOS_CANDIDATES = (BPE_EOS, "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")
TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    """Base: encode texts to ids (without EOS), decode ids back for checks."""

    info: TokenizerInfo

    @property
    def dtype(self) -> np.dtype[Any]:
        """Numpy dtype of the store for this vocabulary."""
        return DTYPES[dtype_for_vocab(self.info.vocab_size)]

    def encode_batch(
        self, texts: Sequence[str], *, max_chars: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Encode ``texts``: (all ids back to back, int64 length of each text's ids).

        ``max_chars`` bounds what is encoded at once (documents are cut where that is
        exact); None encodes each text whole.
        """
        raise NotImplementedError

    def decode(self, ids: npt.ArrayLike) -> str:
        """Decode ids (EOS ids are dropped) back to text."""
        raise NotImplementedError

    def json(self) -> str | None:
        """The tokenizer.json text to store with the dataset, if any."""
        return None


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0-255, EOS = 256: no dependency, no file, always available."""

    def __init__(self) -> None:
        self.info = TokenizerInfo(kind="byte", vocab_size=257, eos_id=256)

    def encode_batch(
        self, texts: Sequence[str], *, max_chars: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        # One byte per id: the UTF-8 bytes are the ids, no buffer beyond them to bound.
        encoded = [t.encode("utf-8") for t in texts]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        ids = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(self.dtype)
        return ids, lengths

    def decode(self, ids: npt.ArrayLike) -> str:
        arr = np.asarray(ids)
        return arr[arr < 256].astype(np.uint8).tobytes().decode("utf-8")


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer held as its tokenizer.json text."""

    def __init__(self, json_text: str, *, kind: str, eos_token: str | None = None) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self._json = json_text
        self._kind = kind
        self._eos_token = eos_token
        try:
            self._tok = RustTokenizer.from_str(json_text)
        except Exception as exc:  # the Rust side raises a bare Exception
            raise PrepareError(f"cannot load tokenizer ({kind}): {exc}") from exc
        # Text that spells a special token (say "<|endoftext|>" in a document about
        # tokenizers) must stay text: only the writer may put EOS into the stream.
        self._tok.encode_special_tokens = True
        eos_id = _find_eos(self._tok, eos_token)
        #: whether :func:`split_text`'s cuts leave the encoding unchanged for this tokenizer
        self.cuts_exactly = _is_plain_byte_level(json_text)
        file_hash = "blake2b-128:" + hashlib.blake2b(json_text.encode(), digest_size=16).hexdigest()
        self.info = TokenizerInfo(
            kind=kind,
            vocab_size=self._tok.get_vocab_size(with_added_tokens=True),
            eos_id=eos_id,
            file_hash=file_hash,
            file=TOKENIZER_FILE,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Worker processes rebuild from the JSON text; the Rust object is not shared.
        return (_rebuild_hf, (self._json, self._kind, self._eos_token))

    @classmethod
    def from_file(cls, path: Path, eos_token: str | None = None) -> HFTokenizer:
        """Load a tokenizer.json file."""
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise PrepareError(
                f"cannot read tokenizer file {path}: {exc}; --tokenizer takes 'byte', "
                "'bpe:VOCAB' or the path of a tokenizer.json"
            ) from exc
        return cls(text, kind=f"hf:{path.name}", eos_token=eos_token)

    def encode_batch(
        self, texts: Sequence[str], *, max_chars: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        if max_chars is None:
            return self._encode_whole(texts)
        pieces: Sequence[str] = texts
        owner = np.arange(len(texts))  # the text each piece is part of
        if self.cuts_exactly:
            # Pieces of an eighth of a call: a call on one big document still gives every
            # Rust thread work.
            piece_chars = max(1, max_chars // _PIECES_PER_CALL)
            cuts = [split_text(text, piece_chars) for text in texts]
            pieces = [piece for cut in cuts for piece in cut]
            owner = np.repeat(owner, [len(cut) for cut in cuts])
        # Rust calls of about max_chars each: its encodings take some hundred bytes per
        # character of a call (measured), whatever the Python side keeps.
        ids_parts: list[np.ndarray] = []
        piece_lengths: list[np.ndarray] = []
        start = size = 0
        for end, piece in enumerate(pieces, 1):
            size += len(piece)
            if size >= max_chars or end == len(pieces):
                ids, lengths = self._encode_whole(pieces[start:end])
                ids_parts.append(ids)
                piece_lengths.append(lengths)
                start, size = end, 0
        lengths = np.bincount(
            owner,
            weights=np.concatenate(piece_lengths) if piece_lengths else None,
            minlength=len(texts),
        ).astype(np.int64)
        flat = np.concatenate(ids_parts) if ids_parts else np.empty(0, dtype=self.dtype)
        return flat, lengths

    def _encode_whole(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        id_lists = [e.ids for e in encodings]
        del encodings  # the Rust side's per-token data, several times the ids
        lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
        total = int(lengths.sum())
        flat = (i for ids in id_lists for i in ids)
        return np.fromiter(flat, dtype=self.dtype, count=total), lengths

    def decode(self, ids: npt.ArrayLike) -> str:
        arr = np.asarray(ids)
        arr = arr[arr != self.info.eos_id]
        return str(self._tok.decode(arr.tolist(), skip_special_tokens=False))

    def json(self) -> str | None:
        return self._json


def _is_plain_byte_level(json_text: str) -> bool:
    """True for the pre-tokenizer :func:`split_text` is proven exact for (see there)."""
    config = json.loads(json_text)
    pre = config.get("pre_tokenizer") or {}
    return (
        config.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("add_prefix_space") is False
        and pre.get("use_regex", True) is True
    )


def split_text(text: str, max_chars: int) -> list[str]:
    """Cut ``text`` into pieces of about ``max_chars`` characters, each cut just before a
    space that follows a non-whitespace character.

    Why such a cut is exact for the byte-level pre-tokenizer (GPT-2's pattern ``'s|'t|'re
    |'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``, no prefix
    space): every alternative that matches a non-whitespace character holds whitespace
    only as an optional *leading* space, so no pre-token spans a non-whitespace character
    and the space after it: a pre-token ends at the cut. Matching is left to right and
    looks ahead only, so the pre-tokens before the cut are the same in the first piece
    and those from the cut on are the same in the second; BPE merges stay inside
    pre-tokens, so the ids are the concatenation. ``str.isspace`` is a superset of the
    regex's Unicode ``\\s``, so "non-whitespace" here is non-whitespace there too.

    A stretch of more than ``4 * max_chars`` characters with no such space (one giant
    pre-token, which no real text has) is cut hard so that memory stays bounded.
    """
    if len(text) <= max_chars:
        return [text]
    pieces: list[str] = []
    start = 0
    n = len(text)
    while n - start > max_chars:
        cut = _last_cut(text, start + 1, start + max_chars)
        if cut < 0:
            cut = _first_cut(text, start + max_chars, start + 4 * max_chars)
        if cut < 0:
            cut = start + max_chars
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _last_cut(text: str, lo: int, hi: int) -> int:
    """The last index in ``[lo, hi]`` of a space after a non-whitespace char, else -1."""
    j = text.rfind(" ", lo, hi + 1)
    while j >= lo:
        if not text[j - 1].isspace():
            return j
        j = text.rfind(" ", lo, j)
    return -1


def _first_cut(text: str, lo: int, hi: int) -> int:
    """The first index in ``[lo, hi]`` of a space after a non-whitespace char, else -1."""
    j = text.find(" ", lo, hi + 1)
    while j >= 0:
        if not text[j - 1].isspace():
            return j
        j = text.find(" ", j + 1, hi + 1)
    return -1


def _rebuild_hf(json_text: str, kind: str, eos_token: str | None) -> HFTokenizer:
    return HFTokenizer(json_text, kind=kind, eos_token=eos_token)


def _find_eos(tok: Any, eos_token: str | None) -> int:
    names = (eos_token,) if eos_token else _EOS_CANDIDATES
    for name in names:
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return int(token_id)
    if eos_token:
        raise PrepareError(f"the tokenizer has no token {eos_token!r} to use as EOS")
    raise PrepareError(
        "cannot find an end-of-document token in the tokenizer (tried "
        f"{', '.join(_EOS_CANDIDATES)}); name one with --eos-token"
    )


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    *,
    max_bytes: int | None = None,
    progress: bool | None = None,
) -> HFTokenizer:
    """Train a byte-level BPE on ``texts``, at most their first ``max_bytes`` of UTF-8.

    The texts are streamed, but the trainer's memory grows with the distinct words it has
    seen and its time with the text, hence the cap (README: what training costs).
    ``progress``: None shows the trainer's bars on a terminal and log lines otherwise,
    False nothing.
    """
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise PrepareError(
            f"bpe vocabulary must be at least 258 (256 bytes + EOS + 1), got {vocab_size}"
        )
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress is not False and sys.stderr.isatty(),
    )
    log_lines = progress is not False and not sys.stderr.isatty()
    started = time.monotonic()
    tok.train_from_iterator(
        _training_text(texts, max_bytes, log_lines=log_lines, vocab_size=vocab_size),
        trainer=trainer,
    )
    if log_lines:
        log.info("bpe training: done in %.1f s", time.monotonic() - started)
    return HFTokenizer(tok.to_str(), kind=f"bpe:{vocab_size}", eos_token=BPE_EOS)


_LOG_EVERY_S = 5.0
# Pieces the trainer gets at once: exact cuts (split_text), so the word counts are those
# of the whole texts, and a huge document is not pre-tokenized in one go.
_TRAIN_PIECE_CHARS = 1 << 20


def _training_text(
    texts: Iterable[str], max_bytes: int | None, *, log_lines: bool, vocab_size: int
) -> Iterator[str]:
    """The first ``max_bytes`` of ``texts`` (the last text cut short), in pieces."""
    taken = 0
    last_log = time.monotonic()
    cap = f"capped at {max_bytes / (1 << 20):.0f} MB" if max_bytes is not None else "no cap"
    for text in texts:
        for piece in split_text(text, _TRAIN_PIECE_CHARS):
            data = piece.encode("utf-8")
            if max_bytes is not None and taken + len(data) > max_bytes:
                rest = data[: max_bytes - taken].decode("utf-8", errors="ignore")
                if rest:
                    yield rest
                taken = max_bytes
                break
            taken += len(data)
            yield piece
            if log_lines and time.monotonic() - last_log >= _LOG_EVERY_S:
                last_log = time.monotonic()
                log.info("bpe training: read %.1f MB of text (%s)", taken / (1 << 20), cap)
        if max_bytes is not None and taken >= max_bytes:
            break
    if log_lines:
        log.info(
            "bpe training: read %.1f MB of text (%s); computing %d merges",
            taken / (1 << 20),
            cap,
            vocab_size,
        )


def parse_spec(spec: str) -> tuple[str, Any]:
    """Split a --tokenizer spec into ("byte", None), ("bpe", vocab) or ("file", Path)."""
    if spec == "byte":
        return "byte", None
    if spec.startswith("bpe:"):
        try:
            vocab = int(spec[4:])
        except ValueError:
            raise PrepareError(
                f"bad tokenizer spec {spec!r}: use bpe:VOCAB, e.g. bpe:8192"
            ) from None
        return "bpe", vocab
    path = Path(spec)
    if not path.is_file():
        raise PrepareError(
            f"tokenizer {spec!r} is neither 'byte', 'bpe:VOCAB' nor an existing tokenizer.json file"
        )
    return "file", path
