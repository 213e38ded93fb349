"""Mixtures: which dataset every row of the stream comes from, as a pure function.

A mixture blends several datasets (its *sources*) by weight, and a *schedule* may change
the weights at given stream positions (an anneal on the best data late in a run). Like
the plan (:mod:`tokenfeed.plan`), the order is computed, never stored: a row's source and
its position in that source's own stream are a pure function of the schedule and the
row's global stream position, in time and memory that do not grow with the run.

How
    A schedule is validated and its weights reduced to exact integers per segment
    (:mod:`tokenfeed.order.schedule`: every period of a segment holds each source exactly
    its reduced weight times); one period's order is the smooth weighted round robin of
    the weights (:mod:`tokenfeed.order.swrr`); a stream position maps to its source and
    its position in that source's own stream through per-segment tables
    (:mod:`tokenfeed.order.locate`), in time and memory that do not depend on the
    position. Each source then walks its own :class:`~tokenfeed.plan.Plan`, seeded by
    :func:`source_seed`.

Ranks, workers, resume, schedule changes
    The mixture only maps global stream positions, so ranks, DataLoader workers and
    batch sizes slice the same global stream exactly as for one dataset, and resuming at
    position ``P`` with another world size continues the identical stream. A run may
    decide its anneal later: :meth:`Mixture.check_continuation` accepts a new schedule
    that maps every position ``< P`` exactly as the saved one (the segments starting
    before ``P`` identical, none added before ``P``) and refuses one that rewrites the
    past.
"""

from __future__ import annotations

import bisect
import hashlib
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenfeed.errors import ConfigError, PlanError
from tokenfeed.order.ints import INT64_MAX, UINT64_MAX, IntArray
from tokenfeed.order.locate import SegmentTables
from tokenfeed.order.schedule import (
    MAX_PERIOD,
    WEIGHT_DECIMALS,
    Schedule,
    check_name,
    is_list,
    parse_schedule,
)
from tokenfeed.order.splitmix import splitmix64

__all__ = ["MAX_PERIOD", "WEIGHT_DECIMALS", "Mixture", "Schedule", "source_seed"]


def source_seed(seed: int, name: str) -> int:
    """The seed of source ``name``'s own :class:`~tokenfeed.plan.Plan` in a job of ``seed``.

    ``splitmix64(splitmix64(seed) xor h)`` with ``h`` the 64-bit blake2b digest of the
    name's UTF-8 bytes (little-endian), so a source's order depends on its name and the
    job's seed, not on its index in the mixture, and two sources never share an order by
    accident. A uint64, like every plan seed.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    seed = operator.index(seed)
    if not 0 <= seed <= UINT64_MAX:
        raise ConfigError(f"seed must lie in [0, 2**64 - 1], got {seed}")
    check_name(name)
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return splitmix64(splitmix64(seed) ^ h)


def _restore(names: tuple[str, ...], segments: tuple[tuple[int, tuple[int, ...]], ...]) -> Mixture:
    return Mixture._from_parts(names, segments)


class Mixture:
    """A blend of datasets by weight, possibly changing at given stream positions.

    ``Mixture({"web": 7, "code": 2, "math": 1})`` or
    ``Mixture([(0, {"web": 1, "code": 1}), (2_000_000, {"web": 1, "code": 3})])``; see the
    module docstring for the order it defines. Immutable, hashable, picklable; equal when
    names and reduced segments are equal.
    """

    __slots__ = ("_names", "_segments", "_tables")

    _names: tuple[str, ...]
    _segments: tuple[tuple[int, tuple[int, ...]], ...]
    _tables: SegmentTables | None

    def __init__(self, schedule: Schedule) -> None:
        parsed = parse_schedule(schedule)
        names: dict[str, None] = {}
        for _, weights in parsed:
            names.update(dict.fromkeys(weights))
        order = tuple(names)
        segments = tuple((start, tuple(w.get(n, 0) for n in order)) for start, w in parsed)
        self._init(order, segments)

    def _init(
        self, names: tuple[str, ...], segments: tuple[tuple[int, tuple[int, ...]], ...]
    ) -> None:
        object.__setattr__(self, "_names", names)
        object.__setattr__(self, "_segments", segments)
        object.__setattr__(self, "_tables", None)

    @classmethod
    def _from_parts(
        cls, names: tuple[str, ...], segments: tuple[tuple[int, tuple[int, ...]], ...]
    ) -> Mixture:
        """A mixture from already validated parts (no checks)."""
        mix = cls.__new__(cls)
        mix._init(names, segments)
        return mix

    @classmethod
    def of(cls, x: Mixture | Schedule) -> Mixture:
        """``x`` itself if it is a Mixture, else ``Mixture(x)``."""
        return x if isinstance(x, Mixture) else cls(x)

    # ---------------------------------------------------------------- structure

    @property
    def names(self) -> tuple[str, ...]:
        """The sources' dataset names, in order of first appearance across the schedule;
        a row's ``source`` is an index into this tuple."""
        return self._names

    @property
    def segments(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """``(start, reduced weight per source index)`` per segment, 0 where absent."""
        return self._segments

    @property
    def schedule(self) -> list[tuple[int, dict[str, int]]]:
        """The reduced schedule: ``(start, {name: weight})`` per segment, absent names
        left out."""
        return [
            (start, {n: w for n, w in zip(self._names, ws, strict=True) if w})
            for start, ws in self._segments
        ]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mixture):
            return NotImplemented
        return self._names == other._names and self._segments == other._segments

    def __hash__(self) -> int:
        return hash((self._names, self._segments))

    def __repr__(self) -> str:
        sched = self.schedule
        if len(sched) == 1:
            return f"Mixture({sched[0][1]!r})"
        return f"Mixture({sched!r})"

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Mixture is immutable; build a new one")

    def __reduce__(self) -> tuple[Any, ...]:
        # Tables are rebuilt on first use in the receiving process (DataLoader workers).
        return (_restore, (self._names, self._segments))

    # ---------------------------------------------------------------- order

    def _built(self) -> SegmentTables:
        tables = self._tables
        if tables is None:
            # Racing threads may both build; either result is identical.
            tables = SegmentTables(self._names, self._segments)
            object.__setattr__(self, "_tables", tables)
        return tables

    @property
    def tables_built(self) -> bool:
        """True once the locate tables exist (built by :meth:`build_tables` or on first
        use by :meth:`locate` and :meth:`counts`)."""
        return self._tables is not None

    def build_tables(self) -> None:
        """Build the locate tables now, on the calling thread (a server builds them off
        its serving thread: a large schedule's take up to seconds); no-op once built."""
        self._built()

    def locate(self, positions: npt.ArrayLike) -> tuple[IntArray, IntArray]:
        """Stream positions to ``(source, source_position)``, int64 of ``positions``' shape.

        ``source`` indexes :attr:`names`; ``source_position`` is how many earlier stream
        positions went to that source, i.e. the row's position in the source's own
        stream (feed it to the source's :meth:`Plan.windows <tokenfeed.plan.Plan.windows>`).
        """
        arr = np.asarray(positions)
        if arr.dtype.kind not in "iu":
            raise PlanError(f"positions must be an integer array, got dtype {arr.dtype}")
        shape = arr.shape
        if arr.size == 0:
            empty = np.zeros(shape, dtype=np.int64)
            return empty, empty.copy()
        if int(arr.min()) < 0 or int(arr.max()) > INT64_MAX:
            raise PlanError("stream positions must lie in [0, 2**63 - 1]")
        p = arr.astype(np.int64, copy=False).reshape(-1)
        src, pos = self._built().locate(p)
        return src.reshape(shape), pos.reshape(shape)

    def counts(self, position: int) -> list[int]:
        """Rows each source received in stream positions ``[0, position)`` (exact)."""
        position = _check_position(position)
        return self._built().counts(position)

    def segment_at(self, position: int) -> int:
        """Index of the segment that holds stream ``position``."""
        position = _check_position(position)
        return bisect.bisect_right([s for s, _ in self._segments], position) - 1

    # ---------------------------------------------------------------- wire and state

    def to_wire(self) -> list[list[int]]:
        """Rows ``[start, w_0, ..., w_{n-1}]`` (reduced weights in :attr:`names` order)."""
        return [[start, *ws] for start, ws in self._segments]

    @classmethod
    def from_wire(cls, names: Sequence[str], rows: Sequence[Sequence[int]]) -> Mixture:
        """The mixture of :meth:`to_wire`'s rows over ``names``; validates everything
        (ConfigError naming the problem), including that ``names`` is in order of first
        appearance and every name has rows somewhere."""
        if not is_list(names):
            raise ConfigError(f"mixture names must be a list of strings, got {names!r}")
        order = tuple(check_name(n) for n in names)
        if len(set(order)) != len(order):
            dup = sorted({n for n in order if order.count(n) > 1})
            raise ConfigError(f"mixture names repeat: {dup}; list every source once")
        if not is_list(rows):
            raise ConfigError(f"a mixture schedule must be a list of rows, got {rows!r}")
        schedule: list[tuple[int, dict[str, int]]] = []
        for k, row in enumerate(rows):
            if not is_list(row):
                raise ConfigError(f"schedule row {k} must be a list of integers, got {row!r}")
            if len(row) != len(order) + 1:
                raise ConfigError(
                    f"schedule row {k} has {len(row)} values; expected {len(order) + 1} "
                    f"(start, then one weight per source of {list(order)})"
                )
            for v in row:
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise ConfigError(f"schedule row {k} holds {v!r}; only integers are allowed")
            if any(operator.index(v) < 0 for v in row[1:]):
                raise ConfigError(f"schedule row {k} has a negative weight: {list(row)}")
            weights = {n: operator.index(v) for n, v in zip(order, row[1:], strict=True) if v}
            if not weights:
                raise ConfigError(f"schedule row {k} gives every source weight 0")
            schedule.append((row[0], weights))
        mix = cls(schedule)
        if mix.names != order:
            unused = [n for n in order if n not in mix.names]
            if unused:
                raise ConfigError(
                    f"mixture sources {unused} have weight 0 in every segment; drop them"
                )
            raise ConfigError(
                f"mixture names {list(order)} are not in order of first appearance in the "
                f"schedule (expected {list(mix.names)}); send Mixture.names with to_wire()"
            )
        return mix

    def to_state(self) -> list[list[Any]]:
        """JSON-friendly ``[[start, {name: weight}], ...]`` with the reduced weights (keep
        the mappings' key order: it is the sources' order)."""
        return [[start, weights] for start, weights in self.schedule]

    @classmethod
    def from_state(cls, obj: object) -> Mixture:
        """The mixture of :meth:`to_state`'s value (e.g. after a JSON round trip)."""
        if not is_list(obj):
            raise ConfigError(
                f"a saved mixture is a list of [start, {{name: weight}}], got {obj!r}"
            )
        return cls(obj)

    # ---------------------------------------------------------------- resume

    def check_continuation(self, new: Mixture, position: int) -> None:
        """Raise ConfigError unless ``new`` maps every stream position ``< position``
        exactly as this mixture does: the segments starting before ``position`` are
        identical (same starts, same reduced weights per name) and ``new`` adds none
        before it. Segments starting at or after ``position`` may differ freely."""
        if not isinstance(new, Mixture):
            raise ConfigError(f"expected a Mixture, got {type(new).__name__}")
        position = _check_position(position)
        # Items in names order: the order decides ties inside a period, so it is part of
        # what the past segments must keep.
        old_past = [(s, list(w.items())) for s, w in self.schedule if s < position]
        new_past = [(s, list(w.items())) for s, w in new.schedule if s < position]
        if old_past == new_past:
            return
        for k in range(max(len(old_past), len(new_past))):
            was = old_past[k] if k < len(old_past) else None
            now = new_past[k] if k < len(new_past) else None
            if was != now:
                break
        raise ConfigError(
            f"the new mixture schedule rewrites the stream before position {position}, "
            f"which was already consumed: segment {k} was {_fmt(was)}, now {_fmt(now)}. "
            f"Keep the saved segments that start before {position} as they are and put "
            f"changes in segments starting at {position} or later"
        )


def _fmt(seg: tuple[int, list[tuple[str, int]]] | None) -> str:
    if seg is None:
        return "absent"
    return f"(start {seg[0]}, {dict(seg[1])})"


def _check_position(position: object) -> int:
    if isinstance(position, bool) or not isinstance(position, (int, np.integer)):
        raise PlanError(f"position must be an integer, got {position!r}")
    p = operator.index(position)
    if not 0 <= p <= INT64_MAX:
        raise PlanError(f"position must lie in [0, 2**63 - 1], got {p}")
    return p
