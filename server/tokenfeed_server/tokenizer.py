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
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenfeed.errors import PrepareError
from tokenfeed.shards import TokenizerInfo, dtype_for_vocab

__all__ = [
    "BPE_EOS",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "load_dataset_tokenizer",
    "parse_spec",
    "train_bpe",
]

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
        return np.dtype("<u2" if dtype_for_vocab(self.info.vocab_size) == "uint16" else "<u4")

    def encode_batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Encode ``texts``: (all ids back to back, int64 length of each text's ids)."""
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

    def encode_batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
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

    def encode_batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        id_lists = [e.ids for e in encodings]
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


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Train a byte-level BPE on ``texts`` (streamed; memory grows with distinct words)."""
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
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok.to_str(), kind=f"bpe:{vocab_size}", eos_token=BPE_EOS)


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


def load_dataset_tokenizer(info: TokenizerInfo, dataset_path: Path) -> Tokenizer:
    """The tokenizer a dataset was built with (to decode its tokens)."""
    if info.kind == "byte":
        return ByteTokenizer()
    if info.file is None:
        raise PrepareError(f"dataset {dataset_path} does not store its tokenizer file")
    tok = HFTokenizer((dataset_path / info.file).read_text(encoding="utf-8"), kind=info.kind)
    if tok.info.eos_id != info.eos_id:
        tok = HFTokenizer(
            tok.json() or "", kind=info.kind, eos_token=tok._tok.id_to_token(info.eos_id)
        )
    return tok
