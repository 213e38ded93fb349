"""One shard file being written, and the digests of its pieces (see
:mod:`~tokenfeed_server.store.format`): split out of the writer."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tokenfeed.dtypes import DTYPES
from tokenfeed.errors import StoreError
from tokenfeed_server.store.format import (
    CHECKSUM_ALGO,
    DTYPE_CODES,
    HEADER_SIZE,
    MAGIC,
    SHARD_VERSION,
    ShardHeader,
    index_offset,
)
from tokenfeed_server.store.manifest import ShardInfo

__all__ = ["PieceHasher", "ShardFile"]

_READ_CHUNK = 1 << 16


class PieceHasher:
    """The piece digests of a file written front to back, except its header, written last.

    Every piece but the first is hashed as its bytes go by. Piece 0 holds the header,
    known only at the end, so :meth:`finish` hashes it from the file then (at most
    ``piece_bytes``, still in the page cache, read in small chunks): keeping a copy
    instead would cost a whole piece of memory per shard, as much as prepare's whole
    budget at its smallest.
    """

    def __init__(self, piece_bytes: int) -> None:
        self.piece_bytes = piece_bytes
        self.digests: list[bytes] = []
        self.current: Any = None  # the hasher of the piece being filled (after piece 0)
        self.offset = HEADER_SIZE  # file offset of the next byte

    def update(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            piece, within = divmod(self.offset, self.piece_bytes)
            take = min(len(view), self.piece_bytes - within)
            if piece > 0:
                if within == 0:
                    if self.current is not None:
                        self.digests.append(self.current.digest())
                    self.current = hashlib.blake2b(digest_size=16)
                self.current.update(view[:take])
            view = view[take:]
            self.offset += take

    def finish(self, pread: Callable[[int, int], bytes]) -> bytes:
        """All the raw digests back to back; ``pread(size, offset)`` reads the finished
        file."""
        first = hashlib.blake2b(digest_size=16)
        offset, end = 0, min(self.piece_bytes, self.offset)
        while offset < end:
            chunk = pread(min(_READ_CHUNK, end - offset), offset)
            if not chunk:
                raise StoreError("shard file shorter than written while hashing its pieces")
            first.update(chunk)
            offset += len(chunk)
        tail = [self.current.digest()] if self.current is not None else []
        return b"".join([first.digest(), *self.digests, *tail])


class ShardFile:
    """One shard being written: body streamed and hashed, header written last."""

    def __init__(self, path: Path, dtype: str, piece_bytes: int) -> None:
        self.path = path
        self.dtype = dtype
        self.tokens = 0
        self.starts: list[np.ndarray] = []
        self.hasher = hashlib.blake2b(digest_size=16)
        self.pieces = PieceHasher(piece_bytes)
        self.file = path.open("w+b")  # read too: piece 0, once the header is in
        self.file.write(b"\0" * HEADER_SIZE)

    def write(self, tokens: np.ndarray, starts: np.ndarray) -> None:
        data = np.ascontiguousarray(tokens).data.cast("B")
        self.file.write(data)
        self.hasher.update(data)
        self.pieces.update(data)
        if len(starts):
            self.starts.append(starts + self.tokens)
        self.tokens += len(tokens)

    def finish(self) -> tuple[ShardInfo, bytes]:
        """The shard as the manifest lists it (no pieces) and its raw piece digests."""
        itemsize = DTYPES[self.dtype].itemsize
        body_end = index_offset(self.tokens, itemsize)
        pad = body_end - HEADER_SIZE - self.tokens * itemsize
        index = (
            np.concatenate(self.starts).astype("<u8") if self.starts else np.empty(0, dtype="<u8")
        )
        tail = b"\0" * pad + index.tobytes()
        self.file.write(tail)
        self.hasher.update(tail)
        self.pieces.update(tail)
        header = ShardHeader(
            MAGIC, SHARD_VERSION, DTYPE_CODES[self.dtype], self.tokens, len(index), body_end
        ).pack()
        self.file.seek(0)
        self.file.write(header)
        self.file.flush()
        fd = self.file.fileno()
        pieces = self.pieces.finish(lambda size, offset: os.pread(fd, size, offset))
        os.fsync(fd)
        self.file.close()
        info = ShardInfo(
            name=self.path.name,
            tokens=self.tokens,
            documents=len(index),
            checksum=f"{CHECKSUM_ALGO}:{self.hasher.hexdigest()}",
        )
        return info, pieces

    def close(self) -> None:
        """Close the file (abort)."""
        self.file.close()
