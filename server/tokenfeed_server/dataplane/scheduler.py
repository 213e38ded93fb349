"""The data plane's scheduling, without sockets: fair queueing and the egress cap.

:class:`FairQueue` is deficit round robin (Shreedhar and Varghese, 1995) over flows (the
server's jobs): each turn a flow may spend ``weight x quantum`` bytes, so shares follow
weights, not the number of requests or connections a flow has. :class:`TokenBucket` caps
the server's egress in tokens per second. Both take their costs and clock from the caller,
so their unit tests need no socket and no sleeping.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


@dataclass
class _Flow(Generic[T]):
    weight: float
    queue: collections.deque[T] = field(default_factory=collections.deque)
    deficit: float = 0.0
    in_turn: bool = False  # a turn paused by the egress cap keeps its quantum


class FairQueue(Generic[K, T]):
    """Deficit round robin over named flows of queued items.

    ``serve_round(serve, may_send)`` visits each flow once; a backlogged flow adds
    ``weight x quantum`` to its deficit and has items served while the deficit is
    positive, ``serve`` returning what each cost (bytes sent; 0 for an item dropped). An
    idle flow banks no credit. When ``may_send()`` says no, the round stops and the same
    flow resumes its turn, without a fresh quantum, at the next round.
    """

    def __init__(self, quantum: float) -> None:
        if quantum <= 0:
            raise ValueError(f"quantum must be > 0, got {quantum}")
        self.quantum = quantum
        self._flows: dict[K, _Flow[T]] = {}
        self._rotation: collections.deque[K] = collections.deque()
        self._size = 0

    def __len__(self) -> int:
        """Items queued over all flows."""
        return self._size

    def __contains__(self, key: object) -> bool:
        return key in self._flows

    def __iter__(self) -> Iterator[K]:
        return iter(self._flows)

    def add(self, key: K, weight: float = 1.0) -> None:
        """Start a flow with a positive weight (its share relative to the others)."""
        if key in self._flows:
            raise KeyError(f"flow {key!r} exists")
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        self._flows[key] = _Flow(weight)
        self._rotation.append(key)

    def remove(self, key: K) -> None:
        """Forget a flow and whatever it still had queued."""
        flow = self._flows.pop(key)
        self._size -= len(flow.queue)
        self._rotation.remove(key)

    def push(self, key: K, item: T) -> None:
        """Queue ``item`` at the end of flow ``key``."""
        self._flows[key].queue.append(item)
        self._size += 1

    def queued(self, key: K) -> int:
        """Items waiting in flow ``key``."""
        return len(self._flows[key].queue)

    def discard(self, key: K, drop: Callable[[T], bool]) -> int:
        """Remove the items of flow ``key`` for which ``drop`` is true; return how many."""
        flow = self._flows.get(key)
        if flow is None:
            return 0
        kept = collections.deque(item for item in flow.queue if not drop(item))
        dropped = len(flow.queue) - len(kept)
        flow.queue = kept
        self._size -= dropped
        return dropped

    def serve_round(self, serve: Callable[[K, T], int], may_send: Callable[[], bool]) -> None:
        """One round of deficit round robin (see the class docstring)."""
        for _ in range(len(self._rotation)):
            key = self._rotation[0]
            flow = self._flows[key]
            if flow.queue:
                if not flow.in_turn:
                    flow.deficit += self.quantum * flow.weight
                    flow.in_turn = True
                while flow.queue and flow.deficit > 0:
                    if not may_send():
                        return  # this flow resumes its turn when the cap allows
                    item = flow.queue.popleft()
                    self._size -= 1
                    flow.deficit -= serve(key, item)
                    if key not in self._flows:
                        break  # serve() removed the flow (e.g. its last peer vanished)
            else:
                flow.deficit = 0.0  # idle flows bank no credit
            flow.in_turn = False
            if key in self._flows:
                self._rotation.rotate(-1)


class TokenBucket:
    """Egress cap in tokens per second (0: none), allowing bursts of a tenth of a second.

    ``ready()`` says whether the next chunk may go; ``spend(n)`` charges it afterwards,
    so the level may go below zero by one chunk and ``wait_s()`` says how long until it
    is positive again. ``clock`` is injectable for tests.
    """

    def __init__(self, rate: int, clock: Callable[[], float] = time.monotonic) -> None:
        if rate < 0:
            raise ValueError(f"rate must be >= 0 tokens/s, got {rate}")
        self.rate = rate
        self._clock = clock
        self.level = rate / 10
        self._stamp = clock()

    def _refill(self) -> None:
        now = self._clock()
        self.level = min(self.rate / 10, self.level + (now - self._stamp) * self.rate)
        self._stamp = now

    def ready(self) -> bool:
        """True when the cap allows sending now."""
        if not self.rate:
            return True
        self._refill()
        return self.level > 0

    def spend(self, tokens: int) -> None:
        """Charge ``tokens`` just sent."""
        if self.rate:
            self.level -= tokens

    def wait_s(self) -> float:
        """Seconds until :meth:`ready` turns true (0 when it is now)."""
        if self.ready():
            return 0.0
        return -self.level / self.rate
