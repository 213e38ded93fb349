"""``manifest.json``: what a dataset holds, and its fingerprint.

Versions 1, 2 and 3 are read (see :mod:`~tokenfeed_server.store.format`); a version-1
manifest keeps its exact JSON and fingerprint, so datasets prepared before version 2 still
serve, and jobs on them keep their fingerprint. A version-3 manifest names a binary sidecar
of piece digests instead of listing them: whoever opens the dataset attaches a reader of
it (:meth:`Manifest.attach_pieces`) and :meth:`Manifest.piece_digests` reads it on first
use; the fingerprint equals the version-2 one of the same content.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
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
from tokenfeed_server.store.piece_table import PieceDigests, PieceState

__all__ = ["Manifest", "ShardInfo", "TokenizerInfo"]

_HEX128 = re.compile(r"[0-9a-f]{32}")
_CHECKSUM = re.compile(r"blake2b-128:[0-9a-f]{32}")
_FIX = "re-run tokenfeed-server prepare ... --overwrite"


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
    Read digests through :meth:`Manifest.shard_pieces`, which serves every version.
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
    #: version 3: the sidecar of piece digests ("" before), and its checksum
    pieces_file: str = ""
    pieces_checksum: str = ""
    #: the sidecar's reader and, once read, the digests (outside equality and the JSON)
    _piece_state: PieceState = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Not a field: outside equality, the JSON and the fingerprint.
        object.__setattr__(self, "_piece_state", PieceState())

    def _content(self, *, pieces: bool = True) -> dict[str, Any]:
        # Built by hand, not with asdict (which deep-copies): 150,000 shards in 0.1 s.
        # The key order is the field order, so the JSON of versions 1 and 2 is unchanged.
        t = self.tokenizer
        v2 = self.format_version == 2
        data: dict[str, Any] = {
            "format_version": self.format_version,
            "name": self.name,
            "dtype": self.dtype,
            "tokenizer": {
                "kind": t.kind, "vocab_size": t.vocab_size, "eos_id": t.eos_id,
                "file_hash": t.file_hash, "file": t.file,
            },
            "total_tokens": self.total_tokens,
            "documents": self.documents,
            "shuffle_seed": self.shuffle_seed,
            "shards": [
                {"name": s.name, "tokens": s.tokens, "documents": s.documents,
                 "checksum": s.checksum, **({"pieces": list(s.pieces)} if v2 and pieces else {})}
                for s in self.shards
            ],
            "created": self.created,
            "extra_files": list(self.extra_files),
        }  # fmt: skip
        if self.format_version >= 2:
            data["piece_bytes"] = self.piece_bytes
        if self.format_version >= 3:
            data["pieces_file"] = self.pieces_file
            data["pieces_checksum"] = self.pieces_checksum
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
            if version == 3 and any("pieces" in s for s in data["shards"]):
                raise ManifestError("a version-3 manifest lists no pieces (pieces_file has them)")
            if version < 3 and ("pieces_file" in data or "pieces_checksum" in data):
                raise ManifestError(f"a version-{version} manifest has no pieces_file")
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
                        pieces=_pieces(s["pieces"]) if version == 2 else (),
                    )
                    for s in data["shards"]
                ),
                created=str(data["created"]),
                extra_files=tuple(str(f) for f in data.get("extra_files", ())),
                piece_bytes=_int(data["piece_bytes"]) if version >= 2 else 0,
                pieces_file=str(data["pieces_file"]) if version >= 3 else "",
                pieces_checksum=str(data["pieces_checksum"]) if version >= 3 else "",
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
        if self.format_version >= 3:
            names.append(self.pieces_file)
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
        if self.format_version >= 3:
            if any(s.pieces for s in self.shards):
                raise ManifestError("a version-3 manifest lists no pieces (pieces_file has them)")
            if not _CHECKSUM.fullmatch(self.pieces_checksum):
                raise ManifestError(
                    f"pieces_checksum {self.pieces_checksum!r} is not blake2b-128:<32 hex>"
                )
            return
        if self.pieces_file or self.pieces_checksum:
            raise ManifestError(f"a version-{self.format_version} manifest has no pieces_file")
        for shard in self.shards:
            want = piece_count(shard.file_size(self.itemsize), self.piece_bytes)
            if len(shard.pieces) != want:
                raise ManifestError(
                    f"shard {shard.name!r} lists {len(shard.pieces)} piece checksums; its "
                    f"file of {shard.file_size(self.itemsize)} bytes has {want} pieces of "
                    f"{self.piece_bytes} bytes"
                )

    def with_names(
        self, shards: Sequence[str], extra_files: Mapping[str, str], pieces_file: str = ""
    ) -> Manifest:
        """This manifest with its shards renamed (in order) and its extra files renamed by
        ``extra_files`` (old -> new name; the tokenizer's file follows), and its sidecar
        renamed ``pieces_file`` (version 3; "": unchanged). The fingerprint of a version-2
        or -3 manifest does not change; the sidecar's reader is kept."""
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
            pieces_file=pieces_file or self.pieces_file,
        )
        renamed._check()
        object.__setattr__(renamed, "_piece_state", self._piece_state)
        return renamed

    # -- piece digests (every version through one accessor) ------------------------------

    def attach_pieces(self, loader: Callable[[], bytes | PieceDigests], where: str) -> None:
        """Say how to read this version-3 manifest's sidecar (``where``: its path or URL,
        for errors); nothing is read until :meth:`piece_digests`."""
        self._piece_state.loader = loader
        self._piece_state.where = where

    def adopt_pieces(self, source: Manifest) -> None:
        """Read digests the way ``source`` does (the same build parsed again, e.g. a
        published manifest and its local build: same sidecar content)."""
        object.__setattr__(self, "_piece_state", source._piece_state)

    def set_piece_digests(self, digests: PieceDigests) -> None:
        """Hand over this version-3 manifest's digests, read and checked by the caller
        (e.g. a sidecar downloaded and memory-mapped off the data plane's loop)."""
        state = self._piece_state
        # Without the state's lock: a blocking reader may hold it while it waits for the
        # very thread that calls this (one assignment of equal content: no race to fear).
        if state.digests is None:
            state.digests = digests
            state.loads += 1

    @property
    def pieces_loaded(self) -> bool:
        """Whether the digests are in memory (version 3: the sidecar was read)."""
        return self.format_version == 2 or self._piece_state.digests is not None

    @property
    def sidecar_reads(self) -> int:
        """How often the sidecar was read (0 until a digest is needed)."""
        return self._piece_state.loads

    def piece_counts(self) -> list[int]:
        """Pieces per shard, in order (derived from the shard sizes; [] in version 1)."""
        if self.format_version < 2:
            return []
        p, size = self.piece_bytes, self.itemsize
        return [piece_count(s.file_size(size), p) for s in self.shards]

    def piece_bases(self) -> list[int]:
        """``bases[k]``: the global id of shard ``k``'s first piece; ``bases[-1]``: the
        number of pieces (computed once)."""
        cached: list[int] | None = self.__dict__.get("_piece_bases")
        if cached is None:
            cached = [0, *itertools.accumulate(self.piece_counts())]
            object.__setattr__(self, "_piece_bases", cached)
        return cached

    def piece_digests(self) -> PieceDigests:
        """Every piece digest by global piece id (version 3: the sidecar is read and
        checked the first time; ManifestError if it is missing or damaged)."""
        state = self._piece_state
        if state.digests is not None:
            return state.digests
        if self.format_version < 2:
            raise ManifestError(
                f"dataset {self.name!r} has a version-1 manifest without piece checksums; {_FIX}"
            )
        if self.format_version == 2:
            with state.lock:
                if state.digests is None:
                    flat = [d for s in self.shards for d in s.pieces]
                    state.digests = PieceDigests(strings=flat)
            return state.digests
        return state.load(self.piece_bases()[-1], self.pieces_checksum, _FIX)

    def shard_pieces(self, k: int) -> tuple[str, ...]:
        """The piece digests of shard ``k`` (every version; () in version 1)."""
        if self.format_version < 3:
            return self.shards[k].pieces
        bases = self.piece_bases()
        return tuple(self.piece_digests()[bases[k] : bases[k + 1]])

    @property
    def fingerprint(self) -> str:
        """A stable hash of the content (not of ``created``): equal iff same token stream.

        Clients compare it across reconnects to notice that a dataset was replaced.
        Version 2 leaves out file names and the piece size too (the per-shard checksums,
        token and document counts still pin every token): a dataset published to object
        storage under content-addressed names keeps the fingerprint of its local build.
        """
        cached: str | None = self.__dict__.get("_fingerprint")
        if cached is not None:
            return cached
        content = self._content(pieces=False)
        del content["created"]
        if self.format_version >= 2:
            del content["piece_bytes"], content["extra_files"]
            content["tokenizer"]["file"] = None
            for shard in content["shards"]:
                del shard["name"]
        if self.format_version >= 3:
            # Version 3 moved the pieces, which a fingerprint never covered: the same
            # content keeps its version-2 fingerprint, so saved states resume.
            del content["pieces_file"], content["pieces_checksum"]
            content["format_version"] = 2
        blob = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
        fingerprint = hashlib.blake2b(blob, digest_size=16).hexdigest()
        object.__setattr__(self, "_fingerprint", fingerprint)
        return fingerprint


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
