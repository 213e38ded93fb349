"""The on-disk layout of a dataset: directory names, the shard header, sizes.

A *store* is a directory; a *dataset* is ``<store>/<name>/`` holding ``manifest.json``,
the shard files it lists, and optional extra files (for example the ``tokenizer.json``
that produced the tokens). The dataset is one global token stream: its shards
concatenated in manifest order. Every document ends with the tokenizer's EOS id; a
document may continue from one shard into the next.

Shard file ``shard-NNNNNN.bin`` (all integers little-endian)::

    offset  size  field
    0       8     magic  b"TKFSHARD"
    8       4     format version (uint32, = FORMAT_VERSION)
    12      4     dtype code (uint32: 1 = uint16, 2 = uint32)
    16      8     token count T (uint64)
    24      8     document count D (uint64)
    32      8     byte offset of the document index (uint64)
    40      24    reserved, zero
    64      T*s   tokens (s = 2 or 4 bytes), then zero padding to a multiple of 8 bytes
    ...     D*8   document index: uint64 start offsets of the documents that *start* in
                  this shard, local to the shard, increasing

So a shard's exact size is ``64 + pad8(T*s) + 8*D``, which the reader checks along with
every header field against the manifest. The checksum in the manifest
(``blake2b-128:<hex>``) covers every byte after the header; it is computed while
writing, so writing never reads a shard back.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = [
    "CHECKSUM_ALGO",
    "DTYPE_CODES",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "MANIFEST_NAME",
    "TEMP_PREFIX",
    "ShardHeader",
    "index_offset",
    "is_plain_file_name",
    "shard_size",
]

FORMAT_VERSION: int = 1
MAGIC = b"TKFSHARD"
HEADER_SIZE = 64
MANIFEST_NAME = "manifest.json"
#: Writers build a dataset in ``<store>/.tmp-<name>-<pid>-<random>`` and rename it in.
TEMP_PREFIX = ".tmp-"
CHECKSUM_ALGO = "blake2b-128"
#: Token dtype name -> the code stored in a shard header.
DTYPE_CODES: dict[str, int] = {"uint16": 1, "uint32": 2}

_HEADER = struct.Struct("<8sIIQQQ24x")


@dataclass(frozen=True)
class ShardHeader:
    """The fixed 64-byte header at the start of every shard file."""

    magic: bytes
    version: int
    dtype_code: int
    tokens: int
    documents: int
    index_offset: int

    def pack(self) -> bytes:
        """The header's 64 bytes."""
        return _HEADER.pack(
            self.magic,
            self.version,
            self.dtype_code,
            self.tokens,
            self.documents,
            self.index_offset,
        )

    @classmethod
    def unpack(cls, data: bytes) -> ShardHeader:
        """Parse the first :data:`HEADER_SIZE` bytes of a shard (no checks of the values)."""
        return cls(*_HEADER.unpack(data[:HEADER_SIZE]))


def _padded(nbytes: int) -> int:
    return (nbytes + 7) & ~7


def index_offset(tokens: int, itemsize: int) -> int:
    """Byte offset of a shard's document index: header, then tokens padded to 8 bytes."""
    return HEADER_SIZE + _padded(tokens * itemsize)


def shard_size(tokens: int, documents: int, itemsize: int) -> int:
    """The exact size in bytes of a shard holding ``tokens`` tokens and ``documents`` starts."""
    return index_offset(tokens, itemsize) + 8 * documents


def is_plain_file_name(name: str) -> bool:
    """True for a file name with no directory part (manifests may name only those)."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name
