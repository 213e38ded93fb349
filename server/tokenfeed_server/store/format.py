"""The on-disk layout of a dataset: directory names, the shard header, sizes.

A *store* is a directory; a *dataset* is ``<store>/<name>/`` holding ``manifest.json``,
the shard files it lists, and optional extra files (for example the ``tokenizer.json``
that produced the tokens). The dataset is one global token stream: its shards
concatenated in manifest order. Every document ends with the tokenizer's EOS id; a
document may continue from one shard into the next.

Shard file ``shard-NNNNNN.bin`` (all integers little-endian)::

    offset  size  field
    0       8     magic  b"TKFSHARD"
    8       4     shard format version (uint32, = SHARD_VERSION, 1 in every version)
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

Versions. The shard file above has not changed since version 1 (its header says 1).
The *manifest* has a version of its own (``format_version``, :data:`MANIFEST_VERSION`);
readers accept every version in :data:`MANIFEST_VERSIONS`:

* **1**: the layout above; one checksum per shard.
* **2** (written since object storage): adds ``piece_bytes`` P (default 1 MiB) and, per
  shard, ``pieces``: the ``blake2b-128`` hex digest of each piece of the shard *file*,
  piece ``i`` = file bytes ``[i*P, min((i+1)*P, size))`` (the header included), so a
  reader that fetches a shard in pieces (from object storage, into a cache) verifies
  each piece on its own. The writer hashes pieces while writing, except the first,
  which holds the header written last: that one piece is read back from the file
  (page cache) once the header is in. A v2 fingerprint covers the token stream and
  the tokenizer, not file names nor the piece size, so the same corpus prepared on
  local disk and published to object storage (where shard names differ) has the same
  fingerprint.
* **3** (written by default since the scale work): the per-piece digests move out of the
  JSON into a binary sidecar the manifest names (``pieces_file``, :data:`PIECES_NAME`
  locally): the raw 16-byte digests of every piece of every shard, concatenated in shard
  order (shard ``k`` has ``ceil(size_k / P)`` pieces, derived from its token and
  document counts), with ``pieces_checksum`` (``blake2b-128:<hex>`` of the whole
  sidecar) in the manifest, so a damaged sidecar is an error, never wrong digests. The
  sidecar is read only when something needs digests (a remote dataset's first read,
  verify, publish), never to open or list a dataset: a 20 TB dataset has 20 M pieces, 44
  MB of JSON strings per TB in version 2, 16 MB of sidecar per TB here. The fingerprint
  of a version-3 build equals the version-2 fingerprint of the same content (it never
  covered pieces), so saved states resume across the format change.

In object storage a dataset ``NAME`` under ``s3://BUCKET/PREFIX`` is
``PREFIX/NAME/manifest.json`` (uploaded last: the only entry point) plus its files under
content-addressed names: shard ``shard-<id>.bin`` with ``<id>`` =
:func:`shard_content_id` (a hash of P and the piece digests, so of every byte of the
file), an extra file (and the version-3 sidecar) ``<stem>-<blake2b-128 hex>.<suffix>``.
An object that a published manifest names is never overwritten (same name = same bytes) and only
``tokenfeed-server gc`` deletes objects, those no current manifest names.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "CHECKSUM_ALGO",
    "DEFAULT_PIECE_BYTES",
    "MANIFEST_VERSION",
    "MANIFEST_VERSIONS",
    "DIGEST_BYTES",
    "MIN_PIECE_BYTES",
    "PIECES_NAME",
    "SHARD_VERSION",
    "piece_count",
    "piece_digest",
    "shard_content_id",
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

#: The shard header's version (unchanged since version 1).
SHARD_VERSION: int = 1
#: The manifest version this tokenfeed writes.
MANIFEST_VERSION: int = 3
#: The manifest versions this tokenfeed reads.
MANIFEST_VERSIONS: tuple[int, ...] = (1, 2, 3)
#: The version-3 sidecar of piece digests in a local dataset directory.
PIECES_NAME = "pieces.bin"
#: Bytes of one piece digest in the sidecar (blake2b-128).
DIGEST_BYTES = 16
#: Older name of :data:`SHARD_VERSION` (the header check of the reader uses it).
FORMAT_VERSION: int = SHARD_VERSION
#: The piece size of version-2 manifests unless prepare is told otherwise.
DEFAULT_PIECE_BYTES = 1 << 20
#: The smallest piece: the first piece must hold the whole header.
MIN_PIECE_BYTES = 4096
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


def piece_count(file_size: int, piece_bytes: int) -> int:
    """How many pieces of ``piece_bytes`` a file of ``file_size`` bytes has (the last may
    be short; a shard is never empty, it has at least a header)."""
    return -(-file_size // piece_bytes)


def piece_digest(data: bytes | bytearray | memoryview) -> str:
    """The hex digest of one piece, as a version-2 manifest lists it."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def shard_content_id(piece_bytes: int, pieces: Sequence[str] | bytes) -> str:
    """The content address of a shard file: blake2b-128 of P and its piece digests.

    Equal ids mean equal files (every byte is under some piece digest), so an object
    store may skip uploading a shard whose name already exists. ``pieces``: hex digests
    (version 2) or their raw bytes back to back (a slice of a version-3 sidecar).
    """
    h = hashlib.blake2b(digest_size=16, person=b"tkf-shard-v2")
    h.update(piece_bytes.to_bytes(8, "little"))
    if isinstance(pieces, bytes):
        h.update(pieces)
        return h.hexdigest()
    for digest in pieces:
        h.update(bytes.fromhex(digest))
    return h.hexdigest()
