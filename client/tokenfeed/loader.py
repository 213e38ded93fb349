"""``TokenFeedLoader``: a DataLoader over a :class:`TokenFeedDataset` that knows its place.

It counts the batches it has handed out, so ``state_dict()`` is the consumed stream
position (the same on every rank: ``steps * world_size * batch_size``), and each
``iter()`` starts the workers from there: a restored loader continues exactly where the
saved one stopped, with any ``num_workers``; ``state_dict`` / ``load_state_dict`` are
torchdata's ``Stateful`` protocol. With ``num_workers=0`` it receives in a background
thread, so network waits overlap the training step. With a CUDA ``device`` it pins and
copies batches ahead on a side stream (:mod:`tokenfeed.device`).

The server learns how far training is from the loader, not from what it sent: the
position handed out is shared with the workers (:mod:`tokenfeed.consumed`), who put it on
their requests; when no request has carried the latest value for ``report_after``
seconds (a pause for evaluation, the end of the loop), the loader tells it itself.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from tokenfeed.client import Answer
from tokenfeed.consumed import ConsumedCounter
from tokenfeed.dataset import Batch, TokenFeedDataset, unpack
from tokenfeed.device import stage
from tokenfeed.errors import ConfigError

_MAX_AUTO_PACK = 16


class TokenFeedLoader:
    """Iterate batches of a :class:`TokenFeedDataset`, resumably.

    Args:
        dataset: the dataset (its ``batches_per_item`` items are split back into batches).
        num_workers: DataLoader worker processes; 0 receives in a background thread.
        pin_memory: pin batches for fast GPU copies. Default: when CUDA is available.
            Asking for it without CUDA warns once and carries on unpinned.
        device: move batches there (CUDA: asynchronous, on a side stream).
        prefetch: items buffered ahead per worker process (with ``num_workers=0`` one
            received chunk waits ready and the request window reads further ahead).
        multiprocessing_context: ``"fork"``, ``"spawn"`` or ``"forkserver"``.
        report_after: seconds the server may go without hearing the consumed position
            (requests carry it while the loop runs) before the loader tells it on a short
            connection of its own; None: never (the server then lags by up to the
            request window plus the prefetch until the loop resumes or ends).
    """

    def __init__(
        self,
        dataset: TokenFeedDataset,
        *,
        num_workers: int = 2,
        pin_memory: bool | None = None,
        device: str | torch.device | None = None,
        prefetch: int = 4,
        multiprocessing_context: str | None = None,
        report_after: float | None = 5.0,
    ) -> None:
        cuda = torch.cuda.is_available()
        if pin_memory and not cuda:
            warnings.warn(
                "pin_memory=True but CUDA is not available: batches are not pinned",
                stacklevel=2,
            )
        if num_workers > 0 and dataset.auto_batches_per_item:
            # Worker processes hand items over at ~1 ms each: pack about 1 MiB of raw
            # tokens per item (measured 12x the throughput of one batch per item).
            batch_bytes = dataset.job.batch_size * (dataset.job.seq_len + 1) * 2
            dataset.batches_per_item = max(1, min(_MAX_AUTO_PACK, (1 << 20) // batch_bytes))
        self.dataset = dataset
        self.num_workers = num_workers
        self.pin_memory = cuda if pin_memory is None else (pin_memory and cuda)
        self.device = torch.device(device) if device is not None else None
        self.prefetch = prefetch
        self.multiprocessing_context = multiprocessing_context
        if report_after is not None and not report_after > 0:
            raise ConfigError(f"report_after must be > 0 seconds or None, got {report_after!r}")
        self.report_after = report_after
        self.position = dataset.position

    def __iter__(self) -> Iterator[Batch]:
        self.dataset.position = self.position
        # Made before the workers start, so that they inherit it with the dataset.
        consumed = self.dataset.consumed = ConsumedCounter(self.position)
        reporter: _Reporter | None = None
        step = self.dataset.global_batch
        try:
            source = self._source()
            # Started only now, after the workers were forked: a fork while this thread
            # held a lock (the resolver's, logging's) would leave it held in the child.
            if self.report_after:
                reporter = _Reporter(self.dataset, self.report_after)
            try:
                batches = stage(source, self.device) if self.device is not None else source
                for batch in batches:
                    self.position += step
                    consumed.advance(self.position)
                    yield batch
            finally:
                # A loop left early (break, exception) must not leave a receiver thread or
                # worker processes running.
                source.close()
        finally:
            if reporter is not None:
                reporter.stop()
            if consumed.unreported:  # e.g. workers that ended before the last batches did
                self.dataset.report_consumed()
            self.dataset.consumed = None

    def _source(self) -> _Background | _Workers:
        if self.num_workers == 0:
            stop = threading.Event()
            answers = self.dataset.iter_answers(0, 1, stop=stop)
            return _Background(answers, self.dataset.convert, self.pin_memory, stop)
        # Hello from this process first: the workers then read the build pinned here (or
        # the loaded state's), and a refusal is raised here, not from inside a worker.
        self.dataset.check_server()
        packed = self.dataset.batches_per_item > 1
        loader = DataLoader(
            self.dataset,
            batch_size=None,
            num_workers=self.num_workers,
            # packed items hold raw tokens: pin the int64 batches made from them instead
            pin_memory=self.pin_memory and not packed,
            prefetch_factor=self.prefetch,
            multiprocessing_context=self.multiprocessing_context,
        )
        return _Workers(loader, unpack_items=packed, pin=self.pin_memory)

    # state_dict / load_state_dict are exactly torchdata's ``Stateful`` protocol (and the
    # hooks Lightning and torch.distributed.checkpoint look for): keep the signatures.
    def state_dict(self) -> dict[str, Any]:
        """The resume state: consumed stream position plus the plan inputs it belongs to
        (the order, the dataset builds, and a mixture's schedule: see
        :meth:`TokenFeedDataset.state_dict <tokenfeed.dataset.TokenFeedDataset.state_dict>`)."""
        return self.dataset.state_dict(self.position)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict`` at the next ``iter()`` (with any ``num_workers``,
        ``batch_size`` or ``world_size``; a mixture's schedule may differ after the saved
        position); raises ConfigError, before changing anything, for a state that does not
        continue this loader's stream."""
        self.dataset.load_state_dict(state_dict)
        self.position = self.dataset.position


def _pinned(batch: Batch) -> Batch:
    """The batch with every tensor in pinned (page-locked) memory, for fast GPU copies."""
    return {k: v.pin_memory() for k, v in batch.items()}


class _Reporter:
    """Tells the server the consumed position when no request has carried it for
    ``every`` seconds: the loop is paused, or the window and prefetch are so deep that
    requests are rare. A daemon thread of the main process, which sees the position."""

    def __init__(self, dataset: TokenFeedDataset, every: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(dataset, every), name="tokenfeed-progress", daemon=True
        )
        self._thread.start()

    def _run(self, dataset: TokenFeedDataset, every: float) -> None:
        while not self._stop.wait(every):
            consumed = dataset.consumed
            if consumed is not None and consumed.unreported:
                dataset.report_consumed(timeout=min(every, 2.0))

    def stop(self) -> None:
        """Stop the thread, waiting for a report under way."""
        self._stop.set()
        self._thread.join(timeout=5.0)


class _Workers(Iterator[Batch]):
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
                return _pinned(batch) if self._pin else batch
            self._ready = iter(unpack(next(self._items)))

    def close(self) -> None:
        """Stop the worker processes now (idempotent)."""
        items, self._items = self._items, iter(())
        shutdown = getattr(items, "_shutdown_workers", None)  # absent: no worker processes
        if shutdown is not None:
            shutdown()


class _Background(Iterator[Batch]):
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
            batches: Any = [_pinned(b) for b in convert(answer)] if pin else answer
            if not put(batches):
                return
        put(_END)
    except BaseException as exc:  # handed to the consumer, raised there
        put(exc)
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()
