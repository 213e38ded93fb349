"""Sparse synthetic datasets of the real format, for scale benchmarks.

``make_dataset(store, name, shards=150_000, apparent_bytes=20 * 10**12)`` writes a valid
dataset (version 2 or 3) whose shard files are sparse: a real header, then zeros (holes).
Every shard has the same size, so the shard checksum and the piece digests are hashed
once, not per shard. Zeros are valid content: the tokenizer's EOS id is 0 (every token
ends a document; the index lists one document start, offset 0, itself zeros), so open,
verify and serving accept it.

    python benchmarks/synthetic_store.py /tmp/scale big --shards 150000 --tb 20 --version 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from tokenfeed_server.store.format import (
    DEFAULT_PIECE_BYTES,
    DIGEST_BYTES,
    DTYPE_CODES,
    HEADER_SIZE,
    MAGIC,
    MANIFEST_NAME,
    PIECES_NAME,
    SHARD_VERSION,
    ShardHeader,
    index_offset,
    shard_size,
)
from tokenfeed_server.store.manifest import Manifest, ShardInfo, TokenizerInfo

__all__ = ["TOKENIZER", "make_dataset"]

#: uint16 tokens, EOS 0: a file of zeros is a run of valid (empty) documents.
TOKENIZER = TokenizerInfo(kind="byte", vocab_size=257, eos_id=0)
_ITEMSIZE = 2
_ZEROS = bytes(1 << 20)


def _hash_zeros(hasher: hashlib.blake2b, n: int) -> None:
    while n > 0:
        take = min(n, len(_ZEROS))
        hasher.update(_ZEROS[:take])
        n -= take


def _piece_digests(header: bytes, size: int, piece_bytes: int) -> bytes:
    """The raw digests of one shard file: header + zeros (equal for every shard)."""
    out = []
    first = hashlib.blake2b(header, digest_size=16)
    _hash_zeros(first, min(piece_bytes, size) - len(header))
    out.append(first.digest())
    full, last = divmod(size - piece_bytes, piece_bytes) if size > piece_bytes else (0, 0)
    if full:
        h = hashlib.blake2b(digest_size=16)
        _hash_zeros(h, piece_bytes)
        out.extend([h.digest()] * full)
    if last:
        h = hashlib.blake2b(digest_size=16)
        _hash_zeros(h, last)
        out.append(h.digest())
    return b"".join(out)


def make_dataset(
    store: str | os.PathLike[str],
    name: str,
    *,
    shards: int,
    apparent_bytes: int,
    version: int = 3,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
) -> Manifest:
    """Write dataset ``name`` of ``shards`` sparse shards, ``apparent_bytes`` in all
    (rounded to whole tokens per shard), manifest ``version`` 2 or 3; returns it."""
    if version not in (2, 3):
        raise ValueError(f"version must be 2 or 3, got {version}")
    per_shard = apparent_bytes // shards
    tokens = (per_shard - HEADER_SIZE - 8) // _ITEMSIZE
    if tokens < 1:
        raise ValueError(f"{apparent_bytes} bytes is too small for {shards} shards")
    size = shard_size(tokens, 1, _ITEMSIZE)
    header = ShardHeader(
        MAGIC, SHARD_VERSION, DTYPE_CODES["uint16"], tokens, 1, index_offset(tokens, _ITEMSIZE)
    ).pack()
    body = hashlib.blake2b(digest_size=16)
    _hash_zeros(body, size - HEADER_SIZE)
    checksum = f"blake2b-128:{body.hexdigest()}"
    raw = _piece_digests(header, size, piece_bytes)
    hexes = tuple(raw[i : i + DIGEST_BYTES].hex() for i in range(0, len(raw), DIGEST_BYTES))
    directory = Path(store) / name
    directory.mkdir(parents=True, exist_ok=True)
    infos = []
    for k in range(shards):
        shard = f"shard-{k:06d}.bin"
        fd = os.open(directory / shard, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(fd, header, 0)
            os.ftruncate(fd, size)  # the rest (tokens and the one-entry index) are holes
        finally:
            os.close(fd)
        infos.append(ShardInfo(shard, tokens, 1, checksum, hexes if version == 2 else ()))
    sidecar = ""
    if version == 3:
        whole = hashlib.blake2b(digest_size=16)
        with (directory / PIECES_NAME).open("wb") as f:
            for _ in range(shards):
                f.write(raw)
                whole.update(raw)
        sidecar = f"blake2b-128:{whole.hexdigest()}"
    manifest = Manifest(
        format_version=version, name=name, dtype="uint16", tokenizer=TOKENIZER,
        total_tokens=tokens * shards, documents=shards, shuffle_seed=0, shards=tuple(infos),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        piece_bytes=piece_bytes, pieces_file=PIECES_NAME if sidecar else "",
        pieces_checksum=sidecar,
    )  # fmt: skip
    (directory / MANIFEST_NAME).write_text(manifest.to_json())
    return manifest


def main(argv: list[str] | None = None) -> int:
    """Command line: make one synthetic dataset and print its figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store", type=Path)
    parser.add_argument("name")
    parser.add_argument("--shards", type=int, default=150_000)
    parser.add_argument("--tb", type=float, default=20.0, help="apparent size in TB (1e12)")
    parser.add_argument("--version", type=int, default=3, choices=(2, 3))
    args = parser.parse_args(argv)
    m = make_dataset(
        args.store, args.name, shards=args.shards, apparent_bytes=int(args.tb * 1e12),
        version=args.version,
    )  # fmt: skip
    path = args.store / args.name
    figures = {
        "shards": len(m.shards),
        "pieces": m.piece_bases()[-1],
        "manifest_bytes": (path / MANIFEST_NAME).stat().st_size,
        "sidecar_bytes": (path / PIECES_NAME).stat().st_size if m.pieces_file else 0,
        "fingerprint": m.fingerprint,
    }
    json.dump(figures, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
