"""The data plane's scheduling, without sockets: fair queueing and the egress cap.

:class:`FairQueue` is deficit round robin (Shreedhar and Varghese, 1995) in two levels:
over groups (the tenants), each turn a group may spend ``weight x quantum`` bytes, then
over the flows of a group (its jobs), which split that share. So shares follow tenant
weights, not the number of jobs, requests or connections a tenant opens. :class:`TokenBucket` caps
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
    queue: collections.deque[T] = field(default_factory=collections.deque)
    deficit: float = 0.0
    in_turn: bool = False  # a turn paused (egress cap, group budget) keeps its quantum


@dataclass
class _Group(Generic[K]):
    weight: float
    flows: collections.deque[K] = field(default_factory=collections.deque)  # rotation
    deficit: float = 0.0
    in_turn: bool = False
    queued: int = 0


class FairQueue(Generic[K, T]):
    """Deficit round robin over groups of flows (tenants of jobs), then over the flows of
    each group.

    ``serve_round(serve, may_send)`` visits each group once: a backlogged group adds
    ``weight x quantum`` to its deficit and spends it on its backlogged flows, which take
    turns by deficit round robin among themselves (each adding ``quantum``, equal shares);
    ``serve`` returns what each item cost (bytes sent; 0 for an item dropped). So a
    group's share follows its weight whatever the number of flows it opens, and its flows
    split that share. Idle groups and flows bank no credit. When ``may_send()`` says no,
    or the group's budget runs out mid-turn, the round stops there and that turn resumes,
    without a fresh quantum, at the next round.

    A flow added without a group is a group of its own (with the flow's weight): plain
    deficit round robin over flows.
    """

    def __init__(self, quantum: float) -> None:
        if quantum <= 0:
            raise ValueError(f"quantum must be > 0, got {quantum}")
        self.quantum = quantum
        self._flows: dict[K, _Flow[T]] = {}
        self._group_of: dict[K, Hashable] = {}
        self._groups: dict[Hashable, _Group[K]] = {}
        self._rotation: collections.deque[Hashable] = collections.deque()
        self._size = 0

    def __len__(self) -> int:
        """Items queued over all flows."""
        return self._size

    def __contains__(self, key: object) -> bool:
        return key in self._flows

    def __iter__(self) -> Iterator[K]:
        return iter(self._flows)

    def add(self, key: K, weight: float = 1.0, *, group: Hashable | None = None) -> None:
        """Start a flow in ``group`` (default: a group of its own). ``weight`` (> 0) is
        the group's share relative to the other groups, taken when the group is made."""
        if key in self._flows:
            raise KeyError(f"flow {key!r} exists")
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        name: Hashable = ("flow", key) if group is None else ("group", group)
        box = self._groups.get(name)
        if box is None:
            box = self._groups[name] = _Group(weight)
            self._rotation.append(name)
        box.flows.append(key)
        self._flows[key] = _Flow()
        self._group_of[key] = name

    def remove(self, key: K) -> None:
        """Forget a flow and whatever it still had queued."""
        flow = self._flows.pop(key)
        name = self._group_of.pop(key)
        box = self._groups[name]
        self._size -= len(flow.queue)
        box.queued -= len(flow.queue)
        box.flows.remove(key)
        if not box.flows:
            del self._groups[name]
            self._rotation.remove(name)

    def push(self, key: K, item: T) -> None:
        """Queue ``item`` at the end of flow ``key``."""
        self._flows[key].queue.append(item)
        self._groups[self._group_of[key]].queued += 1
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
        self._groups[self._group_of[key]].queued -= dropped
        return dropped

    def serve_round(self, serve: Callable[[K, T], int], may_send: Callable[[], bool]) -> None:
        """One round of deficit round robin (see the class docstring)."""
        for _ in range(len(self._rotation)):
            name = self._rotation[0]
            box = self._groups[name]
            if box.queued:
                if not box.in_turn:
                    box.deficit += self.quantum * box.weight
                    box.in_turn = True
                if not self._serve_group(box, serve, may_send):
                    return  # paused by the cap: this group resumes its turn next round
            else:
                box.deficit = 0.0  # idle groups bank no credit
            box.in_turn = False
            if name in self._groups:
                self._rotation.rotate(-1)

    def _serve_group(
        self, box: _Group[K], serve: Callable[[K, T], int], may_send: Callable[[], bool]
    ) -> bool:
        """Spend the group's deficit on its flows' turns; False when the cap paused it.

        A flow whose turn the group's budget cut short keeps it (and its place at the
        head of the group's rotation) for the group's next turn.
        """
        while box.deficit > 0 and box.queued > 0:
            key = box.flows[0]
            flow = self._flows[key]
            if flow.queue:
                if not flow.in_turn:
                    flow.deficit += self.quantum
                    flow.in_turn = True
                while flow.queue and flow.deficit > 0 and box.deficit > 0:
                    if not may_send():
                        return False
                    item = flow.queue.popleft()
                    self._size -= 1
                    box.queued -= 1
                    cost = serve(key, item)
                    flow.deficit -= cost
                    box.deficit -= cost
                    if key not in self._flows:
                        break  # serve() removed the flow (e.g. its last peer vanished)
                if key in self._flows and flow.queue and flow.deficit > 0:
                    return True  # the group's budget ran out mid-turn: resume here
            else:
                flow.deficit = 0.0
            flow.in_turn = False
            if key in self._flows:
                box.flows.rotate(-1)
        return True


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
