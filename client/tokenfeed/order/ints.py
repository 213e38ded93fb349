"""Integer limits and argument checks of the order math.

Positions, sizes and seeds cross the wire and numpy as int64/uint64, so every public entry
point checks its integers against those limits first and raises a
:class:`~tokenfeed.errors.PlanError` that names the fix, instead of letting numpy wrap.
"""

from __future__ import annotations

import operator

import numpy as np
import numpy.typing as npt

from tokenfeed.errors import PlanError

__all__ = ["INT64_MAX", "UINT64_MAX", "IntArray", "U64Array", "check_int", "int_array"]

INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1

IntArray = npt.NDArray[np.int64]
U64Array = npt.NDArray[np.uint64]


def check_int(name: str, value: object, lo: int, hi: int) -> int:
    """``value`` as a Python int in ``[lo, hi]``, else PlanError naming the fix."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise PlanError(f"{name} must be an integer, got {value!r}")
    v = operator.index(value)
    if v < lo:
        raise PlanError(f"{name} must be >= {lo}, got {v}")
    if v > hi:
        raise PlanError(f"{name} must be <= {hi} (int64/uint64 limit), got {v}")
    return v


def int_array(value: npt.ArrayLike, name: str) -> npt.NDArray[np.integer]:
    """``value`` as a numpy array of integers (any width), else PlanError."""
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        raise PlanError(f"{name} must be an integer array, got dtype {arr.dtype}")
    return arr
