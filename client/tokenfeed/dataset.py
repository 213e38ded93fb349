"""The torch ``IterableDataset`` that runs in every DataLoader worker.

Each worker works out which local steps are its own from ``get_worker_info()`` and the
plan (worker ``w`` of ``K`` produces local steps ``w, w+K, ...``, the order in which the
DataLoader takes batches round-robin from its workers), asks the server for exactly
those, and yields them as batches. No ``worker_init_fn``, no sharding by hand: the
DataLoader's output is the rank's local steps ``0, 1, 2, ...`` in order, every window of
every epoch exactly once.

The dataset object holds plain settings only: it pickles (spawn and forkserver work) and
opens its socket lazily in ``__iter__``, after the worker process exists.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Literal, get_args

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from tokenfeed.client import Answer, ClientOptions, FeedClient
from tokenfeed.consumed import ConsumedCounter
from tokenfeed.documents import document_fields
from tokenfeed.errors import ConfigError, TokenFeedError
from tokenfeed.plan import steps_to_cover, worker_steps
from tokenfeed.protocol import DTYPES, JobSpec, Welcome
from tokenfeed.replicas import Replicas, parse_endpoints
from tokenfeed.window import pack_requests

Batch = dict[str, torch.Tensor]

log = logging.getLogger("tokenfeed")

#: What ``labels`` holds: ``"shifted"``: the next token of each input (``labels[:, t] ==
#: token t + 1``), for a plain ``cross_entropy(logits, labels)``; ``"unshifted"``: a copy of
#: ``input_ids``, for models that shift inside their loss (Hugging Face causal LMs).
LabelMode = Literal["shifted", "unshifted"]
LABEL_MODES: tuple[LabelMode, ...] = get_args(LabelMode)


class TokenFeedDataset(IterableDataset[Batch]):
    """Whole batches of one rank from a tokenfeed server; use with ``batch_size=None``.

    Each batch is a dict of ``input_ids`` and ``labels`` (int64 ``[batch_size, seq_len]``;
    see ``labels``), ``window_ids`` (int64 ``[batch_size]``, the global window index of
    each row) and ``epoch`` (int64 ``[batch_size]``).

    Args:
        endpoint: the server's data endpoint, e.g. ``tcp://127.0.0.1:7400``; or several
            replicas over the same store: a list, a comma-separated string, or a host
            name with several addresses. Workers start spread over them and move to the
            next one when theirs stops answering (see :mod:`tokenfeed.replicas`).
        dataset: dataset name in the server's store.
        seq_len, batch_size, seed: the plan inputs (batch_size is per rank).
        rank, world_size: default from ``torch.distributed`` if initialised, else the
            ``RANK``/``WORLD_SIZE`` environment variables, else 0 and 1.
        epochs, samples: end the stream once this many epochs (or stream positions) are
            covered; every rank stops at the same step. Default: endless.
        token: the tenant's token (default: the ``TOKENFEED_TOKEN`` environment variable).
        server_public_key: the server's CURVE public key, to encrypt the connection.
        window: requests in flight per worker; chunk_bytes: about how much data one
            request asks for (several batches per message); request_timeout, deadline: see
            :class:`tokenfeed.client.FeedClient`.
        batches_per_item: batches per DataLoader item; more per item means less
            inter-process overhead per batch. Items of several batches are packed raw
            tokens: :class:`~tokenfeed.TokenFeedLoader` unpacks them (or call
            :func:`unpack` in your own loop). Default: one batch per item, except that
            ``TokenFeedLoader`` with worker processes packs about 1 MiB (at most 16).
        document_boundaries: also give each batch ``position_ids`` (int64
            ``[batch_size, seq_len]``, restarting at every document) and ``cu_seqlens``
            (int32, cumulative document lengths over the flattened batch), so attention
            can stay inside documents in packed rows.
        labels: ``"shifted"`` (default): ``labels[:, t]`` is the token after
            ``input_ids[:, t]``, so ``cross_entropy(model(input_ids), labels)`` is the
            next-token loss over all ``seq_len`` positions. ``"unshifted"``: ``labels`` is
            a copy of ``input_ids``, what Hugging Face causal LMs take as ``labels=``
            (they shift inside their loss, predicting ``seq_len - 1`` positions per row).
            Feeding shifted labels to such a model trains it on the token *after* next.
    """

    def __init__(
        self,
        endpoint: str | Sequence[str],
        dataset: str,
        *,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        epochs: int | None = None,
        samples: int | None = None,
        token: str | None = None,
        server_public_key: str | None = None,
        window: int = 4,
        chunk_bytes: int = 1 << 20,
        request_timeout: float = 10.0,
        deadline: float = 120.0,
        batches_per_item: int | None = None,
        document_boundaries: bool = False,
        labels: LabelMode = "shifted",
    ) -> None:
        super().__init__()
        if labels not in LABEL_MODES:
            raise ConfigError(
                f"labels must be one of {', '.join(map(repr, LABEL_MODES))}, got {labels!r}: "
                "'shifted' for a plain cross_entropy(logits, labels), 'unshifted' for "
                "Hugging Face causal LMs, which shift labels themselves"
            )
        default_rank, default_world = _distributed_defaults()
        self.rank = default_rank if rank is None else rank
        self.world_size = default_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside [0, world_size={self.world_size})")
        if epochs is not None and samples is not None:
            raise ConfigError("give epochs or samples, not both")
        if batches_per_item is not None and batches_per_item < 1:
            raise ConfigError("batches_per_item must be >= 1")
        #: the endpoints, checked (one, or several replicas)
        self.endpoints = parse_endpoints(endpoint)
        self.job = JobSpec(dataset, seq_len, batch_size, seed, self.world_size)
        self.epochs = epochs
        self.samples = samples
        self.batches_per_item = batches_per_item or 1
        #: True when the caller left batches_per_item to the loader
        self.auto_batches_per_item = batches_per_item is None
        self.options = ClientOptions(
            window=window,
            chunk_bytes=chunk_bytes,
            request_timeout=request_timeout,
            deadline=deadline,
            token=token if token is not None else os.environ.get("TOKENFEED_TOKEN"),
            server_public_key=server_public_key,
        )
        #: stream position (global samples consumed) that the next ``iter()`` starts at
        self.position = 0
        self.n_windows: int | None = None
        self.document_boundaries = document_boundaries
        self.labels: LabelMode = labels
        #: the dataset's EOS id, known once connected
        self.eos_id: int | None = None
        #: the dataset build this reads: from a loaded state, else the first welcome
        self.fingerprint: str | None = None
        #: the training loop's consumed position, told to the server on every get and
        #: bye; set while iterated directly or by TokenFeedLoader (None: not known)
        self.consumed: ConsumedCounter | None = None

    @property
    def global_batch(self) -> int:
        """Samples per global step: ``world_size * batch_size``."""
        return self.job.world_size * self.job.batch_size

    @property
    def boundary_eos(self) -> int | None:
        """The EOS id to cut documents at, or None when boundaries were not asked for."""
        return self.eos_id if self.document_boundaries else None

    def convert(self, answer: Answer) -> Iterator[Batch]:
        """The batches of an answer from :meth:`iter_answers`, converted as they are taken."""
        return batches_of(answer, self.job.batch_size, self.boundary_eos, self.labels)

    def check_server(self) -> Welcome:
        """Say hello from this process: learn the dataset's build and sizes, pin the build.

        :class:`~tokenfeed.TokenFeedLoader` calls this before it starts worker processes,
        so a refusal (another build than a loaded state's, a forbidden dataset) is raised
        here and every worker reads the same build.
        """
        # Every rank asks the same replica (the first), not its own: with replicas of
        # different builds, all ranks pin the same one, and the others refuse.
        return self._pin_build()

    def _pin_build(self, stop: threading.Event | None = None) -> Welcome:
        with self._client(0, slot=0, stop=stop) as client:
            return self._learn(client.hello())

    def _client(
        self,
        worker: int,
        num_workers: int = 1,
        *,
        slot: int | None = None,
        stop: threading.Event | None = None,
    ) -> FeedClient:
        return FeedClient(
            self.endpoints,
            self.job,
            rank=self.rank,
            worker=worker,
            num_workers=num_workers,
            slot=slot,
            options=self.options,
            fingerprint=self.fingerprint,
            consumed=self._take_consumed,
            stop=stop,
        )

    def _take_consumed(self) -> int:
        return -1 if self.consumed is None else self.consumed.take()

    def report_consumed(self, timeout: float = 2.0) -> None:
        """Tell the server the consumed position now, on a short connection of this
        process (``hello``, then ``bye`` carrying it); give up silently after ``timeout``
        seconds: progress is information, never worth failing a training loop for."""
        try:
            with self._client(0, slot=0) as client:
                client.hello(deadline_at=time.monotonic() + timeout)
        except TokenFeedError as exc:
            log.debug("could not report the consumed position: %s", exc)

    def _learn(self, welcome: Welcome) -> Welcome:
        self.n_windows = welcome.n_windows
        self.eos_id = welcome.eos_id
        self.fingerprint = welcome.fingerprint
        return welcome

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        if info is None:
            return self._counting(self.iter_worker(0, 1))
        return self.iter_worker(info.id, info.num_workers)

    def _counting(self, items: Iterator[Batch]) -> Iterator[Batch]:
        # Iterated directly (no DataLoader): keep our own consumed position, and let the
        # client tell it to the server (its last word, the bye, comes from items.close()).
        own = self.consumed is None
        if self.consumed is None:
            self.consumed = ConsumedCounter(self.position)
        counter = self.consumed
        try:
            for item in items:
                self.position += self.global_batch * _batches_in(item, self.batches_per_item)
                counter.advance(self.position)
                yield item
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()
            if own:
                self.consumed = None

    def iter_worker(self, worker: int, num_workers: int) -> Iterator[Batch]:
        """The items of worker ``worker`` of ``num_workers``, from ``self.position`` on.

        With ``batches_per_item == 1`` an item is one batch. Otherwise it is a *packed*
        item of ``n <= batches_per_item`` batches (see :func:`unpack`): the raw tokens
        ``[n, batch_size, seq_len + 1]`` in the store's dtype plus ``window_ids`` and
        ``epoch`` ``[n, batch_size]``. Raw tokens are 8x smaller than int64 inputs and
        labels, so a DataLoader moves a fraction of the bytes between processes, and the
        main process converts each batch in one cheap pass when it unpacks the item.
        """
        sizes: collections.deque[int] = collections.deque()
        batch = self.job.batch_size
        pending: list[tuple[Answer, int, int]] = []
        have = 0
        for answer in self._answers(worker, num_workers, sizes):
            at, count = 0, answer.request.count
            while at < count:  # cut the answer's batches at item boundaries
                take = min(count - at, sizes[0] - have)
                pending.append((answer, at, at + take))
                have, at = have + take, at + take
                if have == sizes[0]:
                    sizes.popleft()
                    if self.batches_per_item == 1:
                        c, b, _ = pending[0]
                        yield _batch(c, b, batch, self.boundary_eos, self.labels)
                    else:
                        yield _pack(pending, batch, self.boundary_eos, self.labels)
                    pending, have = [], 0

    def iter_answers(
        self, worker: int, num_workers: int, *, stop: threading.Event | None = None
    ) -> Iterator[Answer]:
        """The raw received answers of worker ``worker``; :func:`batches_of` converts one.

        For a consumer in this process (``TokenFeedLoader`` with ``num_workers=0``): one
        hand-over per answer (several batches) instead of one per batch keeps thread
        switches off the per-batch path, and converting each batch only when it is taken
        keeps the memory ahead of the consumer at raw-token size (1/4 of int64 inputs and
        labels). Items do not matter here (nothing crosses a process boundary). When
        ``stop`` is set, a wait for the server ends within a tenth of a second by raising
        :class:`tokenfeed.client.Stopped` (for a receiver thread that must end now).
        """
        return self._answers(worker, num_workers, None, stop)

    def _answers(
        self,
        worker: int,
        num_workers: int,
        sizes: collections.deque[int] | None,
        stop: threading.Event | None = None,
    ) -> Iterator[Answer]:
        """Received answers for this worker's steps; item sizes are appended to ``sizes``."""
        start = self.position
        if self.fingerprint is None and _several(self.endpoints):
            # Not pinned before the workers started (a DataLoader of the user's own): each
            # worker would pin the build of the replica it met first. Pin the common one.
            self._pin_build(stop)
        with self._client(worker, num_workers, stop=stop) as client:
            welcome = self._learn(client.hello())
            n_steps = self._steps_left(start, welcome.n_windows)

            def steps() -> Iterator[int]:
                # ramp: the first item is one batch, so the first batch is not held back
                # until a whole packed item has arrived
                k = self.batches_per_item
                for item in worker_steps(worker, num_workers, n_steps, k, ramp=k > 1):
                    if sizes is not None:
                        sizes.append(len(item))
                    yield from item

            itemsize = DTYPES[welcome.dtype].itemsize
            batch_bytes = self.job.batch_size * (self.job.seq_len + 1) * itemsize
            per_chunk = max(1, min(welcome.max_count, self.options.chunk_bytes // batch_bytes))
            yield from client.stream(pack_requests(steps(), start, self.global_batch, per_chunk))

    def _steps_left(self, start: int, n_windows: int) -> int | None:
        if self.epochs is not None:
            return steps_to_cover(start, self.epochs * n_windows, self.global_batch)
        if self.samples is not None:
            return steps_to_cover(start, self.samples, self.global_batch)
        return None

    def state_dict(self, position: int | None = None) -> dict[str, Any]:
        """The resume state: the consumed stream position, the plan inputs it is for and
        the dataset build (``fingerprint``; None if this dataset never connected).

        The position advances when the dataset is iterated in this process. Under your
        own DataLoader with worker processes it cannot see what was consumed: use
        :class:`~tokenfeed.TokenFeedLoader`, whose ``state_dict()`` counts batches as
        they reach the training loop.
        """
        return {
            "position": self.position if position is None else position,
            "dataset": self.job.dataset,
            "seq_len": self.job.seq_len,
            "seed": self.job.seed,
            "batch_size": self.job.batch_size,
            "world_size": self.job.world_size,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a saved position; batch_size and world_size may differ.

        The state's dataset build is pinned: reading resumes only from a server with the
        same build, else :class:`~tokenfeed.errors.DatasetChanged` says what changed. A
        state without a fingerprint (saved by an older tokenfeed) loads with a warning.
        """
        for key in ("dataset", "seq_len", "seed"):
            mine = getattr(self.job, key)
            if state_dict.get(key) != mine:
                raise ConfigError(
                    f"state was saved for {key}={state_dict.get(key)!r} but this dataset has "
                    f"{key}={mine!r}; resuming would not continue the same stream"
                )
        position = state_dict.get("position")
        if type(position) is not int or position < 0:
            raise ConfigError(f"state has no valid 'position': {position!r}")
        fingerprint = state_dict.get("fingerprint")
        if fingerprint is None:
            warnings.warn(
                "the loaded state carries no dataset fingerprint (saved by an older tokenfeed "
                "or before the first batch): resuming can not check that the server still "
                f"has the same build of {self.job.dataset!r}. Save a new state to get the check",
                stacklevel=2,
            )
        elif not isinstance(fingerprint, str) or not fingerprint:
            raise ConfigError(f"state has no valid 'fingerprint': {fingerprint!r}")
        self.position = position
        self.fingerprint = fingerprint


def _several(endpoints: Sequence[str]) -> bool:
    """More than one replica named or resolved now (a name may hide several)."""
    replicas = Replicas(endpoints)
    replicas.resolve()
    return replicas.several


def _distributed_defaults() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as exc:
        raise ConfigError(f"RANK/WORLD_SIZE must be integers: {exc}") from None


def _from_rows(
    rows: np.ndarray,
    window_ids: torch.Tensor,
    epochs: torch.Tensor,
    eos_id: int | None,
    labels: LabelMode,
) -> Batch:
    # The model wants contiguous int64 ids: convert straight from the received tokens, one
    # pass each for inputs and labels, and no other copy. Unshifted labels are a copy, not
    # the same tensor: masking labels in place (labels[...] = -100) must not edit inputs.
    input_ids = rows[:, :-1].astype(np.int64)
    targets = rows[:, 1:].astype(np.int64) if labels == "shifted" else input_ids.copy()
    batch = {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(targets),
        "window_ids": window_ids,
        "epoch": epochs,
    }
    if eos_id is not None:
        position_ids, cu_seqlens = document_fields(input_ids, eos_id)
        batch["position_ids"] = torch.from_numpy(position_ids)
        batch["cu_seqlens"] = torch.from_numpy(cu_seqlens)
    return batch


def _batch(answer: Answer, b: int, batch_size: int, eos_id: int | None, labels: LabelMode) -> Batch:
    rows = slice(b * batch_size, (b + 1) * batch_size)
    return _from_rows(
        answer.tokens[rows],
        torch.from_numpy(answer.window_ids[rows].copy()),  # the received buffer is read-only
        torch.from_numpy(answer.epochs[rows].copy()),
        eos_id,
        labels,
    )


def batches_of(
    answer: Answer, batch_size: int, eos_id: int | None = None, labels: LabelMode = "shifted"
) -> Iterator[Batch]:
    """The batches of one received answer, converted one at a time as they are taken.

    With ``eos_id``, each batch also carries ``position_ids`` and ``cu_seqlens``
    (see :func:`tokenfeed.documents.document_fields`); ``labels`` as in
    :class:`TokenFeedDataset`.
    """
    return (_batch(answer, b, batch_size, eos_id, labels) for b in range(answer.request.count))


def _pack(
    pieces: list[tuple[Answer, int, int]],
    batch_size: int,
    eos_id: int | None,
    labels: LabelMode,
) -> Batch:
    # One copy of the raw rows into a fresh (writable, shareable) array per item.
    def rows(field: str) -> np.ndarray:
        parts = [getattr(c, field)[lo * batch_size : hi * batch_size] for c, lo, hi in pieces]
        return np.concatenate(parts) if len(parts) > 1 else parts[0].copy()

    tokens = rows("tokens")
    n = len(tokens) // batch_size
    item = {
        "tokens": torch.from_numpy(tokens.reshape(n, batch_size, -1)),
        "window_ids": torch.from_numpy(rows("window_ids").reshape(n, batch_size)),
        "epoch": torch.from_numpy(rows("epochs").reshape(n, batch_size)),
    }
    if eos_id is not None:  # boundaries are computed where the item is unpacked
        item["eos_id"] = torch.tensor(eos_id)
    if labels == "unshifted":  # so is the label mode: the item says which one it wants
        item[_UNSHIFTED] = torch.tensor(True)
    return item


# Marks a packed item whose batches want unshifted labels (absent: shifted, as before).
_UNSHIFTED = "unshifted_labels"


def unpack(item: Batch) -> list[Batch]:
    """The batches of one packed item (``batches_per_item > 1``), as the model wants them.

    ``TokenFeedLoader`` calls this for you; call it yourself only if you put a
    ``TokenFeedDataset`` with ``batches_per_item > 1`` into your own DataLoader.
    """
    tokens = item["tokens"].numpy()
    eos_id = int(item["eos_id"]) if "eos_id" in item else None
    labels: LabelMode = "unshifted" if _UNSHIFTED in item else "shifted"
    return [
        _from_rows(tokens[i], item["window_ids"][i], item["epoch"][i], eos_id, labels)
        for i in range(tokens.shape[0])
    ]


def _batches_in(item: Batch, batches_per_item: int) -> int:
    return 1 if batches_per_item == 1 else int(item["tokens"].shape[0])
