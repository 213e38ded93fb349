"""How busy the data plane's loop is: the busiest turn, and busy time in all.

The loop serves every job from one thread and idles by design (it waits on its sockets);
a turn that works long (a big mixture's tables built, a slow store) holds every other
job for that long. The loop notes each turn's busy time here; the snapshot publishes it
(``/metrics``: ``tokenfeed_loop_busiest_turn_seconds``, the maximum since start and over
the last snapshot interval, and ``tokenfeed_loop_busy_seconds_total``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoopBusy"]


@dataclass
class LoopBusy:
    """Busy time of the loop's turns (only the loop thread writes it)."""

    #: the busiest turn since start, in seconds
    busiest_s: float = 0.0
    #: the busiest turn since the last :meth:`view`
    recent_s: float = 0.0
    #: busy time in all
    total_s: float = 0.0
    turns: int = 0

    def note(self, seconds: float) -> None:
        """One turn took ``seconds`` of work."""
        self.turns += 1
        self.total_s += seconds
        if seconds > self.recent_s:
            self.recent_s = seconds
            self.busiest_s = max(self.busiest_s, seconds)

    def view(self) -> dict[str, float]:
        """The figures for the snapshot; starts a new recent window."""
        out = {
            "busiest_turn_s": self.busiest_s,
            "recent_busiest_turn_s": self.recent_s,
            "busy_s": self.total_s,
            "turns": float(self.turns),
        }
        self.recent_s = 0.0
        return out
