"""Piece digests of a dataset, however its manifest stores them.

Version 2 lists them as hex strings in the JSON; version 3 keeps them in a binary sidecar
(see :mod:`~tokenfeed_server.store.format`) read only when something needs them. Every
consumer goes through :class:`PieceDigests` (from
:meth:`~tokenfeed_server.store.manifest.Manifest.piece_digests`), so the version-3 digests
stay 16 raw bytes each (16 MB per TB of data, not ~95 MB of Python strings) and are
turned into hex only for the pieces asked for.
"""

from __future__ import annotations

import hashlib
import mmap
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import overload

import numpy as np
import numpy.typing as npt

from tokenfeed.errors import ManifestError
from tokenfeed_server.store.format import CHECKSUM_ALGO, DIGEST_BYTES

__all__ = ["PieceDigests", "PieceState", "sidecar_checksum"]

_HEX = 2 * DIGEST_BYTES


def sidecar_checksum(raw: bytes | bytearray | memoryview) -> str:
    """``blake2b-128:<hex>`` of a whole sidecar, as a version-3 manifest lists it."""
    return f"{CHECKSUM_ALGO}:{hashlib.blake2b(raw, digest_size=16).hexdigest()}"


class PieceDigests(Sequence[str]):
    """Every piece digest of a dataset by global piece id (shard by shard), as hex: the
    piece cache's keys. Backed by the sidecar's raw bytes (version 3) or the manifest's
    strings (version 2)."""

    def __init__(
        self, raw: bytes | mmap.mmap | None = None, strings: Sequence[str] | None = None
    ) -> None:
        self._strings = strings
        self._raw = raw
        self._rows: npt.NDArray[np.uint8] | None = None
        if raw is not None:
            self._rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, DIGEST_BYTES)
        self._len = len(strings) if strings is not None else len(raw or b"") // DIGEST_BYTES

    @property
    def nbytes(self) -> int:
        """Bytes of raw digests held (0 for the strings of a version-2 manifest)."""
        return len(self._raw) if self._raw is not None else 0

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return self.take(range(*index.indices(self._len)))
        if self._strings is not None:
            return self._strings[index]
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"piece {index} of {self._len}")
        assert self._raw is not None
        return self._raw[index * DIGEST_BYTES : (index + 1) * DIGEST_BYTES].hex()

    def take(self, ids: Iterable[int]) -> list[str]:
        """The digests of pieces ``ids`` in order: one numpy gather and one hex call for
        the raw form (no Python per piece but the final split)."""
        if self._strings is not None:
            return list(map(self._strings.__getitem__, ids))
        assert self._rows is not None
        index = np.fromiter(ids, dtype=np.int64)
        text = self._rows[index].tobytes().hex()
        return [text[i : i + _HEX] for i in range(0, len(text), _HEX)]

    def raw(self, first: int, end: int) -> bytes:
        """The raw bytes of digests ``[first, end)`` (for content ids)."""
        if self._raw is not None:
            return bytes(self._raw[first * DIGEST_BYTES : end * DIGEST_BYTES])
        assert self._strings is not None
        return bytes.fromhex("".join(self._strings[first:end]))


class PieceState:
    """The lazily loaded digests of one manifest (not part of its content or equality).

    ``loader`` returns the sidecar's bytes; they are checked against the manifest's
    length and checksum once, then kept. ``loads`` counts sidecar reads (tests, metrics).
    """

    def __init__(self) -> None:
        #: the sidecar's bytes, or digests already read and checked (used as they are)
        self.loader: Callable[[], bytes | PieceDigests] | None = None
        self.where = ""
        self.digests: PieceDigests | None = None
        self.loads = 0
        self.lock = threading.Lock()

    def load(self, count: int, checksum: str, fix: str) -> PieceDigests:
        """The digests, read and checked on the first call (ManifestError if missing,
        of the wrong size or damaged)."""
        with self.lock:
            if self.digests is not None:
                return self.digests
            if self.loader is None:
                raise ManifestError(
                    f"the piece digests of this version-3 manifest were never attached "
                    f"(its {self.where or 'sidecar'} is unknown); {fix}"
                )
            try:
                raw = self.loader()
            except (OSError, ManifestError) as exc:
                raise ManifestError(
                    f"{self.where}: cannot read the piece sidecar ({exc}); {fix}"
                ) from exc
            if isinstance(raw, PieceDigests):  # checked by the loader (and counted)
                self.digests = raw
                return raw
            self.loads += 1
            if len(raw) != count * DIGEST_BYTES:
                raise ManifestError(
                    f"{self.where}: the piece sidecar has {len(raw)} bytes, the manifest "
                    f"needs {count * DIGEST_BYTES} ({count} pieces); {fix}"
                )
            actual = sidecar_checksum(raw)
            if actual != checksum:
                raise ManifestError(
                    f"{self.where}: the piece sidecar is damaged (checksum {actual}, the "
                    f"manifest says {checksum}); {fix}"
                )
            self.digests = PieceDigests(raw=bytes(raw))
            return self.digests
