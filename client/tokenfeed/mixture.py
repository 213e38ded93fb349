"""Mixtures: which dataset every row of the stream comes from, as a pure function.

A mixture blends several datasets (its *sources*) by weight, and a *schedule* may change
the weights at given stream positions (an anneal on the best data late in a run). Like
the plan (:mod:`tokenfeed.plan`), the order is computed, never stored: a row's source and
its position in that source's own stream are a pure function of the schedule and the
row's global stream position, in time and memory that do not grow with the run.

Schedule and segments
    A schedule is a list of ``(start, {name: weight})`` with the first ``start`` 0 and
    the starts strictly increasing, in global stream positions (the unit of
    ``state_dict()["position"]``); a plain mapping is the one-segment schedule
    ``[(0, mapping)]``. Segment ``k`` covers positions ``[start_k, start_{k+1})``. The
    sources are numbered in order of first appearance across the schedule
    (:attr:`Mixture.names`); a source absent from a segment has weight 0 there.

Exact proportions
    A segment's weights are made integers and reduced: when any weight is a float, every
    weight is taken to 4 decimals (``0.7 -> 7000``, rounding half to even on the decimal
    the float prints as), then all are divided by their gcd (``0.7/0.2/0.1 -> 7/2/1``).
    The reduced sum ``W`` is the segment's *period* and is at most :data:`MAX_PERIOD`.
    Every period, aligned to its segment's start (positions ``start + q*W`` to
    ``start + (q+1)*W - 1``), holds each source exactly its reduced weight times; no
    sampling, so proportions never drift.

The order inside a period: smooth weighted round robin
    One period is the sequence nginx's smooth weighted round robin (SWRR) produces from
    all-zero state: at each step every source adds its weight to its *current*, the
    source with the largest current wins (ties: the lowest source index) and ``W`` is
    subtracted from the winner's current. After ``k`` steps source ``s`` has
    ``current_s = k*w_s - W*n_s(k)`` where ``n_s(k)`` counts its wins, and the currents
    sum to 0. Every step's winner had the largest of values summing to ``W``, hence
    ``> 0``, so every current stays ``> -W``. Two consequences, both tested:

    - *Exact counts*: after ``W`` steps ``n_s < w_s + 1`` for every ``s`` and
      ``sum(n_s) = W = sum(w_s)``, so ``n_s = w_s`` exactly and every current is 0
      again: the sequence is periodic with period ``W``.
    - *Smoothness*: in every prefix of ``k`` rows of a period a source is never ahead of
      its share by a whole row, ``n_s(k) <= ceil(k*w_s/W)``, and never behind by as much
      as the number of other sources, ``n_s(k) > k*w_s/W - (m - 1)`` (the currents sum
      to 0 and each is ``> -W``). With two sources that makes ``|n_s(k) - k*w_s/W| < 1``.
      With more sources a source can lag a little over one row (1:1:1:1:7:7 puts a
      weight-7 source 1.06 rows behind; at most about 1.2 rows in random trials with up
      to 12 sources). Weights 5:1:1 give ``a a b a c a a``, never ``a a a a a b c``.

    The period's table (source per offset, and the offset's rank among its source's
    occurrences in the period) is computed once per distinct weight vector and shared.

Locating a row
    For a stream position ``p`` in segment ``k`` (the last with ``start_k <= p``):
    ``off = p - start_k``, ``full, j = divmod(off, W_k)``, ``source = table_k[j]``, and the
    row's position in that source's own stream is
    ``base[k, source] + full*w[k, source] + rank_k[j]``, where ``base[k, s]`` is the rows
    source ``s`` received before ``start_k`` (computed once per segment from the previous
    one). So source positions of every source run ``0, 1, 2, ...`` over the whole stream,
    across segment boundaries, with nothing repeated or skipped: each source then walks
    its own :class:`~tokenfeed.plan.Plan` (seeded by :func:`source_seed`), which gives
    every window exactly once per *source* epoch; a small source with a large weight runs
    more epochs. :meth:`Mixture.locate` is vectorized numpy; memory is the tables (one
    period per distinct weight vector) and ``O(segments * sources)``, never the run's
    length. A source position never exceeds the stream position, so any position up to
    ``2**63 - 1`` is computed without overflow.

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
import functools
import hashlib
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from decimal import ROUND_HALF_EVEN, Decimal, localcontext
from typing import Any, TypeAlias, TypeGuard

import numpy as np
import numpy.typing as npt

from tokenfeed.errors import ConfigError, PlanError
from tokenfeed.plan import INT64_MAX, UINT64_MAX, splitmix64

__all__ = ["MAX_PERIOD", "WEIGHT_DECIMALS", "Mixture", "Schedule", "source_seed"]

#: Largest reduced weight sum (period) of one segment: bounds a period's table (16 bytes a
#: row, 1 MiB at the limit) and the time to build it.
MAX_PERIOD = 65536
#: Float weights are taken to this many decimals before being reduced to integers.
WEIGHT_DECIMALS = 4

IntArray: TypeAlias = npt.NDArray[np.int64]
Weight: TypeAlias = "int | float"
Schedule: TypeAlias = "Mapping[str, Weight] | Sequence[tuple[int, Mapping[str, Weight]]]"
#: Above this many sources in one segment, one SWRR step is done with numpy rather than
#: Python lists (a step costs O(sources) either way; numpy wins past a few dozen).
_NUMPY_SOURCES = 48
_QUANTUM = Decimal(1).scaleb(-WEIGHT_DECIMALS)
_SCALE = 10**WEIGHT_DECIMALS
#: A sorted block spanning at most this many segment boundaries is cut into pieces, one
#: per segment; beyond, every row searches its segment.
_SPLIT_SEGMENTS = 8


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
    _check_name(name)
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return splitmix64(splitmix64(seed) ^ h)


# --------------------------------------------------------------------------- validation


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise ConfigError(f"a mixture's source names must be strings, got {name!r}")
    if not name or name.strip() != name or not name.isprintable():
        raise ConfigError(
            f"invalid source name {name!r}: use the dataset's name as the server lists it "
            "(non-empty, printable, no leading or trailing spaces)"
        )
    return name


def _check_start(start: object, k: int) -> int:
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)):
        raise ConfigError(f"segment {k}'s start must be an integer stream position, got {start!r}")
    s = operator.index(start)
    if not 0 <= s <= INT64_MAX:
        raise ConfigError(f"segment {k}'s start must lie in [0, 2**63 - 1], got {s}")
    return s


def _weight_units(name: str, weight: object, scaled: bool, where: str) -> int:
    """``weight`` as an integer: itself, or in units of 10**-4 when ``scaled``."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float, np.integer, np.floating)):
        raise ConfigError(
            f"weight of {name!r} {where} must be a positive int or float, got {weight!r}"
        )
    if isinstance(weight, (int, np.integer)):
        w = operator.index(weight)
        if w <= 0:
            raise ConfigError(
                f"weight of {name!r} {where} must be positive, got {w}; leave a source out "
                "of a segment to give it no rows there"
            )
        return w * _SCALE if scaled else w
    x = float(weight)
    if not math.isfinite(x) or x <= 0:
        raise ConfigError(
            f"weight of {name!r} {where} must be a positive finite number, got {x!r}; leave "
            "a source out of a segment to give it no rows there"
        )
    # repr() is the shortest decimal that round-trips, so 0.7 is taken as 0.7000, not as
    # the binary float 0.69999999999999995559...
    with localcontext() as ctx:
        ctx.prec = 400  # exact for any finite float (at most 309 integer digits)
        units = int(Decimal(repr(x)).quantize(_QUANTUM, rounding=ROUND_HALF_EVEN).scaleb(4))
    if units == 0:
        raise ConfigError(
            f"weight {x!r} of {name!r} {where} is 0 at {WEIGHT_DECIMALS} decimals; weights "
            f"are taken to {WEIGHT_DECIMALS} decimals, so scale all weights of the segment up"
        )
    return units


def _reduce(mapping: object, where: str) -> dict[str, int]:
    """A segment's weights, validated, made integers and divided by their gcd."""
    if not isinstance(mapping, Mapping):
        raise ConfigError(
            f"the weights {where} must be a mapping of dataset name to weight, "
            f"got {type(mapping).__name__}"
        )
    if not mapping:
        raise ConfigError(f"the weights {where} are empty; give at least one source a weight")
    for name in mapping:
        _check_name(name)
    scaled = any(isinstance(w, (float, np.floating)) for w in mapping.values())
    units = {name: _weight_units(name, w, scaled, where) for name, w in mapping.items()}
    g = functools.reduce(math.gcd, units.values())
    reduced = {name: u // g for name, u in units.items()}
    total = sum(reduced.values())
    if total > MAX_PERIOD:
        given = ", ".join(f"{n!r}: {w!r}" for n, w in mapping.items())
        raise ConfigError(
            f"the weights {where} {{{given}}} reduce to integer weights summing to "
            f"{total}, more than {MAX_PERIOD} (one period of the mixture); use coarser "
            f"weights, e.g. fewer decimals or smaller ratios"
        )
    return reduced


def _where(k: int, start: int) -> str:
    return f"of segment {k} (start {start})"


def _parse_schedule(schedule: object) -> list[tuple[int, dict[str, int]]]:
    """Validate a schedule; returns ``(start, reduced weights)`` per segment."""
    if isinstance(schedule, Mapping):
        return [(0, _reduce(schedule, "of the mixture"))]
    if isinstance(schedule, (str, bytes)) or not isinstance(schedule, Iterable):
        raise ConfigError(
            "a mixture is a mapping of dataset name to weight, or a schedule: a list of "
            f"(start position, mapping); got {type(schedule).__name__}"
        )
    segments: list[tuple[int, dict[str, int]]] = []
    for k, item in enumerate(schedule):
        if not _is_list(item):
            raise ConfigError(
                f"schedule entry {k} must be a (start position, weights) pair, got {item!r}"
            )
        if len(item) != 2:
            raise ConfigError(
                f"schedule entry {k} must be a (start position, weights) pair, "
                f"got {len(item)} items"
            )
        start = _check_start(item[0], k)
        if k == 0 and start != 0:
            raise ConfigError(
                f"a schedule starts at stream position 0, its first segment starts at "
                f"{start}; add the blend used before it as a segment at 0"
            )
        if segments and start <= segments[-1][0]:
            raise ConfigError(
                f"schedule starts must be strictly increasing: segment {k} starts at "
                f"{start}, after segment {k - 1} at {segments[-1][0]}"
            )
        segments.append((start, _reduce(item[1], _where(k, start))))
    if not segments:
        raise ConfigError("the schedule is empty; give at least one segment starting at 0")
    return segments


# --------------------------------------------------------------------------- SWRR tables


@functools.lru_cache(maxsize=16)
def _period_table(weights: tuple[int, ...]) -> tuple[IntArray, IntArray]:
    """One SWRR period of positive ``weights``: (winner index per step, its rank).

    Shared between all mixtures with the same weight vector (read-only arrays).
    """
    m, total = len(weights), sum(weights)
    winners = np.empty(total, dtype=np.int64)
    ranks = np.empty(total, dtype=np.int64)
    seen = [0] * m
    if m == 1:
        winners[:] = 0
        ranks[:] = np.arange(total, dtype=np.int64)
    elif m <= _NUMPY_SOURCES:
        cur = [0] * m
        for step in range(total):
            cur = [c + w for c, w in zip(cur, weights, strict=True)]
            b = cur.index(max(cur))  # first maximum: ties go to the lowest index
            cur[b] -= total
            winners[step] = b
            ranks[step] = seen[b]
            seen[b] += 1
    else:
        w_arr = np.array(weights, dtype=np.int64)
        cur_arr = np.zeros(m, dtype=np.int64)
        for step in range(total):
            cur_arr += w_arr
            b = int(np.argmax(cur_arr))  # first maximum, as above
            cur_arr[b] -= total
            winners[step] = b
            ranks[step] = seen[b]
            seen[b] += 1
    winners.setflags(write=False)
    ranks.setflags(write=False)
    return winners, ranks


class _Tables:
    """What locate() needs, built on first use (a mixture that is only validated, compared
    or sent on the wire never builds a table)."""

    def __init__(self, names: tuple[str, ...], segments: tuple[tuple[int, tuple[int, ...]], ...]):
        n = len(names)
        self.start_list = [s for s, _ in segments]
        self.starts = np.array(self.start_list, dtype=np.int64)
        self.periods = np.array([sum(w) for _, w in segments], dtype=np.int64)
        self.weights = np.array([w for _, w in segments], dtype=np.int64).reshape(-1, n)
        # Per segment: source (global index) and rank per period offset, in one flat array
        # per kind so that rows of several segments gather in one call.
        offsets: list[int] = []
        sources: list[IntArray] = []
        ranks: list[IntArray] = []
        shared: dict[tuple[int, ...], int] = {}
        size = 0
        for _, w in segments:
            if w in shared:
                offsets.append(shared[w])
                continue
            active = [i for i, x in enumerate(w) if x]
            winners, rank = _period_table(tuple(w[i] for i in active))
            sources.append(np.array(active, dtype=np.int64)[winners])
            ranks.append(rank)
            shared[w] = size
            offsets.append(size)
            size += len(winners)
        self.table_offsets = np.array(offsets, dtype=np.int64)
        self.source = np.concatenate(sources)
        self.rank = np.concatenate(ranks)
        # base[k, s]: rows source s received before segment k starts (exact Python ints;
        # they never exceed the start, so they fit int64).
        base: list[list[int]] = [[0] * n]
        for k in range(1, len(segments)):
            base.append(self._counts_in(k - 1, segments[k][0], base[k - 1]))
        self.base_rows = base
        self.base = np.array(base, dtype=np.int64).reshape(-1, n)

    def _counts_in(self, k: int, position: int, base: list[int]) -> list[int]:
        """Rows per source in ``[0, position)`` for ``position`` in segment ``k``."""
        full, j = divmod(position - int(self.starts[k]), int(self.periods[k]))
        first = int(self.table_offsets[k])
        partial = np.bincount(self.source[first : first + j], minlength=len(base))
        w = self.weights[k]
        return [base[s] + full * int(w[s]) + int(partial[s]) for s in range(len(base))]

    def counts(self, position: int) -> list[int]:
        k = bisect.bisect_right(self.start_list, position) - 1
        return self._counts_in(k, position, self.base_rows[k])

    def locate(self, p: IntArray) -> tuple[IntArray, IntArray]:
        """``(source, source_position)`` of flat int64 positions in ``[0, 2**63 - 1]``."""
        if len(self.start_list) == 1:
            return self._in_segment(0, p)
        k_lo = bisect.bisect_right(self.start_list, int(p.min())) - 1
        k_hi = bisect.bisect_right(self.start_list, int(p.max())) - 1
        if k_lo == k_hi:  # the hot path: a block of rows inside one segment
            return self._in_segment(k_lo, p)
        if k_hi - k_lo <= _SPLIT_SEGMENTS and bool(np.all(p[1:] >= p[:-1])):
            # A block of increasing positions (a global batch) across a few boundaries:
            # cut it at the boundaries and take each piece on the hot path.
            src = np.empty_like(p)
            pos = np.empty_like(p)
            cuts = np.searchsorted(p, self.starts[k_lo + 1 : k_hi + 1]).tolist()
            for k, a, b in zip(range(k_lo, k_hi + 1), [0, *cuts], [*cuts, len(p)], strict=True):
                if a < b:
                    src[a:b], pos[a:b] = self._in_segment(k, p[a:b])
            return src, pos
        # Anything else: every row looks up its own segment, and per-(segment, source)
        # values are gathered through flat indices (2-D fancy indexing is much slower).
        seg = np.searchsorted(self.starts[k_lo + 1 : k_hi + 1], p, "right")
        if k_lo:
            seg += k_lo
        full, j = np.divmod(p - self.starts[seg], self.periods[seg])
        j += self.table_offsets[seg]
        src = self.source[j]
        flat = seg * np.int64(self.weights.shape[1])
        flat += src
        pos = self.weights.ravel()[flat]
        pos *= full
        pos += self.base.ravel()[flat]
        pos += self.rank[j]
        return src, pos

    def _in_segment(self, k: int, p: IntArray) -> tuple[IntArray, IntArray]:
        """locate() of positions that all lie in segment ``k``."""
        start = self.start_list[k]
        off = p - np.int64(start) if start else p
        full, j = np.divmod(off, np.int64(self.periods[k]))
        first = int(self.table_offsets[k])
        if first:
            j += np.int64(first)
        src = self.source[j]
        pos = self.weights[k][src]
        pos *= full
        pos += self.base[k][src]
        pos += self.rank[j]
        return src, pos


# --------------------------------------------------------------------------- Mixture


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
    _tables: _Tables | None

    def __init__(self, schedule: Schedule) -> None:
        parsed = _parse_schedule(schedule)
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

    def _built(self) -> _Tables:
        tables = self._tables
        if tables is None:
            # Racing threads may both build; either result is identical.
            tables = _Tables(self._names, self._segments)
            object.__setattr__(self, "_tables", tables)
        return tables

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
        if not _is_list(names):
            raise ConfigError(f"mixture names must be a list of strings, got {names!r}")
        order = tuple(_check_name(n) for n in names)
        if len(set(order)) != len(order):
            dup = sorted({n for n in order if order.count(n) > 1})
            raise ConfigError(f"mixture names repeat: {dup}; list every source once")
        if not _is_list(rows):
            raise ConfigError(f"a mixture schedule must be a list of rows, got {rows!r}")
        schedule: list[tuple[int, dict[str, int]]] = []
        for k, row in enumerate(rows):
            if not _is_list(row):
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
        if not _is_list(obj):
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


def _is_list(obj: object) -> TypeGuard[Sequence[Any]]:
    """A list-like sequence: not a string, bytes or mapping."""
    return isinstance(obj, Sequence) and not isinstance(obj, (str, bytes, Mapping))


def _check_position(position: object) -> int:
    if isinstance(position, bool) or not isinstance(position, (int, np.integer)):
        raise PlanError(f"position must be an integer, got {position!r}")
    p = operator.index(position)
    if not 0 <= p <= INT64_MAX:
        raise PlanError(f"position must lie in [0, 2**63 - 1], got {p}")
    return p
