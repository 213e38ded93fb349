"""A mixture's schedule, validated and reduced to exact integer weights per segment.

Schedule and segments
    A schedule is a list of ``(start, {name: weight})`` with the first ``start`` 0 and
    the starts strictly increasing, in global stream positions (the unit of
    ``state_dict()["position"]``); a plain mapping is the one-segment schedule
    ``[(0, mapping)]``. Segment ``k`` covers positions ``[start_k, start_{k+1})``. The
    sources are numbered in order of first appearance across the schedule
    (:attr:`Mixture.names <tokenfeed.mixture.Mixture.names>`); a source absent from a
    segment has weight 0 there.

Exact proportions
    A segment's weights are made integers and reduced: when any weight is a float, every
    weight is taken to 4 decimals (``0.7 -> 7000``, rounding half to even on the decimal
    the float prints as), then all are divided by their gcd (``0.7/0.2/0.1 -> 7/2/1``).
    The reduced sum ``W`` is the segment's *period* and is at most :data:`MAX_PERIOD`.
    Every period, aligned to its segment's start (positions ``start + q*W`` to
    ``start + (q+1)*W - 1``), holds each source exactly its reduced weight times; no
    sampling, so proportions never drift.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from decimal import ROUND_HALF_EVEN, Decimal, localcontext
from typing import Any, TypeAlias, TypeGuard

import numpy as np

from tokenfeed.errors import ConfigError
from tokenfeed.order.ints import INT64_MAX

__all__ = [
    "MAX_PERIOD",
    "WEIGHT_DECIMALS",
    "Schedule",
    "Weight",
    "check_name",
    "is_list",
    "parse_schedule",
]

#: Largest reduced weight sum (period) of one segment: bounds a period's table (16 bytes a
#: row, 1 MiB at the limit) and the time to build it.
MAX_PERIOD = 65536
#: Float weights are taken to this many decimals before being reduced to integers.
WEIGHT_DECIMALS = 4

Weight: TypeAlias = "int | float"
Schedule: TypeAlias = "Mapping[str, Weight] | Sequence[tuple[int, Mapping[str, Weight]]]"
_QUANTUM = Decimal(1).scaleb(-WEIGHT_DECIMALS)
_SCALE = 10**WEIGHT_DECIMALS


def check_name(name: object) -> str:
    """``name`` if it is a valid source name (a dataset's name), else ConfigError."""
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
        check_name(name)
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


def parse_schedule(schedule: object) -> list[tuple[int, dict[str, int]]]:
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
        if not is_list(item):
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


def is_list(obj: object) -> TypeGuard[Sequence[Any]]:
    """A list-like sequence: not a string, bytes or mapping."""
    return isinstance(obj, Sequence) and not isinstance(obj, (str, bytes, Mapping))
