"""A cap on log lines per second, so that hostile or broken clients cannot flood the log."""

from __future__ import annotations

import time


class LogBudget:
    """At most ``per_s`` warnings a second: a fuzzing client must not flood the log."""

    def __init__(self, per_s: int = 20) -> None:
        self.per_s = per_s
        self._second = 0
        self._used = 0

    def take(self) -> bool:
        """True if one more line may be logged this second."""
        second = int(time.monotonic())
        if second != self._second:
            self._second, self._used = second, 0
        self._used += 1
        return self._used <= self.per_s
