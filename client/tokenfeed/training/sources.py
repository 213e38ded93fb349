"""Where a :class:`~tokenfeed.training.loader.TokenFeedLoader` takes its batches from.

Two ways, one interface (an iterator of batches with a ``close`` that stops everything
it started): :class:`WorkerBatches` from a DataLoader's worker processes, and
:class:`BackgroundBatches` from a receiver thread of this process (``num_workers=0``).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from tokenfeed.training.batches import Batch, unpack
from tokenfeed.transport.answer import Answer

__all__ = ["BackgroundBatches", "WorkerBatches", "pinned"]


def pinned(batch: Batch) -> Batch:
    """The batch with every tensor in pinned (page-locked) memory, for fast GPU copies."""
    return {k: v.pin_memory() for k, v in batch.items()}


class WorkerBatches(Iterator[Batch]):
    """Batches from a DataLoader's worker processes, which :meth:`close` shuts down.

    Torch stops the workers when its iterator is collected. After an error that is not
    soon: the exception's traceback holds the iterator in a reference cycle, and when a
    later loader forks its workers first, a child inherits the uncollected iterator and
    its garbage collector runs torch's shutdown there ("AssertionError: can only test a
    child process"). Shutting down here, when the loop ends, leaves nothing to inherit.
    """

    def __init__(self, loader: DataLoader[Batch], *, unpack_items: bool, pin: bool) -> None:
        self._items: Iterator[Batch] = iter(loader)
        self._unpack = unpack_items
        self._pin = pin
        self._ready: Iterator[Batch] = iter(())

    def __next__(self) -> Batch:
        if not self._unpack:
            return next(self._items)
        while True:
            batch = next(self._ready, None)
            if batch is not None:
                return pinned(batch) if self._pin else batch
            self._ready = iter(unpack(next(self._items)))

    def close(self) -> None:
        """Stop the worker processes now (idempotent)."""
        items, self._items = self._items, iter(())
        shutdown = getattr(items, "_shutdown_workers", None)  # absent: no worker processes
        if shutdown is not None:
            shutdown()


class BackgroundBatches(Iterator[Batch]):
    """Receives chunks in a daemon thread, at least one chunk ahead of the consumer.

    The threads meet once per chunk (tens of batches), not once per batch: each meeting
    costs a lock hand-off and, when the consumer was asleep, a wait for the GIL. Batches
    are converted to int64 as the consumer takes them (a few microseconds each), so what
    waits in the queue is raw tokens; with ``pin`` the thread converts and pins ahead.
    """

    def __init__(
        self,
        source: Iterator[Answer],
        convert: Callable[[Answer], Iterator[Batch]],
        pin: bool,
        stop: threading.Event,
    ) -> None:
        # One slot holds a whole chunk (tens of batches): one ready chunk plus the one being
        # consumed; the client's request window reads further ahead, at raw size, so more
        # slots would only hold memory.
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=1)
        # Shared with the source's client: its waits for the server end when this is set.
        self._stop = stop
        self._convert = convert
        self._ready: Iterator[Batch] = iter(())
        self._done: BaseException | None = None
        # The thread gets the queue and the event, not self: otherwise it would keep this
        # object alive and a forgotten iterator could never be collected and stopped.
        self._thread = threading.Thread(
            target=_receive,
            args=(source, convert, pin, self._queue, self._stop),
            name="tokenfeed-receive",
            daemon=True,
        )
        self._thread.start()

    def __next__(self) -> Batch:
        while True:
            batch = next(self._ready, None)
            if batch is not None:
                return batch
            if self._done is not None:
                raise self._done
            item = self._queue.get()
            if item is _END:
                self._done = StopIteration()
            elif isinstance(item, BaseException):
                self._done = StopIteration()  # raise it once, then stay exhausted
                raise item
            else:
                self._ready = iter(item) if isinstance(item, list) else self._convert(item)

    def close(self) -> None:
        """Stop the receiver and wait until it has closed its connection and context.

        Every wait of the receiver (the queue, the server, a failover's hellos) checks
        the stop event at least every tenth of a second, so this returns promptly even
        while the server is gone, and no receiver outlives its loop beside the next one.
        """
        self._stop.set()
        self._done = StopIteration()
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):  # free a receiver blocked on a full queue
                self._queue.get(timeout=0.05)
        self._thread.join()

    def __del__(self) -> None:
        self._stop.set()


_END = object()


def _receive(
    source: Iterator[Answer],
    convert: Callable[[Answer], Iterator[Batch]],
    pin: bool,
    out: queue.Queue[Any],
    stop: threading.Event,
) -> None:
    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for answer in source:
            batches: Any = [pinned(b) for b in convert(answer)] if pin else answer
            if not put(batches):
                return
        put(_END)
    except BaseException as exc:  # handed to the consumer, raised there
        put(exc)
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()
