"""Pieces: the cache's unit, and lazy lists of them.

A *piece* is a range of a shard file (see :mod:`~tokenfeed_server.store.format`: a
version-2 manifest lists the blake2b-128 digest of every piece). A big dataset has
millions, so the lists of pieces the cache is handed (a dataset's, the prefetch plan's)
make each :class:`PieceRef` only when it is asked for: :class:`PieceSequence` is that
list, one implementation of the indexing for :class:`PieceList` (a dataset's pieces,
shard by shard) and :class:`WantedPieces` (ranges of several datasets' pieces, back to
back).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, overload

from tokenfeed_server.store.manifest import Manifest

if TYPE_CHECKING:
    from tokenfeed_server.store.objects import ObjectStore
    from tokenfeed_server.store.remote import RemoteDataset

__all__ = [
    "PieceList",
    "PieceRange",
    "PieceRef",
    "PieceSequence",
    "PieceSource",
    "WantedPieces",
]


class PieceSource(Protocol):
    """Where pieces come from: an object store's range reads."""

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of object ``key``."""
        ...


@dataclass(frozen=True)
class PieceRef:
    """One piece: its digest (the cache's key), where to fetch it, and the dataset it
    was asked for (whose storage health a fault or a fetch is recorded under)."""

    digest: str
    key: str  # object key, relative to the store's prefix
    start: int
    stop: int
    url: str  # the object's full URL, for error messages
    dataset: str = ""  # "": the key's first segment (the dataset's directory)

    @property
    def dataset_name(self) -> str:
        """The dataset this piece was asked for."""
        return self.dataset or self.key.partition("/")[0]

    @property
    def size(self) -> int:
        """Bytes in the piece."""
        return self.stop - self.start


class PieceSequence(Sequence[PieceRef]):
    """Segments of pieces back to back, each ref made when asked for.

    ``counts[k]`` pieces are in segment ``k``; a subclass says what piece ``i`` of
    segment ``k`` is (:meth:`_segment_ref`).
    """

    def __init__(self, counts: Sequence[int]) -> None:
        base = [0]
        for count in counts:
            base.append(base[-1] + count)
        #: base[k] = index of segment k's first piece; base[-1] = the number of pieces
        self.base = base

    def __len__(self) -> int:
        return self.base[-1]

    @overload
    def __getitem__(self, index: int) -> PieceRef: ...

    @overload
    def __getitem__(self, index: slice) -> list[PieceRef]: ...

    def __getitem__(self, index: int | slice) -> PieceRef | list[PieceRef]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"piece {index} of {len(self)}")
        k = bisect.bisect_right(self.base, index) - 1
        return self._segment_ref(k, index - self.base[k])

    def _segment_ref(self, k: int, i: int) -> PieceRef:
        raise NotImplementedError


class PieceList(PieceSequence):
    """The pieces of a remote dataset's shard files in order (a segment per shard)."""

    def __init__(self, name: str, manifest: Manifest, objects: ObjectStore) -> None:
        # counts from the shard sizes: the digests are read only when a ref is made
        super().__init__(manifest.piece_counts())
        self._name = name
        self._manifest = manifest
        self._objects = objects
        self._piece = manifest.piece_bytes
        #: Bytes of every shard file.
        self.sizes = [s.file_size(manifest.itemsize) for s in manifest.shards]
        self._urls: dict[int, str] = {}

    def _segment_ref(self, k: int, i: int) -> PieceRef:
        shard = self._manifest.shards[k]
        key = f"{self._name}/{shard.name}"
        url = self._urls.get(k)
        if url is None:
            url = self._urls[k] = self._objects.url(key)
        start = i * self._piece
        stop = min(start + self._piece, self.sizes[k])
        digest = self._manifest.piece_digests()[self.base[k] + i]
        return PieceRef(digest, key, start, stop, url, self._name)


#: (dataset, first piece id, end piece id) of a remote dataset's pieces
PieceRange = tuple["RemoteDataset", int, int]


class WantedPieces(PieceSequence):
    """Disjoint piece ranges of remote datasets as one sequence (a segment per range)."""

    def __init__(self, ranges: list[PieceRange]) -> None:
        super().__init__([end - first for _, first, end in ranges])
        self._ranges = ranges

    def _segment_ref(self, k: int, i: int) -> PieceRef:
        ds, first, _ = self._ranges[k]
        return ds.pieces[first + i]

    def digests(self) -> list[str]:
        """The pieces' digests, in order."""
        out: list[str] = []
        for ds, first, end in self._ranges:
            out.extend(ds.digests.take(range(first, end)))
        return out
