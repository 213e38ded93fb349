"""Wire protocol v1: message types and the encoding of their frames.

Every message is a multipart ZeroMQ message whose first frame is a small msgpack map
with ``v`` (protocol version) and ``t`` (message type) plus the fields of that type.
Token data never goes inside msgpack: a ``CHUNK`` carries it as raw little-endian frames
after the header, so both ends can send and receive it without copying.

=========  =========  ==============================================================
type       direction  meaning
=========  =========  ==============================================================
hello      c -> s     attach to a job (dataset + plan inputs), ask for a credit window
welcome    s -> c     job id, server instance, dataset fingerprint and sizes, limits
get        c -> s     idempotent: rank ``rank``'s rows of ``count`` global batches at
                      stream positions ``pos``, ``pos + stride*G``, ...
chunk      s -> c     answer to one ``get``: header, tokens ``[rows, seq_len + 1]``,
                      provenance ``int64 [2, rows]`` (window ids, epochs)
err        s -> c     a code from :data:`ERROR_CODES`, a message, whether to retry
ping/pong  both       application-level liveness
bye        c -> s     this connection is done: the server forgets it at once
=========  =========  ==============================================================

A ``get`` names everything it wants, so the server keeps no cursor: any server
instance can answer it at any time, and re-sending it after a reconnect is harmless.

Decoding is strict: a header that is not a map, has the wrong version, misses a field or
has a field of the wrong type or out of range raises :class:`~tokenfeed.errors.ProtocolError`
with a message fit for an ``err`` reply. Sizes are checked *before* unpacking.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
import numpy as np

from tokenfeed.errors import ProtocolError

VERSION = 1

#: Largest header frame either end accepts; headers are a few dozen bytes.
MAX_HEADER_BYTES = 4096
#: Largest string field (dataset names, ids, messages).
_MAX_STR = 512
#: Integers on the wire are non-negative and fit int64 (stream positions are int64).
_MAX_INT = (1 << 63) - 1

#: The fixed list of error codes an ``err`` may carry (see :mod:`tokenfeed.errors`).
ERROR_CODES = frozenset(
    {
        "bad_request",  # malformed or over a limit: fix the request, do not retry
        "unknown_dataset",  # no such dataset in the store
        "unknown_job",  # the server does not know this job (it restarted): say hello again
        "dataset_changed",  # the dataset was replaced under a running job
        "auth_failed",
        "forbidden",
        "connection_limit",
        "overloaded",  # try again later
        "internal",
    }
)

DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


@dataclass(frozen=True)
class JobSpec:
    """What a training run registers; every rank and worker of the run sends the same."""

    dataset: str
    seq_len: int
    batch_size: int
    seed: int
    world_size: int


@dataclass(frozen=True)
class Message:
    """Base of all messages; ``TYPE`` is the ``t`` field on the wire."""

    TYPE: ClassVar[str] = ""

    def header(self) -> bytes:
        """Encode this message as its msgpack header frame."""
        fields = {f: getattr(self, f) for f in _FIELDS[type(self)]}
        packed: bytes = msgpack.packb({"v": VERSION, "t": self.TYPE, **fields})
        return packed


@dataclass(frozen=True)
class Hello(Message):
    """Attach to a job. Ranks and workers of one training run send the same job inputs."""

    TYPE: ClassVar[str] = "hello"
    dataset: str
    seq_len: int
    batch_size: int
    seed: int
    world_size: int
    rank: int
    worker: int
    window: int
    client: str


@dataclass(frozen=True)
class Welcome(Message):
    """The server's answer to ``hello``."""

    TYPE: ClassVar[str] = "welcome"
    server: str
    job: str
    fingerprint: str
    n_tokens: int
    n_windows: int
    dtype: str
    window: int
    max_count: int
    eos_id: int


@dataclass(frozen=True)
class Get(Message):
    """Ask for rank ``rank``'s rows of ``count`` global batches (see module docstring)."""

    TYPE: ClassVar[str] = "get"
    req: int
    job: str
    rank: int
    pos: int
    count: int
    stride: int


@dataclass(frozen=True)
class Chunk(Message):
    """Header of a data message; the token and provenance frames follow it."""

    TYPE: ClassVar[str] = "chunk"
    req: int
    rows: int
    cols: int
    dtype: str


@dataclass(frozen=True)
class Err(Message):
    """A refusal. ``req`` is the request it answers, or -1 for none."""

    TYPE: ClassVar[str] = "err"
    code: str
    message: str
    retry: bool
    req: int


@dataclass(frozen=True)
class Ping(Message):
    """Liveness probe; answered by :class:`Pong`."""

    TYPE: ClassVar[str] = "ping"


@dataclass(frozen=True)
class Pong(Message):
    """Answer to :class:`Ping`."""

    TYPE: ClassVar[str] = "pong"


@dataclass(frozen=True)
class Bye(Message):
    """The client is closing this connection; no answer."""

    TYPE: ClassVar[str] = "bye"


_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls for cls in (Hello, Welcome, Get, Chunk, Err, Ping, Pong, Bye)
}
_FIELDS: dict[type[Message], tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _TYPES.values()
}
_HINTS: dict[type[Message], dict[str, Any]] = {
    cls: {name: typing.get_type_hints(cls)[name] for name in _FIELDS[cls]}
    for cls in _TYPES.values()
}


def decode_header(frame: bytes | memoryview) -> Message:
    """Decode and validate one header frame; raise ProtocolError saying what is wrong."""
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        obj = msgpack.unpackb(
            frame, raw=False, strict_map_key=True, max_str_len=_MAX_STR, max_bin_len=0
        )
    except Exception as exc:  # msgpack raises several unrelated types; map them here
        raise ProtocolError(f"header frame is not valid msgpack: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("header frame must be a msgpack map with 'v' and 't'")
    version = obj.pop("v", None)
    if version != VERSION:
        raise ProtocolError(
            f"protocol version {version!r} is not supported (this end speaks v{VERSION}); "
            "install matching versions of tokenfeed and tokenfeed-server"
        )
    kind = obj.pop("t", None)
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type; expected one of {sorted(_TYPES)}")
    hints = _HINTS[cls]
    if obj.keys() != hints.keys():
        missing = sorted(hints.keys() - obj.keys())
        extra = sorted(str(k) for k in obj.keys() - hints.keys())
        raise ProtocolError(f"{cls.TYPE}: missing fields {missing}, unexpected fields {extra}")
    for name, hint in hints.items():
        _check_field(cls.TYPE, name, obj[name], hint)
    return cls(**obj)


def _check_field(kind: str, name: str, value: object, hint: object) -> None:
    if hint is int:
        # bool is an int subclass; a JSON-ish client sending true for a count is a bug
        if type(value) is not int or not (-1 <= value <= _MAX_INT):
            raise ProtocolError(f"{kind}.{name} must be an integer in [-1, 2**63), got {value!r}")
    elif hint is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{kind}.{name} must be a string, got {type(value).__name__}")
    elif hint is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{kind}.{name} must be a boolean, got {type(value).__name__}")
    else:  # pragma: no cover - a new field type without a check is a programming error
        raise AssertionError(f"no wire check for {kind}.{name}: {hint!r}")


def chunk_frames(
    req: int, tokens: np.ndarray, window_ids: np.ndarray, epochs: np.ndarray
) -> list[Any]:
    """The frames of a ``chunk`` (header, tokens, provenance); arrays are sent zero-copy."""
    dtype = tokens.dtype.newbyteorder("<").name
    header = Chunk(req=req, rows=tokens.shape[0], cols=tokens.shape[1], dtype=dtype).header()
    provenance = np.stack([window_ids, epochs]).astype("<i8", copy=False)
    return [header, np.ascontiguousarray(tokens), provenance]


def decode_chunk(header: Chunk, frames: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Wrap a chunk's payload frames (zero-copy) as (tokens, window_ids, epochs) arrays."""
    if len(frames) != 2:
        raise ProtocolError(f"chunk must carry 2 payload frames, got {len(frames)}")
    dtype = DTYPES.get(header.dtype)
    if dtype is None:
        raise ProtocolError(f"chunk dtype {header.dtype!r} is not one of {sorted(DTYPES)}")
    tokens_buf, meta_buf = (memoryview(f) for f in frames)
    if tokens_buf.nbytes != header.rows * header.cols * dtype.itemsize:
        raise ProtocolError(
            f"chunk token frame has {tokens_buf.nbytes} bytes, header says "
            f"{header.rows}x{header.cols} {header.dtype}"
        )
    if meta_buf.nbytes != 2 * header.rows * 8:
        raise ProtocolError(
            f"chunk provenance frame has {meta_buf.nbytes} bytes, expected {2 * header.rows * 8}"
        )
    tokens = np.frombuffer(tokens_buf, dtype=dtype).reshape(header.rows, header.cols)
    meta = np.frombuffer(meta_buf, dtype="<i8").reshape(2, header.rows)
    return tokens, meta[0], meta[1]
