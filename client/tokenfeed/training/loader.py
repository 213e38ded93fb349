"""``TokenFeedLoader``: a DataLoader over a :class:`TokenFeedDataset` that knows its place.

It counts the batches it has handed out, so ``state_dict()`` is the consumed stream
position (the same on every rank: ``steps * world_size * batch_size``), and each
``iter()`` starts the workers from there: a restored loader continues exactly where the
saved one stopped, with any ``num_workers``; ``state_dict`` / ``load_state_dict`` are
torchdata's ``Stateful`` protocol. With ``num_workers=0`` it receives in a background
thread, so network waits overlap the training step. With a CUDA ``device`` it pins and
copies batches ahead on a side stream (:mod:`tokenfeed.training.device`).

The server learns how far training is from the loader, not from what it sent: the
position handed out is shared with the workers (:mod:`tokenfeed.training.consumed`), who put it on
their requests; when no request has carried the latest value for ``report_after``
seconds (a pause for evaluation, the end of the loop), the loader tells it itself.
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from tokenfeed.errors import ConfigError
from tokenfeed.training.batches import Batch
from tokenfeed.training.consumed import ConsumedCounter
from tokenfeed.training.dataset import TokenFeedDataset
from tokenfeed.training.device import stage
from tokenfeed.training.sources import BackgroundBatches, WorkerBatches

__all__ = ["TokenFeedLoader"]

_MAX_AUTO_PACK = 64
_AUTO_PACK_BYTES = 2 << 20


class TokenFeedLoader:
    """Iterate batches of a :class:`TokenFeedDataset`, resumably.

    Args:
        dataset: the dataset (its ``batches_per_item`` items are split back into batches).
            The loader does not change its settings (it packs worker items its own way,
            :attr:`batches_per_item`); it does set its position for each ``iter()``.
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
        #: batches per item from the worker processes: the dataset's, unless it left the
        #: choice to the loader. The loader's own: the dataset is not changed, so it may
        #: feed other loaders or a DataLoader of its own as it was given.
        self.batches_per_item = dataset.batches_per_item
        if num_workers > 0 and dataset.auto_batches_per_item:
            # Worker processes hand items over at ~1 ms each (a descriptor passed over a
            # fresh connection): pack about 2 MiB of raw tokens per item (measured 12x the
            # throughput of one batch per item at 1 MiB, 1.3-1.7x more at 2 MiB).
            batch_bytes = dataset.job.batch_size * (dataset.job.seq_len + 1) * 2
            self.batches_per_item = max(1, min(_MAX_AUTO_PACK, _AUTO_PACK_BYTES // batch_bytes))
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
        self._failovers = 0  # of the loops that ended; the running one's are shared
        self._counter: ConsumedCounter | None = None  # the running loop's

    @property
    def failovers(self) -> int:
        """Times the clients of this loader's workers moved to another replica because
        theirs stopped answering, over every ``iter()`` of this loader so far (the
        client's side of failover counting; each server counts its own arrivals in
        ``clients_resumed``). Counted as each worker's batches arrive."""
        running = self._counter
        return self._failovers + (running.failovers if running is not None else 0)

    def __iter__(self) -> Iterator[Batch]:
        self.dataset.position = self.position
        # Made before the workers start, so that they inherit it with the dataset.
        consumed = self.dataset.consumed = ConsumedCounter(self.position, self.num_workers)
        self._counter = consumed
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
            self._failovers += consumed.failovers
            self._counter = self.dataset.consumed = None

    def _source(self) -> BackgroundBatches | WorkerBatches:
        if self.num_workers == 0:
            stop = threading.Event()
            answers = self.dataset.iter_answers(0, 1, stop=stop)
            return BackgroundBatches(answers, self.dataset.convert, self.pin_memory, stop)
        # Hello from this process first: the workers then read the build pinned here (or
        # the loaded state's), and a refusal is raised here, not from inside a worker.
        self.dataset.check_server()
        packed = self.batches_per_item > 1
        # The workers get a copy with the loader's packing (they get a copy anyway: pickled
        # or forked), taken after the position, counter and build above were set.
        items = copy.copy(self.dataset)
        items.batches_per_item = self.batches_per_item
        loader = DataLoader(
            items,
            batch_size=None,
            num_workers=self.num_workers,
            # packed items hold raw tokens: pin the int64 batches made from them instead
            pin_memory=self.pin_memory and not packed,
            prefetch_factor=self.prefetch,
            multiprocessing_context=self.multiprocessing_context,
        )
        return WorkerBatches(loader, unpack_items=packed, pin=self.pin_memory)

    # state_dict / load_state_dict are exactly torchdata's ``Stateful`` protocol (and the
    # hooks Lightning and torch.distributed.checkpoint look for): keep the signatures.
    def state_dict(self) -> dict[str, Any]:
        """The resume state: consumed stream position plus the plan inputs it belongs to
        (the order, the dataset builds, and a mixture's schedule: see
        :meth:`TokenFeedDataset.state_dict <tokenfeed.dataset.TokenFeedDataset.state_dict>`)."""
        return self.dataset.state_dict(self.position)

    def load_state_dict(self, state_dict: dict[str, Any], *, skip_batches: int = 0) -> None:
        """Continue from ``state_dict`` at the next ``iter()`` (with any ``num_workers``,
        ``batch_size`` or ``world_size``; a mixture's schedule may differ after the saved
        position); raises ConfigError, before changing anything, for a state that does not
        continue this loader's stream. ``skip_batches`` leaves out the next that many
        global batches (see :meth:`TokenFeedDataset.load_state_dict
        <tokenfeed.dataset.TokenFeedDataset.load_state_dict>`)."""
        self.dataset.load_state_dict(state_dict, skip_batches=skip_batches)
        self.position = self.dataset.position


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
