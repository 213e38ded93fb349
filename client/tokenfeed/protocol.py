"""Wire protocol v2: message types, their fields, and the encoding of their frames.

Every message is a multipart ZeroMQ message whose first frame is a small msgpack map
with ``v`` (protocol version, :data:`VERSION`) and ``t`` (message type) plus the fields of
that type. Token data never goes inside msgpack: a ``chunk`` carries it as raw
little-endian frames after the header, so both ends send and receive it without copying.

Messages
--------
=========  =========  ==============================================================
type       direction  meaning
=========  =========  ==============================================================
hello      c -> s     attach to a job (dataset + plan inputs), ask for a credit window
welcome    s -> c     job id, server instance, dataset fingerprint and sizes, limits
get        c -> s     idempotent: rank ``rank``'s rows of ``count`` global batches at
                      stream positions ``pos``, ``pos + stride*G``, ...
chunk      s -> c     answer to one ``get``: header, tokens ``[rows, cols]``, then
                      provenance ``int64 [len(provenance), rows]`` (one named row each)
err        s -> c     a code from :data:`ERROR_CODES`, a message, whether to retry
ping/pong  both       application-level liveness
bye        c -> s     this connection is done: the server forgets it at once
=========  =========  ==============================================================

A ``get`` names everything it wants, so the server keeps no cursor: any server
instance can answer it at any time, and re-sending it after a reconnect is harmless.

Fields (``*``: optional, with the default shown; every other field is required)
-------------------------------------------------------------------------------
=======  ====================================================================================
hello    dataset: str, seq_len: int, batch_size: int, seed: int, world_size: int, rank: int,
         worker: int, window: int, client: str, fingerprint*: str = "" (when set, the
         dataset the client expects: a server serving another build answers
         ``dataset_changed`` saying both fingerprints),
         sources*: list[str] = [], schedule*: list[list[int]] = [],
         fingerprints*: list[str] = [] (a mixture, see "Mixtures" below),
         shuffle*: str = "global", region_windows*: int = 0, block_regions*: int = 0
         (the order, see "Shuffle" below)
welcome  server: str, job: str, fingerprint: str, n_tokens: int, n_windows: int, dtype: str,
         window: int, max_count: int, eos_id: int,
         region_windows*: int = 0, block_regions*: int = 0 (a single dataset's block sizes),
         source_fingerprints*: list[str] = [], source_tokens*: list[int] = [],
         source_windows*: list[int] = [], source_region_windows*: list[int] = [],
         source_block_regions*: list[int] = [] (a mixture's sources, in ``sources`` order)
get      req: int, job: str, rank: int, pos: int, count: int, stride: int,
         consumed*: int = -1 (the trainer's consumed position, see "Progress" below;
         -1: not known)
chunk    req: int, rows: int, cols: int, dtype: str, provenance: list[str] (names of the
         provenance rows, in frame order: ``window`` and ``epoch``, and ``source`` for a
         mixture)
err      code: str, message: str, retry: bool, req: int (-1: answers no particular request)
bye      consumed*: int = -1 (as in ``get``: the last word of a closing connection)
=======  ====================================================================================

Mixtures
--------
A ``hello`` with ``sources`` attaches to a mixture of datasets (see
:class:`tokenfeed.mixture.Mixture`): ``sources`` are the dataset names in the mixture's
``names`` order (non-empty, valid names, no duplicates), ``dataset`` is then ``""``, and
``schedule`` is ``Mixture.to_wire()``: rows ``[start, w_0, ..., w_{n-1}]`` of
``len(sources) + 1`` non-negative ints (the server decodes them with
``Mixture.from_wire`` and refuses a bad schedule with ``bad_request``). ``fingerprints``
is empty or one expected build per source (``""``: none for that source); a source that
is another build is refused with ``dataset_changed`` naming it. A mixture's
``fingerprint``, when set, is the whole build the client expects (the ``welcome``'s
:func:`mixture_fingerprint`, e.g. on a reconnect), refused with ``dataset_changed``
when it differs. Every source must be readable by the tenant (a refusal names the
source) and all must share one tokenizer.

The ``welcome`` of a mixture carries one entry per source in each ``source_*`` list:
its build (``source_fingerprints``), tokens, windows of ``seq_len``, and block sizes
(``source_region_windows``/``source_block_regions``, 0 under ``shuffle="global"``).
Its ``fingerprint`` is :func:`mixture_fingerprint` of the source fingerprints,
``n_tokens``/``n_windows`` the sums over the sources, ``dtype``/``eos_id`` the shared
ones, and ``region_windows``/``block_regions`` 0.

Row ``p`` of the stream comes from source ``s`` at that source's own stream position
``q`` (``Mixture.locate``); source ``s`` walks its own plan (the job's ``seq_len``,
``batch_size``, ``world_size``, shuffle, and seed ``mixture.source_seed(seed, name)``),
so a chunk's ``window`` and ``epoch`` rows are that source's window and source-local
epoch, and its ``source`` row (:data:`ROW_SOURCE`) the index into ``sources``. A
single-dataset chunk has no ``source`` row.

Shuffle
-------
``shuffle`` is ``"global"`` (a permutation of all windows per epoch; then
``region_windows`` and ``block_regions`` must be 0) or ``"block"`` (regions of
``region_windows`` consecutive windows, visited ``block_regions`` regions at a time, see
:class:`tokenfeed.plan.Plan`). Under ``"block"`` a size of 0 asks the server to derive it
from the dataset's shards (``default_block_sizes``); the ``welcome`` says the sizes used
(``region_windows``/``block_regions`` for one dataset, ``source_region_windows``/
``source_block_regions`` per source of a mixture). A size the hello sets applies to every
source of a mixture; one left at 0 is derived per source. Derived sizes are a pure
function of the build's shard sizes and ``seq_len`` (never of a server's cache), so a
pinned build keeps them; a single-dataset client resuming a run may send them back to
pin them outright.

Progress
--------
The server sends ahead of the trainer (the request window, the DataLoader's prefetch), so
what it served says little about how far training is. ``consumed`` on ``get`` and ``bye``
is the stream position (global samples from the stream's start, the same on every rank)
up to which the rank's training loop has taken batches, read from a counter the loader
shares with its workers when the message is sent. It is information only: the server
keeps the largest value reported per job and never serves differently because of it.
The loader reports a value that no message carried for a few seconds (a pause, the end of
the loop) on a short connection of its own: ``hello`` then ``bye``.

Values and bounds
-----------------
A field is an ``int`` (in ``[-1, 2**63)``; ``bool`` is not an int here), a ``str`` (at
most :data:`MAX_STR` = 512 bytes of UTF-8, not characters), a ``bool``, a list
(``tuple[T, ...]``, at most :data:`MAX_ITEMS` items) or a map with string keys
(``dict[str, T]``, at most :data:`MAX_ITEMS` entries) of those. Field types nest at
most :data:`MAX_DEPTH` levels (checked for every message type at import). A header frame is at most
:data:`MAX_HEADER_BYTES` (64 KiB: room for a list of a thousand 40-byte names; equal to
the server's default ``max_message_bytes``, which bounds the whole message, header and
any other frames together). Sizes are checked *before* anything is
unpacked: the frame length first, then msgpack's own per-container limits, so a hostile
header never allocates more than its few kilobytes.

Evolution
---------
* **Optional fields** carry a default. The encoder leaves a field out when it holds its
  default, and the decoder fills the default in for a missing one. A field whose default
  means "today's behaviour" can therefore be added without a version bump: an older peer
  never sees it unless it is used.
* **Unknown fields are refused**, naming them and saying the peer is newer. Ignoring one
  would be silent wrong data: a server that skipped an ``fingerprint`` or a mixture
  schedule it did not understand would serve data the trainer did not ask for. A refusal
  says "upgrade"; silence trains on the wrong tokens.
* **Provenance rows** are named: a receiver reads the rows it knows and ignores the
  others (extra per-row metadata cannot change the tokens it gets), so a new row such
  as a mixture's ``source`` is added without touching old clients.
* **The version** changes only for a change old peers cannot be told about in a field:
  each end refuses another version with a message that says to install matching versions
  of ``tokenfeed`` and ``tokenfeed-server`` (a server answers an ``err``, a client raises).

Decoding is strict: a header that is not a map, has the wrong version, misses a
required field, has an unknown one, or a value of the wrong type or out of bounds raises
:class:`~tokenfeed.errors.ProtocolError` with a message fit for an ``err`` reply.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
import numpy as np

from tokenfeed.dtypes import DTYPES
from tokenfeed.errors import ProtocolError

__all__ = [
    "DTYPES",  # re-exported: the wire names token dtypes by its keys
    "ERROR_CODES",
    "MAX_DEPTH",
    "MAX_HEADER_BYTES",
    "MAX_ITEMS",
    "MAX_PROVENANCE_ROWS",
    "MAX_STR",
    "ROW_EPOCH",
    "ROW_SOURCE",
    "ROW_WINDOW",
    "SHUFFLES",
    "VERSION",
    "Bye",
    "Chunk",
    "Err",
    "Get",
    "Hello",
    "JobSpec",
    "Message",
    "Ping",
    "Pong",
    "Welcome",
    "chunk_frames",
    "decode_chunk",
    "decode_header",
    "mixture_fingerprint",
    "require_rows",
]

VERSION = 2

#: Largest header frame either end accepts (see "Values and bounds" above).
MAX_HEADER_BYTES = 64 * 1024
#: Largest string value in UTF-8 bytes, not characters (dataset names, ids, messages).
MAX_STR = 512
#: Most items of one list or entries of one map.
MAX_ITEMS = 1024
#: Deepest nesting of a field's type (``dict[str, tuple[int, ...]]`` is 2).
MAX_DEPTH = 3
#: Most named provenance rows one chunk may carry.
MAX_PROVENANCE_ROWS = 16
#: Integers on the wire are >= -1 and fit int64 (stream positions are int64).
_MAX_INT = (1 << 63) - 1

#: Provenance row names the server sends: every chunk has ``window`` and ``epoch``; a
#: mixture's chunks also ``source`` (the row's index into the hello's ``sources``).
ROW_WINDOW = "window"
ROW_EPOCH = "epoch"
ROW_SOURCE = "source"

#: The orders ``hello.shuffle`` may name (see "Shuffle" above).
SHUFFLES = ("global", "block")

# A dataset name as the store accepts it (tokenfeed_server.store.reader's rule, checked
# against it by the tests): the wire refuses a bad source name before any look-up.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

#: The fixed list of error codes an ``err`` may carry (see :mod:`tokenfeed.errors`).
ERROR_CODES = frozenset(
    {
        "bad_request",  # malformed or over a limit: fix the request, do not retry
        "unknown_dataset",  # no such dataset in the store
        "unknown_job",  # the server does not know this job (it restarted): say hello again
        "dataset_changed",  # the dataset is another build than the one the job reads
        "auth_failed",
        "forbidden",
        "connection_limit",
        "overloaded",  # try again later
        "internal",  # a bug or an unreadable file on the server: see its log
        "storage_unavailable",  # object storage does not answer: the server retries
        "object_missing",  # an object of the dataset is gone from the bucket
        "object_damaged",  # an object fails its checksum after a refetch
    }
)


@dataclass(frozen=True)
class JobSpec:
    """What a training run registers; every rank and worker of the run sends the same.

    ``dataset`` is the dataset's *name* in the store, as everywhere on the wire; for a
    mixture it is ``""`` and ``sources``/``schedule`` name the mixture (as in
    :class:`Hello`). ``shuffle``, ``region_windows`` and ``block_regions`` are the order
    (the sizes the job uses, once the server derived any left at 0).
    """

    dataset: str
    seq_len: int
    batch_size: int
    seed: int
    world_size: int
    sources: tuple[str, ...] = ()
    schedule: tuple[tuple[int, ...], ...] = ()
    shuffle: str = "global"
    region_windows: int = 0
    block_regions: int = 0

    def __post_init__(self) -> None:
        # Callers pass lists; a spec is hashed and compared, so keep tuples.
        object.__setattr__(self, "sources", tuple(self.sources))
        object.__setattr__(self, "schedule", tuple(tuple(row) for row in self.schedule))

    @property
    def is_mixture(self) -> bool:
        """True for a mixture of ``sources`` (then ``dataset`` is ``""``)."""
        return bool(self.sources)


@dataclass(frozen=True)
class Message:
    """Base of all messages; ``TYPE`` is the ``t`` field on the wire."""

    TYPE: ClassVar[str] = ""

    def header(self) -> bytes:
        """Encode this message as its msgpack header frame (optional defaults left out)."""
        fields: dict[str, Any] = {"v": VERSION, "t": self.TYPE}
        for name in _FIELDS[type(self)]:
            value = getattr(self, name)
            default = _DEFAULTS[type(self)].get(name, _REQUIRED)
            if default is _REQUIRED or value != default:
                fields[name] = value
        packed: bytes = msgpack.packb(fields)
        return packed

    def check(self) -> None:
        """Raise ProtocolError if fields that depend on each other disagree (the decoder
        calls it on every message; field types and bounds are checked before)."""


@dataclass(frozen=True)
class Hello(Message):
    """Attach to a job. Ranks and workers of one training run send the same job inputs.

    ``fingerprint``, when not empty, is the dataset build the client expects (from a
    checkpoint or an earlier ``welcome``); the server refuses to serve another one.
    A mixture sets ``sources``, ``schedule`` and optionally ``fingerprints`` instead of
    ``dataset`` and ``fingerprint`` (see "Mixtures" in the module docstring); ``shuffle``
    and the block sizes choose the order (see "Shuffle").
    """

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
    fingerprint: str = ""
    sources: tuple[str, ...] = ()
    schedule: tuple[tuple[int, ...], ...] = ()
    fingerprints: tuple[str, ...] = ()
    shuffle: str = "global"
    region_windows: int = 0
    block_regions: int = 0

    def __post_init__(self) -> None:
        _tuples(self, "sources", "fingerprints")
        object.__setattr__(self, "schedule", tuple(tuple(row) for row in self.schedule))

    def check(self) -> None:
        """Mixture and shuffle fields agree with each other (see the module docstring)."""
        if self.shuffle not in SHUFFLES:
            raise ProtocolError(
                f"hello.shuffle must be one of {list(SHUFFLES)}, got {_brief(self.shuffle)!r}"
            )
        if self.region_windows < 0 or self.block_regions < 0:
            raise ProtocolError("hello.region_windows and hello.block_regions must be >= 0")
        if self.shuffle == "global" and (self.region_windows or self.block_regions):
            raise ProtocolError(
                'hello.region_windows and hello.block_regions apply to shuffle="block" only; '
                'send 0 with shuffle="global"'
            )
        if not self.sources:
            if self.schedule or self.fingerprints:
                raise ProtocolError("hello.schedule and hello.fingerprints need hello.sources")
            return
        if self.dataset:
            raise ProtocolError(
                "a mixture's hello names its datasets in sources; dataset must be empty"
            )
        for name in self.sources:
            if not _NAME_RE.fullmatch(name) or ".." in name:
                raise ProtocolError(
                    f"hello.sources: invalid dataset name {_brief(name)!r}: use 1-128 characters "
                    "of letters, digits, '.', '_' or '-', starting with a letter or digit, "
                    "and no '..'"
                )
        if len(set(self.sources)) != len(self.sources):
            twice = sorted({n for n in self.sources if self.sources.count(n) > 1})
            raise ProtocolError(f"hello.sources names {twice} more than once")
        if not self.schedule:
            raise ProtocolError("a mixture's hello needs a schedule (Mixture.to_wire())")
        width = len(self.sources) + 1
        for i, row in enumerate(self.schedule):
            if len(row) != width or min(row) < 0:
                raise ProtocolError(
                    f"hello.schedule[{i}] must be [start, one weight per source]: "
                    f"{width} non-negative integers, got {_brief(list(row))}"
                )
        if self.fingerprints and len(self.fingerprints) != len(self.sources):
            raise ProtocolError(
                f"hello.fingerprints has {len(self.fingerprints)} entries for "
                f"{len(self.sources)} sources; send one per source ('' for none) or none"
            )


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
    region_windows: int = 0
    block_regions: int = 0
    source_fingerprints: tuple[str, ...] = ()
    source_tokens: tuple[int, ...] = ()
    source_windows: tuple[int, ...] = ()
    source_region_windows: tuple[int, ...] = ()
    source_block_regions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _tuples(self, *_SOURCE_FIELDS)

    def check(self) -> None:
        """The per-source lists are all empty (one dataset) or all of one length."""
        sizes = {len(getattr(self, name)) for name in _SOURCE_FIELDS}
        if len(sizes) != 1:
            raise ProtocolError(
                "welcome: the source_* lists must have one entry per source each, got "
                + ", ".join(f"{name}={len(getattr(self, name))}" for name in _SOURCE_FIELDS)
            )


@dataclass(frozen=True)
class Get(Message):
    """Ask for rank ``rank``'s rows of ``count`` global batches (see module docstring).

    ``consumed``: the position the rank's training loop has consumed (-1: not known).
    """

    TYPE: ClassVar[str] = "get"
    req: int
    job: str
    rank: int
    pos: int
    count: int
    stride: int
    consumed: int = -1


@dataclass(frozen=True)
class Chunk(Message):
    """Header of a data message; the token frame and the provenance frame follow it."""

    TYPE: ClassVar[str] = "chunk"
    req: int
    rows: int
    cols: int
    dtype: str
    provenance: tuple[str, ...]


@dataclass(frozen=True)
class Err(Message):
    """A refusal. ``req`` is the request it answers, or -1 for none."""

    TYPE: ClassVar[str] = "err"
    code: str
    message: str
    retry: bool
    req: int

    def __post_init__(self) -> None:
        # Messages quote client input (names, values): cut one that would not fit, so that
        # every err an end sends is one the other end can decode.
        raw = self.message.encode()
        if len(raw) > MAX_STR:
            cut = raw[: MAX_STR - 3].decode(errors="ignore") + "..."
            object.__setattr__(self, "message", cut)


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
    """The client is closing this connection; no answer. ``consumed`` as in :class:`Get`."""

    TYPE: ClassVar[str] = "bye"
    consumed: int = -1


_SOURCE_FIELDS = (
    "source_fingerprints",
    "source_tokens",
    "source_windows",
    "source_region_windows",
    "source_block_regions",
)


def mixture_fingerprint(fingerprints: Sequence[str]) -> str:
    """A mixture's ``welcome.fingerprint``: blake2b-128 hex of its sources' fingerprints
    (in ``sources`` order) joined by newlines."""
    joined = "\n".join(fingerprints).encode()
    return hashlib.blake2b(joined, digest_size=16).hexdigest()


def _tuples(msg: Message, *names: str) -> None:
    """Store list fields as tuples: messages compare equal to what the decoder makes."""
    for name in names:
        object.__setattr__(msg, name, tuple(getattr(msg, name)))


_REQUIRED = object()
_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls for cls in (Hello, Welcome, Get, Chunk, Err, Ping, Pong, Bye)
}
_FIELDS: dict[type[Message], tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _TYPES.values()
}
_DEFAULTS: dict[type[Message], dict[str, Any]] = {
    cls: {
        f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
    }
    for cls in _TYPES.values()
}
_HINTS: dict[type[Message], dict[str, Any]] = {
    cls: {name: typing.get_type_hints(cls)[name] for name in _FIELDS[cls]}
    for cls in _TYPES.values()
}


def _depth(hint: object) -> int:
    """How deeply a field type nests (a scalar is 0); refuses types with no wire check."""
    if hint in (int, str, bool):
        return 0
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return 1 + _depth(args[0])
    if origin is dict and len(args) == 2 and args[0] is str:
        return 1 + _depth(args[1])
    raise TypeError(f"no wire encoding for field type {hint!r}")


for _cls, _hints in _HINTS.items():  # a message type the decoder cannot bound is a bug
    for _name, _hint in _hints.items():
        if _depth(_hint) > MAX_DEPTH:
            raise TypeError(f"{_cls.TYPE}.{_name} nests deeper than MAX_DEPTH={MAX_DEPTH}")


def decode_header(frame: bytes | memoryview) -> Message:
    """Decode and validate one header frame; raise ProtocolError saying what is wrong."""
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        obj = msgpack.unpackb(
            frame,
            raw=False,
            use_list=False,
            strict_map_key=True,
            max_str_len=MAX_STR,
            max_bin_len=0,
            max_ext_len=0,
            max_array_len=MAX_ITEMS,
            max_map_len=MAX_ITEMS,
        )
    except Exception as exc:  # msgpack raises several unrelated types; map them here
        reason = f"{type(exc).__name__}: {exc}"
        raise ProtocolError(f"header frame is not valid msgpack ({_brief(reason)})") from None
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
    hints, defaults = _HINTS[cls], _DEFAULTS[cls]
    extra = sorted(_brief(k, 40) for k in obj.keys() - hints.keys())
    if extra:
        raise ProtocolError(
            f"{cls.TYPE}: unexpected fields {extra}; the peer speaks a newer protocol "
            "than this end: install matching versions of tokenfeed and tokenfeed-server"
        )
    missing = sorted(hints.keys() - obj.keys() - defaults.keys())
    if missing:
        raise ProtocolError(f"{cls.TYPE}: missing fields {missing}")
    for name, hint in hints.items():
        if name in obj:
            obj[name] = _check(f"{cls.TYPE}.{name}", obj[name], hint)
    msg = cls(**obj)
    msg.check()
    return msg


def _brief(value: object, limit: int = 80) -> str:
    """``value`` for an error message, cut to ``limit`` characters (it may be hostile)."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check(where: str, value: object, hint: object) -> Any:
    """``value`` if it has type ``hint`` within the bounds, else ProtocolError."""
    if hint is int:
        # bool is an int subclass; a JSON-ish client sending true for a count is a bug
        if type(value) is not int or not (-1 <= value <= _MAX_INT):
            raise ProtocolError(f"{where} must be an integer in [-1, 2**63), got {_brief(value)}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{where} must be a string, got {type(value).__name__}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{where} must be a boolean, got {type(value).__name__}")
        return value
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, tuple):
            raise ProtocolError(f"{where} must be a list, got {type(value).__name__}")
        return tuple(_check(f"{where}[{i}]", item, args[0]) for i, item in enumerate(value))
    if not isinstance(value, dict):  # _depth() admits only tuple and dict containers
        raise ProtocolError(f"{where} must be a map, got {type(value).__name__}")
    return {k: _check(f"{where}[{k!r}]", v, args[1]) for k, v in value.items()}


def chunk_frames(req: int, tokens: np.ndarray, provenance: Mapping[str, np.ndarray]) -> list[Any]:
    """The frames of a ``chunk``: header, tokens, provenance rows; sent zero-copy.

    ``provenance`` maps row names (:data:`ROW_WINDOW`, :data:`ROW_EPOCH`, ...) to one
    integer per token row.
    """
    names = tuple(provenance)
    header = Chunk(
        req=req,
        rows=tokens.shape[0],
        cols=tokens.shape[1],
        dtype=_wire_dtype_name(tokens.dtype),
        provenance=names,
    ).header()
    # One preallocated frame filled row by row: np.stack + astype cost twice as much on
    # the server's per-chunk path (benchmarks/bench_loaders.py).
    rows = np.empty((len(names), tokens.shape[0]), dtype="<i8")
    for i, name in enumerate(names):
        rows[i] = provenance[name]
    return [header, np.ascontiguousarray(tokens), rows]


@functools.lru_cache(maxsize=8)
def _wire_dtype_name(dtype: np.dtype[Any]) -> str:
    # newbyteorder() runs slow Python code; a store has one dtype, so look it up once.
    name: str = dtype.newbyteorder("<").name
    return name


def decode_chunk(header: Chunk, frames: Sequence[Any]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Wrap a chunk's payload frames (zero-copy) as ``(tokens, {row name: int64 array})``.

    Callers take the rows they know (:data:`ROW_WINDOW`, :data:`ROW_EPOCH`) and ignore
    the others; :func:`require_rows` names the ones that must be there.
    """
    if len(frames) != 2:
        raise ProtocolError(f"chunk must carry 2 payload frames, got {len(frames)}")
    dtype = DTYPES.get(header.dtype)
    if dtype is None:
        raise ProtocolError(f"chunk dtype {header.dtype!r} is not one of {sorted(DTYPES)}")
    names = header.provenance
    if len(names) > MAX_PROVENANCE_ROWS or len(set(names)) != len(names):
        raise ProtocolError(
            f"chunk provenance names must be distinct and at most {MAX_PROVENANCE_ROWS}, "
            f"got {list(names)}"
        )
    tokens_buf, meta_buf = (memoryview(f) for f in frames)
    if tokens_buf.nbytes != header.rows * header.cols * dtype.itemsize:
        raise ProtocolError(
            f"chunk token frame has {tokens_buf.nbytes} bytes, header says "
            f"{header.rows}x{header.cols} {header.dtype}"
        )
    if meta_buf.nbytes != len(names) * header.rows * 8:
        raise ProtocolError(
            f"chunk provenance frame has {meta_buf.nbytes} bytes, expected "
            f"{len(names) * header.rows * 8} ({len(names)} rows of {header.rows} int64)"
        )
    tokens = np.frombuffer(tokens_buf, dtype=dtype).reshape(header.rows, header.cols)
    meta = np.frombuffer(meta_buf, dtype="<i8").reshape(len(names), header.rows)
    return tokens, dict(zip(names, meta, strict=True))


def require_rows(rows: Mapping[str, np.ndarray], *names: str) -> list[np.ndarray]:
    """The provenance rows ``names`` in that order; ProtocolError naming any missing."""
    missing = [n for n in names if n not in rows]
    if missing:
        raise ProtocolError(
            f"chunk lacks provenance rows {missing} (has {sorted(rows)}); "
            "install matching versions of tokenfeed and tokenfeed-server"
        )
    return [rows[n] for n in names]
