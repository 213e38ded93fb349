"""How long a client waits before it tries again: exponential backoff with jitter.

Every retry path of the client (a refused but retryable ``hello``, a retryable ``err``
in a stream) waits :meth:`Backoff.next` seconds first. Without it a refused client asks
again at once, and a few workers of a job that waits for a free slot hold the server
busy answering thousands of refusals a second. The delay doubles from ``base`` up to
``cap``; each one is drawn from ``[delay / 2, delay]`` ("equal jitter") so that the
workers of a job, refused together, do not come back together.
"""

from __future__ import annotations

import random


class Backoff:
    """Delays of successive retries: ``base * 2**i`` capped at ``cap``, with jitter."""

    def __init__(self, base: float = 0.05, cap: float = 2.0, *, seed: int | None = None) -> None:
        if not 0 < base <= cap:
            raise ValueError(f"need 0 < base <= cap, got base={base}, cap={cap}")
        self.base = base
        self.cap = cap
        self.attempt = 0
        self._rng = random.Random(seed)

    def ceiling(self, attempt: int) -> float:
        """The largest delay before retry number ``attempt`` (0-based)."""
        return min(self.cap, self.base * 2.0 ** min(attempt, 64))

    def floor(self, attempt: int) -> float:
        """The smallest delay before retry number ``attempt``: half its ceiling."""
        return self.ceiling(attempt) / 2

    def next(self) -> float:
        """The delay before the next retry; each call moves one step up the schedule."""
        top = self.ceiling(self.attempt)
        self.attempt += 1
        return self._rng.uniform(top / 2, top)

    def reset(self) -> None:
        """Start again from ``base`` (after progress)."""
        self.attempt = 0

    def max_retries(self, seconds: float) -> int:
        """The most retries that fit in ``seconds`` if every delay is at its floor.

        A bound for tests and capacity planning: however the jitter falls, a client
        never tries more often than this in that time.
        """
        total, n = 0.0, 0
        while total + self.floor(n) <= seconds:
            total += self.floor(n)
            n += 1
        return n
