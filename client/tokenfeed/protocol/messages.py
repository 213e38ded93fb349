"""The message types of the wire and the encoding of their header frames.

Each type is a frozen dataclass whose fields are the msgpack map of its header frame
(see "Messages" and "Fields" in :mod:`tokenfeed.protocol`); :meth:`Message.header`
encodes one, :func:`tokenfeed.protocol.codec.decode_header` decodes and checks one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from tokenfeed.errors import ProtocolError
from tokenfeed.protocol.bounds import MAX_DEPTH, MAX_STR, brief, depth
from tokenfeed.protocol.constants import DATASET_NAME, RUN_ID, SHUFFLES, VERSION


@dataclass(frozen=True)
class JobSpec:
    """What a training run registers; every rank and worker of the run sends the same.

    ``dataset`` is the dataset's *name* in the store, as everywhere on the wire; for a
    mixture it is ``""`` and ``sources``/``schedule`` name the mixture (as in
    :class:`Hello`). ``shuffle``, ``region_windows`` and ``block_regions`` are the order
    (the sizes the job uses, once the server derived any left at 0). ``run`` is the
    launch's run id (``""``: none, the job is named by the other fields alone, as before
    run ids existed; see "Runs" in :mod:`tokenfeed.protocol`).
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
    # Out of the repr: job ids of specs without a run hash the repr of the fields before it
    # (tokenfeed_server.dataplane.jobs.job_id), and those ids must not change.
    run: str = field(default="", repr=False)

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
        for name in FIELDS[type(self)]:
            value = getattr(self, name)
            default = DEFAULTS[type(self)].get(name, REQUIRED)
            if default is REQUIRED or value != default:
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
    and the block sizes choose the order (see "Shuffle"). ``run``, when not empty, is
    the launch's run id: it names the job together with the other fields (see "Runs").
    ``skipped``, when not empty, is the stream ranges the run skipped on purpose at a
    resume (``[(position, samples), ...]``, from its state): shown on the job's page,
    never part of the job's key or what is served. ``allow_read_amplification``: serve
    a global shuffle of a remote dataset through a cache smaller than it (refused
    without it: see "Read amplification"); it changes no token.
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
    run: str = ""
    skipped: tuple[tuple[int, ...], ...] = ()
    allow_read_amplification: bool = False
    #: ask for a shared-memory ring (the client runs on the server's host; see "Rings")
    ring: bool = False

    def __post_init__(self) -> None:
        _tuples(self, "sources", "fingerprints")
        object.__setattr__(self, "schedule", tuple(tuple(row) for row in self.schedule))
        object.__setattr__(self, "skipped", tuple(tuple(row) for row in self.skipped))

    def check(self) -> None:
        """Mixture and shuffle fields agree with each other (see the module docstring)."""
        if self.run and not RUN_ID.fullmatch(self.run):
            raise ProtocolError(
                f"hello.run: invalid run id {brief(self.run)!r}: use 1-128 characters of "
                "letters, digits, '.', '_', ':' or '-', starting with a letter or digit"
            )
        if any(len(r) != 2 or min(r) < 0 for r in self.skipped):
            raise ProtocolError(
                "hello.skipped must be [position, samples] pairs of non-negative integers, "
                f"got {brief([list(r) for r in self.skipped])}"
            )
        if self.shuffle not in SHUFFLES:
            raise ProtocolError(
                f"hello.shuffle must be one of {list(SHUFFLES)}, got {brief(self.shuffle)!r}"
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
            if not DATASET_NAME.fullmatch(name) or ".." in name:
                raise ProtocolError(
                    f"hello.sources: invalid dataset name {brief(name)!r}: use 1-128 characters "
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
                    f"{width} non-negative integers, got {brief(list(row))}"
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
    #: where and how to fetch this connection's ring (only when the hello asked for one
    #: and the server offers rings): the ring door's Unix socket path, and 64 hex digits:
    #: the nonce the client sends (first half), the proof the door answers (second half)
    ring_door: str = ""
    ring_key: str = ""

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
    #: tokens in the connection's ring instead of a frame: their byte offset in the ring,
    #: and the count the client writes as released once it copied them out (0: no ring)
    ring_offset: int = 0
    ring_end: int = 0


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


# The tables both directions work from, made once from the dataclasses above.
#: marks a field without a default in :data:`DEFAULTS`
REQUIRED = object()
#: ``t`` on the wire -> message class
MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls for cls in (Hello, Welcome, Get, Chunk, Err, Ping, Pong, Bye)
}
#: the fields of each type, in declaration order
FIELDS: dict[type[Message], tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in MESSAGE_TYPES.values()
}
#: the default of each optional field (a missing one is filled in; one at its default is
#: left out)
DEFAULTS: dict[type[Message], dict[str, Any]] = {
    cls: {
        f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
    }
    for cls in MESSAGE_TYPES.values()
}
#: the declared type of each field, which the decoder checks values against
HINTS: dict[type[Message], dict[str, Any]] = {
    cls: {name: typing.get_type_hints(cls)[name] for name in FIELDS[cls]}
    for cls in MESSAGE_TYPES.values()
}


for _cls, _hints in HINTS.items():  # a message type the decoder cannot bound is a bug
    for _name, _hint in _hints.items():
        if depth(_hint) > MAX_DEPTH:
            raise TypeError(f"{_cls.TYPE}.{_name} nests deeper than MAX_DEPTH={MAX_DEPTH}")
