"""Where a version-3 manifest's sidecar of piece digests is read from, local or remote.

Opening a dataset only checks that the sidecar is there with the size the manifest needs
(one ``stat`` or one listing entry): its bytes are read, and checked against
``pieces_checksum``, the first time a digest is needed (see
:meth:`~tokenfeed_server.store.manifest.Manifest.piece_digests`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from tokenfeed.errors import ManifestError, StoreError
from tokenfeed_server.store.format import DIGEST_BYTES
from tokenfeed_server.store.manifest import Manifest
from tokenfeed_server.store.piece_table import sidecar_checksum
from tokenfeed_server.store.versions import local_version_dir

if TYPE_CHECKING:
    from tokenfeed_server.store.cache import PieceCache
    from tokenfeed_server.store.objects import ObjectStore
    from tokenfeed_server.store.remote_pieces import RemoteSidecar

__all__ = ["attach_local_pieces", "attach_remote_pieces", "sidecar_bytes"]

_FIX = "re-run tokenfeed-server prepare ... --overwrite"
_RDONLY = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)


def sidecar_bytes(manifest: Manifest) -> int:
    """The size the manifest's sidecar must have: 16 bytes per piece."""
    return manifest.piece_bases()[-1] * DIGEST_BYTES


def attach_local_pieces(manifest: Manifest, dir_fd: int, directory: Path) -> None:
    """Check that the sidecar of the build opened through ``dir_fd`` (at ``directory``)
    is a plain file of the right size, and attach its reader (nothing is read now).

    The reader opens it by path when first needed; if ``directory`` was replaced by a
    newer build meanwhile (its sidecar then has another checksum), the retired build
    under ``_tokenfeed/versions/`` is read instead, so digests never come from another
    build (any mismatch left is an error).
    """
    if manifest.format_version < 3:
        return
    path = directory / manifest.pieces_file
    try:
        info = os.stat(manifest.pieces_file, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise ManifestError(f"{path}: the piece sidecar is missing; {_FIX}") from None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read the piece sidecar: {exc}; {_FIX}") from exc
    if not stat.S_ISREG(info.st_mode):
        raise ManifestError(f"{path}: the piece sidecar is not a plain file; {_FIX}")
    want = sidecar_bytes(manifest)
    if info.st_size != want:
        raise ManifestError(
            f"{path}: the piece sidecar has {info.st_size} bytes, the manifest needs {want}; {_FIX}"
        )
    candidates = [path]
    try:
        retired = local_version_dir(directory.parent, directory.name, manifest.fingerprint)
        candidates.append(retired / manifest.pieces_file)
    except (ValueError, StoreError):  # not a dataset directory of a store: no fallback
        pass

    def load() -> bytes:
        first: bytes | None = None
        for candidate in candidates:
            try:
                raw = _read(candidate)
            except FileNotFoundError:
                continue
            if sidecar_checksum(raw) == manifest.pieces_checksum:
                return raw
            first = raw if first is None else first
        if first is None:
            raise ManifestError("the piece sidecar is missing")
        return first  # the caller reports the mismatch

    manifest.attach_pieces(load, str(path))


def _read(path: Path) -> bytes:
    fd = os.open(path, _RDONLY)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def attach_remote_pieces(
    manifest: Manifest,
    objects: ObjectStore,
    name: str,
    sizes: dict[str, int],
    cache: PieceCache | None = None,
) -> RemoteSidecar | None:
    """Check that the sidecar object of dataset ``name`` is listed (``sizes``: key ->
    size) with the right size, and attach its reader (the object is content-addressed,
    so never replaced under a reader). With the server's ``cache``: a
    :class:`~tokenfeed_server.store.remote_pieces.RemoteSidecar` (downloaded into the
    cache directory and memory-mapped, off the loop), returned; else one GET when first
    needed (tools)."""
    if manifest.format_version < 3:
        return None
    key = f"{name}/{manifest.pieces_file}"
    size = sizes.get(key)
    want = sidecar_bytes(manifest)
    if size is None:
        raise ManifestError(
            f"{objects.url(key)}: the piece sidecar object is missing (deleted by gc or by "
            f"hand?); {_FIX}"
        )
    if size != want:
        raise ManifestError(
            f"{objects.url(key)}: the piece sidecar object has {size} bytes, the manifest "
            f"needs {want}; {_FIX}"
        )
    if cache is None:
        manifest.attach_pieces(lambda: objects.get(key), objects.url(key))
        return None
    from tokenfeed_server.store.remote_pieces import RemoteSidecar

    remote = RemoteSidecar(manifest, objects, key, cache)
    manifest.attach_pieces(remote.digests, objects.url(key))
    return remote
