"""``TokenFeedLoader``: a DataLoader over a :class:`TokenFeedDataset` that knows its place.

It counts the batches it has handed out, so ``state_dict()`` is the consumed stream
position (the same on every rank: ``steps * world_size * batch_size``), and each
``iter()`` starts the workers from there: a restored loader continues exactly where the
saved one stopped, with any ``num_workers``. With ``num_workers=0`` it receives in a
background thread, so network waits overlap the training step. With a CUDA ``device``
it pins and copies batches ahead on a side stream (:mod:`tokenfeed.device`).
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from tokenfeed.dataset import Batch, TokenFeedDataset
from tokenfeed.device import stage


class TokenFeedLoader:
    """Iterate batches of a :class:`TokenFeedDataset`, resumably.

    Args:
        dataset: the dataset (its ``batches_per_item`` items are split back into batches).
        num_workers: DataLoader worker processes; 0 receives in a background thread.
        pin_memory: pin batches for fast GPU copies. Default: when CUDA is available.
            Asking for it without CUDA warns once and carries on unpinned.
        device: move batches there (CUDA: asynchronous, on a side stream).
        prefetch: items buffered ahead per worker (or in the background thread).
        multiprocessing_context: ``"fork"``, ``"spawn"`` or ``"forkserver"``.
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
    ) -> None:
        cuda = torch.cuda.is_available()
        if pin_memory and not cuda:
            warnings.warn(
                "pin_memory=True but CUDA is not available: batches are not pinned",
                stacklevel=2,
            )
        self.dataset = dataset
        self.num_workers = num_workers
        self.pin_memory = cuda if pin_memory is None else (pin_memory and cuda)
        self.device = torch.device(device) if device is not None else None
        self.prefetch = prefetch
        self.multiprocessing_context = multiprocessing_context
        self.position = dataset.position

    def __iter__(self) -> Iterator[Batch]:
        self.dataset.position = self.position
        batches = self._batches()
        if self.device is not None:
            batches = stage(batches, self.device)
        step = self.dataset.global_batch
        for batch in batches:
            self.position += step
            yield batch

    def _batches(self) -> Iterator[Batch]:
        if self.num_workers == 0:
            items: Iterator[Batch] = _Background(
                self.dataset.iter_worker(0, 1), self.prefetch, self.pin_memory
            )
        else:
            items = iter(
                DataLoader(
                    self.dataset,
                    batch_size=None,
                    num_workers=self.num_workers,
                    pin_memory=self.pin_memory,
                    prefetch_factor=self.prefetch,
                    multiprocessing_context=self.multiprocessing_context,
                )
            )
        if self.dataset.batches_per_item == 1:
            return items
        return _unstack(items)

    def state_dict(self) -> dict[str, Any]:
        """The resume state: consumed stream position plus the plan inputs it belongs to."""
        return self.dataset.state_dict(self.position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` at the next ``iter()``."""
        self.dataset.load_state_dict(state)
        self.position = self.dataset.position


def _unstack(items: Iterator[Batch]) -> Iterator[Batch]:
    for item in items:
        for i in range(item["input_ids"].shape[0]):
            yield {key: value[i] for key, value in item.items()}


class _Background(Iterator[Batch]):
    """Runs an iterator in a daemon thread, ``depth`` items ahead of the consumer."""

    _END = object()

    def __init__(self, source: Iterator[Batch], depth: int, pin: bool) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(source, pin), name="tokenfeed-receive", daemon=True
        )
        self._thread.start()

    def _run(self, source: Iterator[Batch], pin: bool) -> None:
        try:
            for item in source:
                ready = {k: v.pin_memory() for k, v in item.items()} if pin else item
                if not self._put(ready):
                    return
            self._put(self._END)
        except BaseException as exc:  # handed to the consumer, raised there
            self._put(exc)
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> Batch:
        item = self._queue.get()
        if item is self._END:
            self._queue.put(item)  # stay exhausted
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item  # type: ignore[no-any-return]

    def __del__(self) -> None:
        self._stop.set()
