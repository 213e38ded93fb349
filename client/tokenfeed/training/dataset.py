"""The torch ``IterableDataset`` that runs in every DataLoader worker.

Each worker works out which local steps are its own from ``get_worker_info()`` and the
plan (worker ``w`` of ``K`` produces local steps ``w, w+K, ...``, the order in which the
DataLoader takes batches round-robin from its workers), asks the server for exactly
those, and yields them as batches. No ``worker_init_fn``, no sharding by hand: the
DataLoader's output is the rank's local steps ``0, 1, 2, ...`` in order, every window of
every epoch exactly once.

The dataset object holds plain settings only: it pickles (spawn and forkserver work) and
opens its socket lazily in ``__iter__``, after the worker process exists.

A mixture (:class:`~tokenfeed.mixture.Mixture`, or a mapping of dataset name to weight)
is one job on the server, one global stream like a single dataset's: ranks, workers,
``state_dict()`` and resuming are the same, and every batch also carries ``source``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from tokenfeed.errors import ConfigError, TokenFeedError
from tokenfeed.mixture import Mixture
from tokenfeed.plan import steps_to_cover, worker_steps
from tokenfeed.protocol import DTYPES, Welcome
from tokenfeed.training import resume
from tokenfeed.training.batches import Batch, LabelMode, batch_at, batches_in, batches_of, pack
from tokenfeed.training.config import DatasetArg, DatasetConfig, ShuffleMode
from tokenfeed.training.consumed import ConsumedCounter
from tokenfeed.transport.answer import Answer
from tokenfeed.transport.client import FeedClient
from tokenfeed.transport.replicas import Replicas
from tokenfeed.window import Request, pack_requests

__all__ = ["TokenFeedDataset"]

log = logging.getLogger("tokenfeed")


class TokenFeedDataset(IterableDataset[Batch]):
    """Whole batches of one rank from a tokenfeed server; use with ``batch_size=None``.

    Each batch is a dict of ``input_ids`` and ``labels`` (int64 ``[batch_size, seq_len]``;
    see ``labels``), ``window_ids`` (int64 ``[batch_size]``, the global window index of
    each row) and ``epoch`` (int64 ``[batch_size]``). A mixture's batches also carry
    ``source`` (int64 ``[batch_size]``: the index of each row's dataset in
    ``self.mixture.names``); there ``window_ids`` and ``epoch`` are the row's window and
    epoch *in its own source*.

    Args:
        endpoint: the server's data endpoint, e.g. ``tcp://127.0.0.1:7400``; or several
            replicas over the same store: a list, a comma-separated string, or a host
            name with several addresses. Workers start spread over them and move to the
            next one when theirs stops answering (see :mod:`tokenfeed.transport.replicas`).
        dataset: dataset name in the server's store; or a mixture of datasets: a mapping
            of name to weight (``{"web": 7, "code": 2, "math": 1}``), a schedule of
            ``(start position, weights)`` segments, or a :class:`~tokenfeed.Mixture`
            (see :mod:`tokenfeed.mixture`). Every source walks its own shuffled plan.
        seq_len, batch_size, seed: the plan inputs (batch_size is per rank).
        rank, world_size: default from ``torch.distributed`` if initialised, else the
            ``RANK``/``WORLD_SIZE`` environment variables, else 0 and 1.
        epochs, samples: end the stream once this many epochs (or stream positions) are
            covered; every rank stops at the same step. Default: endless. A mixture
            takes ``samples`` only: its sources run through their epochs at their own
            rates, so a mixture has no epoch of its own.
        token: the tenant's token (default: the ``TOKENFEED_TOKEN`` environment variable).
        server_public_key, client_secret_key: the server's CURVE public key, to encrypt
            the connection, and this tenant's key from the operator (or TOKENFEED_CLIENT_KEY).
        window: requests in flight per worker; chunk_bytes: about how much data one
            request asks for (several batches per message); request_timeout, deadline: see
            :class:`tokenfeed.transport.client.FeedClient`.
        batches_per_item: batches per DataLoader item; more per item means less
            inter-process overhead per batch. Items of several batches are packed raw
            tokens: :class:`~tokenfeed.TokenFeedLoader` unpacks them (or call
            :func:`unpack` in your own loop). Default: one batch per item, except that
            ``TokenFeedLoader`` with worker processes packs about 2 MiB (at most 64).
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
        shuffle: ``"global"`` (default): every epoch a permutation of all windows.
            ``"block"``: every epoch the dataset's regions (``region_windows``
            consecutive windows each) in a new order, ``block_regions`` regions at a
            time, windows shuffled across each block; every window still exactly once
            per epoch. For datasets larger than the server's cache (object storage): the
            server reads ahead one block at a time.
        region_windows, block_regions: the block shuffle's sizes; None (default): the
            server derives them from the dataset's shards (a region about a shard), and
            :attr:`block_sizes` says which it used. Part of the resume state: a state
            loads only with the same shuffle and sizes.
        run: this launch's run id, which gives it a server job of its own (two runs of
            the same inputs are two jobs). Default: ``TOKENFEED_RUN_ID``, else rank 0's
            id broadcast over ``torch.distributed`` if initialised, else torchrun's
            rendezvous id, else a fresh one (one rank); see
            :func:`~tokenfeed.training.config.launch_run_id`. Saved in the resume state:
            a resumed run re-attaches to its own job.
        allow_read_amplification: accept a global shuffle of a dataset in object storage
            whose server cache cannot hold it (refused otherwise, with the bytes it
            would fetch per byte served; ``shuffle="block"`` is the usual fix).
    """

    def __init__(
        self,
        endpoint: str | Sequence[str],
        dataset: DatasetArg,
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
        client_secret_key: str | None = None,
        window: int = 4,
        chunk_bytes: int = 4 << 20,
        request_timeout: float = 10.0,
        deadline: float = 120.0,
        batches_per_item: int | None = None,
        document_boundaries: bool = False,
        labels: LabelMode = "shifted",
        shuffle: ShuffleMode = "global",
        region_windows: int | None = None,
        block_regions: int | None = None,
        run: str | None = None,
        allow_read_amplification: bool = False,
    ) -> None:
        super().__init__()
        config = DatasetConfig(
            endpoint,
            dataset,
            seq_len=seq_len,
            batch_size=batch_size,
            seed=seed,
            rank=rank,
            world_size=world_size,
            epochs=epochs,
            samples=samples,
            token=token,
            server_public_key=server_public_key,
            client_secret_key=client_secret_key,
            window=window,
            chunk_bytes=chunk_bytes,
            request_timeout=request_timeout,
            deadline=deadline,
            batches_per_item=batches_per_item,
            document_boundaries=document_boundaries,
            labels=labels,
            shuffle=shuffle,
            region_windows=region_windows,
            block_regions=block_regions,
            run=run,
            allow_read_amplification=allow_read_amplification,
        )
        self._adopt(config)

    def _adopt(self, config: DatasetConfig) -> None:
        """Take the checked settings; the rest is learnt from the server or a state."""
        self.rank, self.world_size = config.placement
        #: the mixture read (None: one dataset); ``source`` indexes its ``names``
        self.mixture: Mixture | None = config.mixture
        #: the endpoints, checked (one, or several replicas)
        self.endpoints = config.endpoints
        self.job = config.job
        self.epochs = config.epochs
        self.samples = config.samples
        self.batches_per_item = config.batches_per_item or 1
        #: True when the caller left batches_per_item to the loader
        self.auto_batches_per_item = config.batches_per_item is None
        self.options = config.options
        #: stream position (global samples consumed) that the next ``iter()`` starts at
        self.position = 0
        self.n_windows: int | None = None
        self.document_boundaries = config.document_boundaries
        self.labels: LabelMode = config.labels
        #: the dataset's EOS id, known once connected
        self.eos_id: int | None = None
        #: the dataset build this reads: from a loaded state, else the first welcome (for
        #: a mixture the combined build of the first welcome, for information: a mixture
        #: is pinned per source, in ``source_fingerprints``)
        self.fingerprint: str | None = None
        #: a mixture's build per source name: from a loaded state, else the first welcome
        self.source_fingerprints: dict[str, str] = {}
        #: ``(region_windows, block_regions)`` per dataset name as the server uses them
        #: (block shuffle only; known once connected, or from the arguments)
        self.block_sizes: dict[str, tuple[int, int]] = (
            dict.fromkeys(self.names, config.block_sizes) if min(config.block_sizes) >= 1 else {}
        )
        # block sizes a loaded state requires (checked against every welcome)
        self._required_block_sizes: dict[str, tuple[int, int]] = {}
        #: the training loop's consumed position, told to the server on every get and
        #: bye; set while iterated directly or by TokenFeedLoader (None: not known)
        self.consumed: ConsumedCounter | None = None
        #: stream ranges skipped on purpose at a resume: ``[(position, samples)]``
        self.skipped: list[tuple[int, int]] = []

    @property
    def names(self) -> tuple[str, ...]:
        """The dataset names read: the one dataset, or the mixture's sources in order."""
        return self.job.sources if self.mixture is not None else (self.job.dataset,)

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

    def _pinned(self) -> bool:
        """True when the build of every dataset read is known (from a state or a welcome)."""
        if self.mixture is not None:
            return all(name in self.source_fingerprints for name in self.job.sources)
        return self.fingerprint is not None

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
            # a hello-only connection (slot 0: the pin, the progress report) takes no ring
            options=dataclasses.replace(self.options, shared_memory=False)
            if slot == 0
            else self.options,
            fingerprint=self.fingerprint,
            source_fingerprints=self.source_fingerprints,
            consumed=self._take_consumed,
            stop=stop,
            skipped=self.skipped,
        )

    def read_at(self, position: int, count: int = 1, *, run: str | None = None) -> Answer:
        """This rank's rows of the ``count`` global batches at stream ``position``, read
        once over a connection of their own; the dataset's position does not move.

        For a look at what a step saw (after a loss spike): the rows come from the
        dataset build this dataset is pinned to (a loaded state's), with their window
        ids, epochs and, for a mixture, sources. ``run`` is the job to read as; by default
        a fresh one, so that the look never touches a running job's counters.
        """
        if type(position) is not int or position < 0 or type(count) is not int or count < 1:
            raise ConfigError(f"need position >= 0 and count >= 1, got {position}, {count}")
        job = dataclasses.replace(self.job, run=run or f"look-{uuid.uuid4().hex[:16]}")
        with FeedClient(
            self.endpoints,
            job,
            rank=self.rank,
            worker=0,
            slot=0,
            options=self.options,
            fingerprint=self.fingerprint,
            source_fingerprints=self.source_fingerprints,
        ) as client:
            self._learn(client.hello())
            return next(iter(client.stream([Request(position, count)])))

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
        if self.mixture is not None:
            self.source_fingerprints.update(
                zip(self.job.sources, welcome.source_fingerprints, strict=True)
            )
        if self.job.shuffle == "block":
            used = resume.welcome_block_sizes(welcome, self.names)
            resume.check_required_block_sizes(used, self._required_block_sizes)
            self.block_sizes = used
        return welcome

    #: in a DataLoader worker: where this worker is (see :meth:`state_dict`)
    _worker_progress: _WorkerProgress | None = None

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        if info is None:
            return self._counting(self.iter_worker(0, 1))
        # A worker's copy counts its own items: torchdata's StatefulDataLoader saves every
        # worker's state_dict() as the worker's items are taken, and resumes each worker
        # from its own; without the count every worker would restart at the same place.
        progress = self._worker_progress = _WorkerProgress(info.id, info.num_workers, self.position)
        return _tallied(self.iter_worker(info.id, info.num_workers), progress)

    def _counting(self, items: Iterator[Batch]) -> Iterator[Batch]:
        # Iterated directly (no DataLoader): keep our own consumed position, and let the
        # client tell it to the server (its last word, the bye, comes from items.close()).
        own = self.consumed is None
        if self.consumed is None:
            self.consumed = ConsumedCounter(self.position)
        counter = self.consumed
        try:
            for item in items:
                self.position += self.global_batch * batches_in(item, self.batches_per_item)
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
        ``epoch`` (and a mixture's ``source``) ``[n, batch_size]``. Raw tokens are 8x
        smaller than int64 inputs and labels, so a DataLoader moves a fraction of the bytes
        between processes, and the main process converts each batch in one cheap pass when
        it unpacks the item.
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
                        yield batch_at(c, b, batch, self.boundary_eos, self.labels)
                    else:
                        yield pack(pending, batch, self.boundary_eos, self.labels)
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
        :class:`tokenfeed.transport.client.Stopped` (for a receiver thread that must end now).
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
        if not self._pinned() and _several(self.endpoints):
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
            requests = pack_requests(steps(), start, self.global_batch, per_chunk)
            for answer in client.stream(requests):
                if self.consumed is not None:  # the loader totals its workers' failovers
                    self.consumed.note_failovers(worker, client.replicas.failovers)
                yield answer

    def _steps_left(self, start: int, n_windows: int) -> int | None:
        if self.epochs is not None:
            return steps_to_cover(start, self.epochs * n_windows, self.global_batch)
        if self.samples is not None:
            return steps_to_cover(start, self.samples, self.global_batch)
        return None

    def state_dict(self, position: int | None = None) -> dict[str, Any]:
        """The resume state: the consumed stream position, the plan inputs it is for, the
        order (``shuffle``, ``block_sizes``: ``{name: [region_windows, block_regions]}``)
        and the build of what it reads: ``fingerprint`` for one dataset (None if this
        dataset never connected); for a mixture its ``schedule``
        (:meth:`Mixture.to_state <tokenfeed.mixture.Mixture.to_state>`) and
        ``fingerprints``, the build of each source. Plain JSON-friendly values.

        The position advances when the dataset is iterated in this process. Under your
        own DataLoader with worker processes it cannot see what was consumed: use
        :class:`~tokenfeed.TokenFeedLoader`, whose ``state_dict()`` counts batches as
        they reach the training loop. Inside a worker process the state is that worker's
        (torchdata's ``StatefulDataLoader`` saves one per worker): ``worker`` is
        ``{"id", "num_workers", "items"}``, the items it has yielded since ``position``;
        such a state loads only into the same worker of as many workers.
        """
        state: dict[str, Any] = {
            "position": self.position if position is None else position,
            "seq_len": self.job.seq_len,
            "seed": self.job.seed,
            "batch_size": self.job.batch_size,
            "world_size": self.job.world_size,
            "shuffle": self.job.shuffle,
            "block_sizes": {name: list(sizes) for name, sizes in self.block_sizes.items()},
            "run": self.job.run,
        }
        if self.skipped:
            state["skipped"] = [list(r) for r in self.skipped]
        if self.mixture is None:
            state["dataset"] = self.job.dataset
            state["fingerprint"] = self.fingerprint
        else:
            state["schedule"] = self.mixture.to_state()
            state["fingerprints"] = dict(self.source_fingerprints)
        progress = self._worker_progress
        if progress is not None and position is None:
            state["position"] = progress.start
            state["worker"] = dataclasses.asdict(progress)
            del state["worker"]["start"]  # it is the state's position
        return state

    def load_state_dict(self, state_dict: dict[str, Any], *, skip_batches: int = 0) -> None:
        """Continue from a saved position; batch_size, world_size and the number of
        workers may differ: the global stream continues identically.

        ``skip_batches`` (after a loss spike) leaves out the next that many global
        batches of the stream, exactly: everything else is still read once. The skipped
        range is recorded in :meth:`state_dict` (``skipped``: ``[position, samples]``
        pairs, kept across later resumes), so which steps saw what stays known.

        The state's dataset builds are pinned: reading resumes only from a server with the
        same builds, else :class:`~tokenfeed.errors.DatasetChanged` says what changed (for
        a mixture: which source). A state without a fingerprint (saved by an older
        tokenfeed) loads with a warning. The shuffle mode and block sizes must be the
        state's. A mixture's schedule may differ from the state's after the saved position
        (a new or changed later segment: an anneal decided now), never before it.
        """
        position = resume.check_plan(state_dict, self.job)
        skipped = resume.check_skipped(state_dict)
        if "worker" in state_dict:  # one DataLoader worker's state (StatefulDataLoader)
            if skip_batches:
                raise ConfigError(
                    "skip_batches needs the whole rank's state: a StatefulDataLoader saves "
                    "one per worker; checkpoint with TokenFeedLoader to skip batches"
                )
            position = self._worker_resume(state_dict["worker"], position)
        if type(skip_batches) is not int or skip_batches < 0:
            raise ConfigError(f"skip_batches must be an integer >= 0, got {skip_batches!r}")
        if skip_batches:
            skipped.append((position, skip_batches * self.global_batch))
        required = resume.check_block_sizes(state_dict.get("block_sizes", {}), self.job)
        if self.mixture is None:
            fingerprint = resume.check_dataset(state_dict, self.job)
        else:
            fingerprints = resume.check_mixture(state_dict, position, self.mixture)
        run = resume.check_run(state_dict)
        # Everything checked: only now change this dataset.
        self.position = position + (skip_batches * self.global_batch)
        self.skipped = skipped
        if run is not None:  # the saved run's job, not this launch's new one
            self.job = dataclasses.replace(self.job, run=run)
        self._required_block_sizes = required
        self.block_sizes.update(required)
        if self.mixture is None:
            self.fingerprint = fingerprint
            if self.job.dataset in required:
                # Hand the sizes back to the server: the order can not change under the run.
                r, b = required[self.job.dataset]
                self.job = dataclasses.replace(self.job, region_windows=r, block_regions=b)
        else:
            self.fingerprint = None
            self.source_fingerprints = {
                name: fp for name, fp in fingerprints.items() if name in self.job.sources
            }

    def _worker_resume(self, saved: Any, start: int) -> int:
        """The position this worker resumes at, from its saved progress since ``start``."""
        info = get_worker_info()
        if not isinstance(saved, dict) or not all(
            type(saved.get(k)) is int for k in ("id", "num_workers", "items")
        ):
            raise ConfigError(f"state has no valid 'worker': {saved!r}")
        w, k, items = int(saved["id"]), int(saved["num_workers"]), int(saved["items"])
        if info is None or (info.id, info.num_workers) != (w, k):
            here = "the main process" if info is None else f"worker {info.id} of {info.num_workers}"
            raise ConfigError(
                f"this state is DataLoader worker {w} of {k}'s (torchdata's StatefulDataLoader "
                f"saves one per worker), loaded in {here}: resume it with a StatefulDataLoader "
                f"of num_workers={k}, or checkpoint with TokenFeedLoader, whose state is the "
                "whole rank's and resumes with any num_workers"
            )
        if items and self.batches_per_item > 1:
            raise ConfigError(
                f"batches_per_item={self.batches_per_item}: a worker's packed items can not be "
                "resumed from its count; use batches_per_item=1 with StatefulDataLoader, or "
                "TokenFeedLoader (which packs and resumes exactly)"
            )
        # Worker w of k yields local steps w, w+k, ... from start: after ``items`` of them it
        # yields the same steps as worker w of k from ``items * k`` steps further on.
        return start + items * k * self.global_batch


@dataclasses.dataclass
class _WorkerProgress:
    """One DataLoader worker's place: its index, and the items it yielded from ``start``."""

    id: int
    num_workers: int
    start: int
    items: int = 0


def _tallied(items: Iterator[Batch], progress: _WorkerProgress) -> Iterator[Batch]:
    """``items``, counted in ``progress`` as each is handed over (so a state taken right
    after an item counts it)."""
    try:
        for item in items:
            progress.items += 1
            yield item
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()


def _several(endpoints: Sequence[str]) -> bool:
    """More than one replica named or resolved now (a name may hide several)."""
    replicas = Replicas(endpoints)
    replicas.resolve()
    return replicas.several
