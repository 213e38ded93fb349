"""Check a published dataset against its manifest: every object there with its size and,
piece by piece, its checksum (``tokenfeed-server inspect --verify``)."""

from __future__ import annotations

from tokenfeed.errors import CorruptShard, ManifestError
from tokenfeed_server.store.format import piece_digest
from tokenfeed_server.store.manifest import Manifest
from tokenfeed_server.store.objects import ObjectStore

__all__ = ["verify_published"]


def verify_published(
    store: ObjectStore, name: str, manifest: Manifest, *, pieces: bool = False
) -> int:
    """Check that every file ``manifest`` names exists with its exact size and, with
    ``pieces``, that every piece of every shard matches its checksum (downloads the
    whole dataset, a piece at a time). Returns the bytes checked; raises CorruptShard
    naming the object and the piece."""
    checked = 0
    for shard in manifest.shards:
        key = f"{name}/{shard.name}"
        size = shard.file_size(manifest.itemsize)
        info = store.head(key)
        if info is None:
            raise CorruptShard(f"{store.url(key)}: shard object is missing; {_FIX}")
        if info.size != size:
            raise CorruptShard(
                f"{store.url(key)}: {info.size} bytes, the manifest says {size}; {_FIX}"
            )
        if not pieces:
            continue
        if not shard.pieces:
            raise ManifestError(
                f"{store.url(name)}: version-{manifest.format_version} manifest has no piece "
                "checksums to verify"
            )
        for i, expected in enumerate(shard.pieces):
            start = i * manifest.piece_bytes
            data = store.get_range(key, start, min(start + manifest.piece_bytes, size))
            if piece_digest(data) != expected:
                raise CorruptShard(
                    f"{store.url(key)}: piece {i} (bytes {start}..{start + len(data)}) does "
                    f"not match its checksum; {_FIX}"
                )
            checked += len(data)
    for extra in manifest.extra_files:
        if store.head(f"{name}/{extra}") is None:
            raise CorruptShard(f"{store.url(f'{name}/{extra}')}: file is missing; {_FIX}")
    return checked


_FIX = "re-publish the dataset with tokenfeed-server prepare ... --overwrite"
