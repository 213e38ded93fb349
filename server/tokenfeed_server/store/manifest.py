"""``manifest.json``: what a dataset holds, and its fingerprint.

Versions 1 and 2 are read (see :mod:`~tokenfeed_server.store.format`); a version-1
manifest keeps its exact JSON and fingerprint, so datasets prepared before version 2 still
serve, and jobs on them keep their fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tokenfeed.dtypes import DTYPES, dtype_for_vocab
from tokenfeed.errors import ManifestError
from tokenfeed_server.store.format import (
    MANIFEST_NAME,
    MANIFEST_VERSIONS,
    MIN_PIECE_BYTES,
    is_plain_file_name,
    piece_count,
    shard_size,
)

__all__ = ["Manifest", "ShardInfo", "TokenizerInfo"]

_HEX128 = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class TokenizerInfo:
    """Identity of the tokenizer that produced a dataset's tokens."""

    kind: str
    vocab_size: int
    eos_id: int
    file_hash: str | None = None
    file: str | None = None

    @property
    def identity(self) -> str:
        """A content hash shared by equal tokenizers, whatever their ``kind`` label says:
        the tokenizer file's hash when there is a file (the ``kind`` names its family and
        may differ between two preparations of one tokenizer), else kind, vocabulary and
        EOS id (a byte tokenizer is those three); vocabulary and EOS id in both."""
        if self.file_hash is not None:
            key = f"file={self.file_hash}|vocab={self.vocab_size}|eos={self.eos_id}"
        else:
            key = f"kind={self.kind}|vocab={self.vocab_size}|eos={self.eos_id}"
        return "blake2b-128:" + hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    def __post_init__(self) -> None:
        if self.vocab_size < 1 or self.vocab_size > 1 << 32:
            raise ValueError(f"vocab_size must be in [1, 2**32], got {self.vocab_size}")
        if not 0 <= self.eos_id < self.vocab_size:
            raise ValueError(
                f"eos_id {self.eos_id} is outside the vocabulary [0, {self.vocab_size})"
            )


@dataclass(frozen=True)
class ShardInfo:
    """One shard as listed in the manifest.

    ``checksum`` covers the bytes after the header (every version); ``pieces`` (version 2,
    else empty) the whole file piece by piece: see :mod:`~tokenfeed_server.store.format`.
    """

    name: str
    tokens: int
    documents: int
    checksum: str
    pieces: tuple[str, ...] = ()

    def file_size(self, itemsize: int) -> int:
        """The exact size of this shard's file for tokens of ``itemsize`` bytes."""
        return shard_size(self.tokens, self.documents, itemsize)


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
    #: version 2: the piece size of every shard's ``pieces`` (0 in version 1)
    piece_bytes: int = 0

    def _content(self) -> dict[str, Any]:
        data = asdict(self)
        data["shards"] = [asdict(s) for s in self.shards]
        data["extra_files"] = list(self.extra_files)
        if self.format_version == 1:  # the exact version-1 JSON (and so fingerprint)
            del data["piece_bytes"]
            for shard in data["shards"]:
                del shard["pieces"]
        else:
            for shard in data["shards"]:
                shard["pieces"] = list(shard["pieces"])
        return data

    @property
    def itemsize(self) -> int:
        """Bytes per token of this dataset's dtype."""
        return int(DTYPES[self.dtype].itemsize)

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
            if isinstance(version, bool) or version not in MANIFEST_VERSIONS:
                readable = ", ".join(map(str, MANIFEST_VERSIONS))
                raise ManifestError(
                    f"format version {version!r} is not supported (this tokenfeed reads "
                    f"versions {readable}); re-run prepare with this version"
                )
            if version == 1 and (
                "piece_bytes" in data or any("pieces" in s for s in data["shards"])
            ):
                raise ManifestError("a version-1 manifest has no piece_bytes or pieces")
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
                        pieces=_pieces(s["pieces"]) if version >= 2 else (),
                    )
                    for s in data["shards"]
                ),
                created=str(data["created"]),
                extra_files=tuple(str(f) for f in data.get("extra_files", ())),
                piece_bytes=_int(data["piece_bytes"]) if version >= 2 else 0,
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
        # Version 2 names files by content (in object storage), so two equal shards share
        # one file: a name may repeat for the very same shard, never for another one.
        by_name = {s.name: s for s in self.shards}
        same = self.format_version >= 2 and all(by_name[s.name] == s for s in self.shards)
        shard_names = list(by_name) if same else [s.name for s in self.shards]
        names = shard_names + list(self.extra_files)
        for name in names:
            if not is_plain_file_name(name):
                raise ManifestError(f"file name {name!r} in the manifest is not a plain name")
        if len(set(names)) != len(names) or MANIFEST_NAME in names:
            raise ManifestError("manifest lists a file twice")
        self._check_pieces()
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

    def _check_pieces(self) -> None:
        if self.format_version == 1:
            if self.piece_bytes or any(s.pieces for s in self.shards):
                raise ManifestError("a version-1 manifest has no piece_bytes or pieces")
            return
        if self.piece_bytes < MIN_PIECE_BYTES:
            raise ManifestError(
                f"piece_bytes is {self.piece_bytes}; it must be at least {MIN_PIECE_BYTES}"
            )
        for shard in self.shards:
            want = piece_count(shard.file_size(self.itemsize), self.piece_bytes)
            if len(shard.pieces) != want:
                raise ManifestError(
                    f"shard {shard.name!r} lists {len(shard.pieces)} piece checksums; its "
                    f"file of {shard.file_size(self.itemsize)} bytes has {want} pieces of "
                    f"{self.piece_bytes} bytes"
                )

    def with_names(self, shards: Sequence[str], extra_files: Mapping[str, str]) -> Manifest:
        """This manifest with its shards renamed (in order) and its extra files renamed by
        ``extra_files`` (old -> new name; the tokenizer's file follows). The fingerprint of
        a version-2 manifest does not change."""
        if len(shards) != len(self.shards):
            raise ValueError(f"{len(shards)} names for {len(self.shards)} shards")
        tokenizer = self.tokenizer
        if tokenizer.file is not None:
            tokenizer = replace(tokenizer, file=extra_files.get(tokenizer.file, tokenizer.file))
        renamed = replace(
            self,
            shards=tuple(replace(s, name=n) for s, n in zip(self.shards, shards, strict=True)),
            extra_files=tuple(sorted(extra_files.get(f, f) for f in self.extra_files)),
            tokenizer=tokenizer,
        )
        renamed._check()
        return renamed

    @property
    def fingerprint(self) -> str:
        """A stable hash of the content (not of ``created``): equal iff same token stream.

        Clients compare it across reconnects to notice that a dataset was replaced.
        Version 2 leaves out file names and the piece size too (the per-shard checksums,
        token and document counts still pin every token): a dataset published to object
        storage under content-addressed names keeps the fingerprint of its local build.
        """
        content = self._content()
        del content["created"]
        if self.format_version >= 2:
            del content["piece_bytes"], content["extra_files"]
            content["tokenizer"]["file"] = None
            for shard in content["shards"]:
                del shard["name"], shard["pieces"]
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


def _pieces(raw: object) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(
        isinstance(p, str) and _HEX128.fullmatch(p) for p in raw
    ):
        raise ValueError("pieces must be a list of 32-character lowercase hex digests")
    return tuple(raw)


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value
