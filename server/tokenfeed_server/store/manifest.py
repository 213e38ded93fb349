"""``manifest.json``: what a dataset holds, and its fingerprint."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from tokenfeed.dtypes import DTYPES, dtype_for_vocab
from tokenfeed.errors import ManifestError
from tokenfeed_server.store.format import FORMAT_VERSION, MANIFEST_NAME, is_plain_file_name

__all__ = ["Manifest", "ShardInfo", "TokenizerInfo"]


@dataclass(frozen=True)
class TokenizerInfo:
    """Identity of the tokenizer that produced a dataset's tokens."""

    kind: str
    vocab_size: int
    eos_id: int
    file_hash: str | None = None
    file: str | None = None

    def __post_init__(self) -> None:
        if self.vocab_size < 1 or self.vocab_size > 1 << 32:
            raise ValueError(f"vocab_size must be in [1, 2**32], got {self.vocab_size}")
        if not 0 <= self.eos_id < self.vocab_size:
            raise ValueError(
                f"eos_id {self.eos_id} is outside the vocabulary [0, {self.vocab_size})"
            )


@dataclass(frozen=True)
class ShardInfo:
    """One shard as listed in the manifest."""

    name: str
    tokens: int
    documents: int
    checksum: str


@dataclass(frozen=True)
class Manifest:
    """The content of ``manifest.json``: everything needed to open and trust a dataset."""

    format_version: int
    name: str
    dtype: str
    tokenizer: TokenizerInfo
    total_tokens: int
    documents: int
    shuffle_seed: int
    shards: tuple[ShardInfo, ...]
    created: str
    extra_files: tuple[str, ...] = field(default=())

    def _content(self) -> dict[str, Any]:
        data = asdict(self)
        data["shards"] = [asdict(s) for s in self.shards]
        data["extra_files"] = list(self.extra_files)
        return data

    def to_json(self) -> str:
        """Serialize to the JSON text of ``manifest.json``."""
        return json.dumps(self._content(), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse and check ``manifest.json`` text; raise ManifestError on any problem."""
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise TypeError("top level is not an object")
            version = data["format_version"]
            if version != FORMAT_VERSION:
                raise ManifestError(
                    f"format version {version!r} is not supported (this tokenfeed reads "
                    f"version {FORMAT_VERSION}); re-run prepare with this version"
                )
            manifest = cls(
                format_version=int(version),
                name=str(data["name"]),
                dtype=str(data["dtype"]),
                tokenizer=_tokenizer(data["tokenizer"]),
                total_tokens=_int(data["total_tokens"]),
                documents=_int(data["documents"]),
                shuffle_seed=_int(data["shuffle_seed"]),
                shards=tuple(
                    ShardInfo(
                        name=str(s["name"]),
                        tokens=_int(s["tokens"]),
                        documents=_int(s["documents"]),
                        checksum=str(s["checksum"]),
                    )
                    for s in data["shards"]
                ),
                created=str(data["created"]),
                extra_files=tuple(str(f) for f in data.get("extra_files", ())),
            )
        except ManifestError:
            raise
        except (ValueError, TypeError, KeyError) as exc:
            raise ManifestError(f"malformed manifest: {type(exc).__name__}: {exc}") from exc
        except RecursionError:  # JSON nested deeper than the parser goes
            raise ManifestError("malformed manifest: nested too deeply") from None
        manifest._check()
        return manifest

    def _check(self) -> None:
        if self.dtype not in DTYPES:
            raise ManifestError(
                f"unknown dtype {self.dtype!r} (expected one of {', '.join(sorted(DTYPES))})"
            )
        if self.dtype != dtype_for_vocab(self.tokenizer.vocab_size) and self.dtype != "uint32":
            raise ManifestError(
                f"dtype {self.dtype} cannot hold vocab_size {self.tokenizer.vocab_size}"
            )
        if not self.shards:
            raise ManifestError("manifest lists no shards")
        if sum(s.tokens for s in self.shards) != self.total_tokens:
            raise ManifestError("total_tokens differs from the sum of the shards' tokens")
        if sum(s.documents for s in self.shards) != self.documents:
            raise ManifestError("documents differs from the sum of the shards' documents")
        names = [s.name for s in self.shards] + list(self.extra_files)
        for name in names:
            if not is_plain_file_name(name):
                raise ManifestError(f"file name {name!r} in the manifest is not a plain name")
        if len(set(names)) != len(names) or MANIFEST_NAME in names:
            raise ManifestError("manifest lists a file twice")
        file = self.tokenizer.file
        # The server hands this file to any reader of the dataset: it must be one of the
        # dataset's own files, and its hash known, so nothing else can ever be served.
        if file is not None and file not in self.extra_files:
            raise ManifestError(
                f"tokenizer.file {file!r} is not among the dataset's files "
                f"(extra_files: {list(self.extra_files)})"
            )
        if file is not None and self.tokenizer.file_hash is None:
            raise ManifestError(f"tokenizer.file {file!r} is set but tokenizer.file_hash is not")

    @property
    def fingerprint(self) -> str:
        """A stable hash of the content (not of ``created``): equal iff same token stream.

        Clients compare it across reconnects to notice that a dataset was replaced.
        """
        content = self._content()
        del content["created"]
        blob = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(blob, digest_size=16).hexdigest()


_TOKENIZER_FIELDS = ("kind", "vocab_size", "eos_id", "file_hash", "file")


def _tokenizer(raw: object) -> TokenizerInfo:
    """The manifest's tokenizer table, every field of its exact type (ManifestError naming
    the field otherwise): it reaches every client, in /v1/datasets and each welcome."""
    if not isinstance(raw, dict):
        raise ManifestError(f"tokenizer is not an object: {raw!r}")
    unknown = sorted(set(raw) - set(_TOKENIZER_FIELDS))
    if unknown:
        raise ManifestError(f"tokenizer has unknown fields {unknown}")
    for key in ("kind", "vocab_size", "eos_id"):
        if key not in raw:
            raise ManifestError(f"tokenizer.{key} is missing")
    for key in ("kind", "file_hash", "file"):
        value = raw.get(key)
        if (value is not None and not isinstance(value, str)) or (key == "kind" and not value):
            raise ManifestError(f"tokenizer.{key} must be a non-empty string, got {value!r}")
    for key in ("vocab_size", "eos_id"):
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ManifestError(f"tokenizer.{key} must be an integer, got {value!r}")
    file = raw.get("file")
    if file is not None and not is_plain_file_name(file):
        raise ManifestError(f"tokenizer.file {file!r} is not a plain file name")
    try:
        return TokenizerInfo(**raw)
    except ValueError as exc:
        raise ManifestError(f"tokenizer: {exc}") from exc


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value
