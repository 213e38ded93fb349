"""splitmix64: the fixed, portable 64-bit mixer every key of the order is derived with.

The same bits on every machine (no Python ``hash()``, no platform ``int`` width), on a
Python int (exact) or elementwise on a uint64 array (wrapping), so a server and a trainer
derive identical keys whichever form they compute.
"""

from __future__ import annotations

from typing import overload

import numpy as np
import numpy.typing as npt

from tokenfeed.order.ints import UINT64_MAX

__all__ = ["GOLDEN", "M1", "M2", "MASK64", "splitmix64"]

MASK64 = UINT64_MAX
#: splitmix64's increment (2**64 / golden ratio, odd).
GOLDEN = 0x9E3779B97F4A7C15
#: The finalizer's multipliers (odd, from splitmix64 / murmur3's fmix64), as uint64.
M1 = np.uint64(0xBF58476D1CE4E5B9)
M2 = np.uint64(0x94D049BB133111EB)


def _mix64(z: int) -> int:
    """The splitmix64 finalizer on a Python int (exact, no numpy overflow warnings)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


@overload
def splitmix64(x: int) -> int: ...
@overload
def splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]: ...
def splitmix64(x: int | npt.NDArray[np.uint64]) -> int | npt.NDArray[np.uint64]:
    """One splitmix64 output for state ``x`` (a fixed, portable 64-bit integer mixer).

    ``x`` is a Python int (exact, any size, taken mod 2**64) or a uint64 array (one output
    per element, wrapping arithmetic); both give the same bits for the same state.
    """
    if isinstance(x, int):
        return _mix64(x + GOLDEN)
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=np.uint64) + np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * M1
        z = (z ^ (z >> np.uint64(27))) * M2
        out: npt.NDArray[np.uint64] = z ^ (z >> np.uint64(31))
        return out
