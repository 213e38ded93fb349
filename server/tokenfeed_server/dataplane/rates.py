"""Rates over a sliding window, from samples of a growing count (no clock of its own).

The data plane samples each job's counts when it publishes its snapshot (twice a
second) and shows the rate over the last few seconds; taking the time from the caller
keeps the arithmetic testable without sleeping.
"""

from __future__ import annotations

import collections
import sys

__all__ = ["Rate"]


class Rate:
    """Per-second growth of a count over the last ``window_s`` seconds of samples.

    ``sample(now, count)`` records the count at ``now`` and returns the rate from the
    oldest sample still inside the window to this one (0.0 with a single sample, or
    when the count went down: a restarted source is not negative progress).
    """

    def __init__(self, window_s: float) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def held_bytes(self) -> int:
        """Estimated bytes of the samples kept (for the server's memory figures)."""
        sample = sys.getsizeof((0.0, 0)) + sys.getsizeof(0.0) + sys.getsizeof(0)
        return sys.getsizeof(self._samples) + len(self._samples) * sample

    def sample(self, now: float, count: int) -> float:
        """Record ``count`` at time ``now`` (seconds, non-decreasing); return the rate."""
        samples = self._samples
        samples.append((now, count))
        while now - samples[0][0] > self.window_s:
            samples.popleft()
        t0, n0 = samples[0]
        if now <= t0 or count < n0:
            return 0.0
        return (count - n0) / (now - t0)
