"""The consumed position of a training loop, shared with the processes that report it.

Batches are consumed in the trainer's main process; the connections that tell the server
live in DataLoader worker processes. :class:`ConsumedCounter` is two int64 slots in
shared memory, made before the workers start and handed to them with the dataset (it
crosses ``fork`` as inherited memory and ``spawn``/``forkserver`` as a shared file
descriptor): the loader writes the position it has handed out, and every message that
carries it (``get``, ``bye``) reads it and notes it as reported, so the loader knows when
nothing has carried the latest value and reports it itself.

The same shared memory brings each worker's replica failovers back to the loader (one
slot per worker, written by that worker only): ``TokenFeedLoader.failovers``.

Slots are read and written whole (aligned int64, one machine word): no lock is needed,
and a stale read only delays a report, it never reports more than was consumed.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.sharedctypes
from typing import Any

__all__ = ["ConsumedCounter"]

_CONSUMED, _REPORTED, _FAILOVERS = 0, 1, 2


class ConsumedCounter:
    """The stream position a rank's training loop has consumed, and what was reported.

    Pickles only while a process is being started (``multiprocessing``'s rule for shared
    memory): hold it on a dataset only while a DataLoader starts its workers.
    """

    def __init__(self, position: int, workers: int = 1) -> None:
        slots = [position, -1] + [0] * max(1, workers)
        self._slots: Any = multiprocessing.sharedctypes.RawArray("q", slots)

    def note_failovers(self, worker: int, failovers: int) -> None:
        """Worker ``worker``'s client has failed over ``failovers`` times in this loop."""
        if 0 <= worker < len(self._slots) - _FAILOVERS:
            self._slots[_FAILOVERS + worker] = failovers

    @property
    def failovers(self) -> int:
        """Failovers of every worker's client in this loop, as they noted them."""
        return int(sum(self._slots[_FAILOVERS:]))

    @property
    def position(self) -> int:
        """The consumed position: global samples from the stream's start."""
        return int(self._slots[_CONSUMED])

    def advance(self, position: int) -> None:
        """The training loop has consumed up to ``position``."""
        self._slots[_CONSUMED] = position

    def take(self) -> int:
        """The consumed position, for a message about to carry it (noted as reported)."""
        position = int(self._slots[_CONSUMED])
        # Two writers may race here; the loser leaves a lower mark, which costs at most one
        # needless report, never a missed one.
        self._slots[_REPORTED] = max(self._slots[_REPORTED], position)
        return position

    @property
    def unreported(self) -> bool:
        """True when no message has carried the latest consumed position yet."""
        return bool(self._slots[_CONSUMED] > self._slots[_REPORTED])
