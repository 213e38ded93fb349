"""What torch's DataLoader does with its workers' streams, without torch: the round robin
that the plan's worker_steps is built for (shared by the plan and order tests)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


def dataloader_round_robin(streams: list[Iterator[T]], limit: int) -> list[T]:
    """What torch's DataLoader yields from an IterableDataset: items from workers 0, 1,
    ..., K-1, 0, ... in turn, skipping workers that are exhausted."""
    out: list[T] = []
    live = list(range(len(streams)))
    i = 0
    while live and len(out) < limit:
        w = live[i % len(live)]
        item = next(streams[w], None)
        if item is None:
            live.remove(w)
            continue  # the next worker takes this turn (i stays pointing at it)
        out.append(item)
        i += 1
    return out
