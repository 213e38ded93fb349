"""What one job reads: one dataset, or a mixture of several (issue 13), and its rows.

A job's :class:`Feed` holds one :class:`Source` per dataset it reads (a single-dataset
job has exactly one): the open :class:`~tokenfeed_server.store.reader.Dataset` and the
source's own :class:`~tokenfeed.plan.Plan`. A mixture adds its
:class:`~tokenfeed.mixture.Mixture`, which maps every global stream position to a source
and to that source's own stream position; the source's plan then maps that position to
a window and a source-local epoch exactly as for a job of that dataset alone (seeded by
:func:`~tokenfeed.mixture.source_seed`, so a source's order depends on its name and the
job's seed, never on its index).

Serving stays a pure function of the request: :meth:`Feed.assemble` computes a
request's rows from (rank, position, count, stride) alone, so any server instance
answers a re-sent request with the same rows.

:func:`open_feed` builds a feed from a ``hello`` and the datasets it names, with the
checks a mixture needs: every source the expected build, one tokenizer for all, a valid
schedule, block sizes derived per source when the hello leaves them at 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from tokenfeed import protocol
from tokenfeed.errors import ConfigError, DatasetChanged, PlanError, RequestRejected
from tokenfeed.mixture import MAX_PERIOD, Mixture, source_seed
from tokenfeed.plan import Plan, default_block_sizes
from tokenfeed_server.store.mixed_gather import MixedGather
from tokenfeed_server.store.mixture_tables import (
    FirstBlock,
    SharedMixtures,
    shared_mixtures,
    table_bytes,
    table_rows,
)
from tokenfeed_server.store.reader import Dataset
from tokenfeed_server.store.serving import assemble, row_buffers, window_blocks

__all__ = [
    "INLINE_BLOCK_SOURCES",
    "MAX_LABEL",
    "MAX_TABLE_ROWS",
    "Feed",
    "JobFirstBlock",
    "SharedMixtures",
    "Source",
    "open_feed",
    "shared_mixtures",
    "table_bytes",
]

IntArray = npt.NDArray[np.int64]

#: Most period-table rows one mixture may need (distinct weight vectors' periods summed):
#: the tables are built off the data plane's thread and kept while a job reads the
#: mixture (shared by the jobs of one mixture: :class:`SharedMixtures`), 16 bytes a row,
#: so a hello cannot make the server spend seconds and gigabytes on one schedule. Four
#: segments of the largest period fit.
MAX_TABLE_ROWS = 4 * MAX_PERIOD
#: A mixture's :attr:`Feed.label` is cut near this many characters (it is a metric label).
MAX_LABEL = 200
#: A new job of a mixture of more sources than this has its first block of order computed
#: off the data plane's loop before it is admitted (:meth:`Feed.first_block`): a block runs
#: 8,192 positions through every source's plan, about 0.25 ms a source here, so a few
#: sources' block costs less than the retry the client makes meanwhile.
INLINE_BLOCK_SOURCES = 8


@dataclass(frozen=True)
class Source:
    """One dataset a job reads, with the job's plan over it."""

    name: str
    dataset: Dataset
    plan: Plan


@dataclass(frozen=True, eq=False)
class Feed:
    """The datasets one job reads and how its stream maps onto them.

    ``mixture`` is None for a single-dataset job (then ``sources`` has one entry and the
    job's stream is that source's plan); else ``sources`` follow ``mixture.names``.
    """

    sources: tuple[Source, ...]
    mixture: Mixture | None = None
    #: a closed job's figures (see :meth:`closed_feed`), None while a job reads the feed
    closed: Closed | None = field(default=None, repr=False)

    @property
    def is_mixture(self) -> bool:
        """True when the job reads a mixture of datasets."""
        return self.mixture is not None

    @property
    def names(self) -> tuple[str, ...]:
        """The sources' dataset names (a mixture's in ``Mixture.names`` order)."""
        return tuple(s.name for s in self.sources)

    @cached_property
    def label(self) -> str:
        """A human name for logs, errors and metric labels: the dataset, or a mixture's
        joined by ``+`` (never a dataset name: ``+`` is not allowed in one), cut to about
        :data:`MAX_LABEL` characters with the number of sources left out."""
        label = "+".join(self.names)
        if len(label) <= MAX_LABEL:
            return label
        shown: list[str] = []
        for name in self.names:
            if len("+".join([*shown, name])) > MAX_LABEL - 16:
                break
            shown.append(name)
        return "+".join(shown) + f"+...({len(self.names) - len(shown)} more)"

    @cached_property
    def fingerprint(self) -> str:
        """The build: the dataset's fingerprint, or a mixture's
        :func:`~tokenfeed.protocol.mixture_fingerprint` of its sources'."""
        if self.mixture is None:
            return self.sources[0].dataset.fingerprint
        return protocol.mixture_fingerprint([s.dataset.fingerprint for s in self.sources])

    @property
    def first(self) -> Source:
        """The first source (a single-dataset job's only one)."""
        return self.sources[0]

    @property
    def n_tokens(self) -> int:
        """Tokens of all sources together."""
        return sum(s.dataset.n_tokens for s in self.sources)

    @property
    def n_windows(self) -> int:
        """Windows of one epoch of every source together (a mixture's nominal epoch)."""
        return sum(s.plan.n_windows for s in self.sources)

    @property
    def global_batch(self) -> int:
        """Stream positions per global step (the same in every source's plan)."""
        return self.first.plan.global_batch

    def source_positions(self, position: int) -> list[int]:
        """Each source's own stream position at stream ``position``: the rows it got in
        ``[0, position)`` (what to hand its plan, e.g. for ``Plan.block_spans``)."""
        if self.mixture is None:
            return [position]
        if self.closed is not None and position == self.closed.position:
            return list(self.closed.counts)
        return self._tables().counts(position)

    def closed_feed(self, position: int, consumed: int) -> Feed:
        """This feed for a job whose last connection left, at its served ``position``
        and ``consumed`` position: what ``/v1/jobs`` and the prefetch ask of it is
        computed now, and its mixture is an equal object of its own without tables, so
        the shared tables go with the last running job that reads them (a closed job
        keeps its record, not its memory). The admission gives a job that is attached
        again a fresh feed."""
        if self.mixture is None or self.closed is not None:
            return self
        closed = Closed(
            position, consumed, self.describe(position, consumed), self.source_positions(position)
        )
        bare = Mixture.from_wire(self.mixture.names, self.mixture.to_wire())
        return Feed(self.sources, bare, closed)

    def _tables(self) -> Mixture:
        """The mixture, its tables built: they are built before a job reads them
        (:meth:`SharedMixtures.ready`); a mixture used before that builds them here,
        counted as ``mixture_table_builds_inline``."""
        assert self.mixture is not None
        if not self.mixture.tables_built:
            shared_mixtures.note_build(self.mixture)
        return self.mixture

    def describe(self, position: int, consumed: int) -> dict[str, Any]:
        """What /v1/jobs shows of the feed at served ``position`` and ``consumed``
        position (-1: none reported): its kind and shuffle, and for a mixture its sources,
        schedule, the weights in effect at ``position`` and per source the rows served and
        consumed and the source-local epochs."""
        first = self.first.plan
        view: dict[str, Any] = {
            "kind": "dataset" if self.mixture is None else "mixture",
            "shuffle": first.shuffle,
            "region_windows": 0 if self.mixture else first.region_windows,
            "block_regions": 0 if self.mixture else first.block_regions,
            "sources": None,
            "schedule": None,
            "current_weights": None,
            "source_progress": None,
        }
        if self.mixture is None:
            return view
        if self.closed is not None and (position, consumed) == self.closed.at:
            return self.closed.view
        served = self._tables().counts(position)
        taken = self.mixture.counts(consumed) if consumed >= 0 else None
        view["sources"] = list(self.names)
        schedule = self.mixture.schedule
        view["schedule"] = [{"start": start, "weights": weights} for start, weights in schedule]
        view["current_weights"] = schedule[self.mixture.segment_at(position)][1]
        view["source_progress"] = [
            {
                "name": src.name,
                "fingerprint": src.dataset.fingerprint,
                "epoch_windows": src.plan.n_windows,
                "region_windows": src.plan.region_windows,
                "block_regions": src.plan.block_regions,
                "rows_served": served[s],
                "epoch": served[s] // src.plan.n_windows,
                "consumed_rows": taken[s] if taken is not None else None,
                "consumed_epoch": taken[s] // src.plan.n_windows if taken is not None else None,
            }
            for s, src in enumerate(self.sources)
        ]
        return view

    def chunk_shape(self, count: int) -> tuple[tuple[int, int], np.dtype[Any]]:
        """The shape and dtype of the tokens :meth:`assemble` returns for ``count`` batches."""
        src = self.first
        return (count * src.plan.batch_size, src.plan.seq_len + 1), src.dataset.dtype

    def assemble(
        self, rank: int, pos: int, *, count: int, stride: int, out: np.ndarray | None = None
    ) -> tuple[np.ndarray, dict[str, IntArray]]:
        """Rows of one request: tokens ``[count*B, L+1]`` and the named provenance rows
        (``window``, ``epoch``, and ``source`` for a mixture), ``[count*B]`` each.

        ``out``: where to read the tokens (of :meth:`chunk_shape`; e.g. a trainer's
        shared-memory ring), else a pooled buffer. A shard that cannot be read raises the
        reader's StoreError naming its dataset.
        """
        if self.mixture is None:
            src = self.first
            tokens, window_ids, epochs = assemble(
                src.dataset, src.plan, rank, pos, count=count, stride=stride, out=out
            )
            return tokens, {protocol.ROW_WINDOW: window_ids, protocol.ROW_EPOCH: epochs}
        return self._assemble_mixture(rank, pos, count=count, stride=stride, out=out)

    @cached_property
    def _order(self) -> MixedOrder:
        assert self.mixture is not None
        return MixedOrder(self.sources, self._tables())

    def first_block(self) -> FirstBlock | None:
        """What a new job of this feed reads first (block 0 of its order), for the
        builder to compute off the loop (see
        :meth:`~tokenfeed_server.store.mixture_tables.SharedMixtures.ready`); None for a
        single dataset or a mixture of at most :data:`INLINE_BLOCK_SOURCES` sources."""
        if self.mixture is None or len(self.sources) <= INLINE_BLOCK_SOURCES:
            return None
        # not self._order: that would build the tables here, on the asking thread
        return JobFirstBlock(MixedOrder(self.sources, self.mixture))

    @cached_property
    def _reader(self) -> MixedGather:
        """Reads a mixture's requests across its sources in one pass."""
        return MixedGather([src.dataset for src in self.sources])

    def _assemble_mixture(
        self, rank: int, pos: int, *, count: int, stride: int, out: np.ndarray | None
    ) -> tuple[np.ndarray, dict[str, IntArray]]:
        # Positions do not depend on a plan's dataset (only batch, world and stride), so
        # the first source's plan gives the request's stream positions for all.
        plan = self.first.plan
        positions = plan.rank_positions(rank, pos, count, stride)  # sorted, as blocks need
        which, window_ids, epochs, starts = window_blocks.windows(self._order, positions)
        length = plan.seq_len + 1
        out_rows = None
        if out is None:
            out, out_rows = row_buffers.take_rows(
                (positions.size, length), self.first.dataset.dtype
            )
        # Every source's rows straight into their places in the request's buffer, in one
        # pass over the request when the sources are local files (no per-source copy).
        self._reader.gather(which, starts, length, out=out, rows=out_rows)
        rows = {protocol.ROW_WINDOW: window_ids, protocol.ROW_EPOCH: epochs}
        return out, {**rows, protocol.ROW_SOURCE: which}


@dataclass(frozen=True)
class Closed:
    """What a closed job's feed answers without its mixture's tables: its
    :meth:`Feed.describe` at (``position``, ``consumed``) and each source's position at
    ``position`` (:meth:`Feed.source_positions`)."""

    position: int
    consumed: int
    view: dict[str, Any]
    counts: list[int]

    @property
    def at(self) -> tuple[int, int]:
        """``(position, consumed)``."""
        return self.position, self.consumed


class JobFirstBlock:
    """Block 0 of a mixture job's order in the shared
    :data:`~tokenfeed_server.store.serving.window_blocks` (a
    :class:`~tokenfeed_server.store.mixture_tables.FirstBlock`)."""

    def __init__(self, order: MixedOrder) -> None:
        self.order = order

    @property
    def key(self) -> tuple[object, int]:
        """The block's key in the cache."""
        return (self.order.order_key, 0)

    def cached(self) -> bool:
        """True when the cache holds the block now."""
        return window_blocks.cached(self.order, 0)

    def compute(self) -> None:
        """Compute the block into the cache (on the builder thread, tables built)."""
        window_blocks.fill(self.order, 0)


class MixedOrder:
    """A mixture's whole order as one pure function of the stream position, for the
    server's shared :class:`~tokenfeed_server.store.serving.WindowBlocks`: positions to
    ``(source, window id, epoch in the source, first token)`` per row. Computed a block
    of positions at a time and cached like a plan's windows, so a request costs slices of
    a block instead of a locate and a plan evaluation per source."""

    def __init__(self, sources: Sequence[Source], mixture: Mixture) -> None:
        self.sources = tuple(sources)
        self.mixture = mixture
        #: everything :meth:`windows` depends on (a source's seq_len sets its starts);
        #: the mixture's names and segments rather than the object, so that a cached
        #: block does not keep a finished job's period tables alive
        self.order_key = (
            "mixture",
            mixture.names,
            tuple(map(tuple, mixture.to_wire())),
            tuple((src.plan.order_key, src.plan.seq_len) for src in self.sources),
        )

    def note_block(self) -> None:
        """Count a block computed (on which thread: see :meth:`SharedMixtures.counters`)."""
        shared_mixtures.note_block()

    def windows(self, positions: IntArray) -> tuple[IntArray, ...]:
        """``(source, window_ids, epochs, token_starts)`` of sorted stream positions."""
        which, spos = self.mixture.locate(positions)
        n = len(positions)
        window_ids = np.empty(n, dtype=np.int64)
        epochs = np.empty(n, dtype=np.int64)
        starts = np.empty(n, dtype=np.int64)
        for s, src in enumerate(self.sources):
            picked = np.flatnonzero(which == s)
            if picked.size:
                # a source's positions are increasing: the count of its earlier rows
                ids, eps = src.plan.windows(spos[picked])
                window_ids[picked] = ids
                epochs[picked] = eps
                starts[picked] = src.plan.token_starts(ids)
        return which, window_ids, epochs, starts


# -- building a feed from a hello ---------------------------------------------------------


def open_feed(datasets: Sequence[Dataset], msg: protocol.Hello) -> Feed:
    """The feed of ``msg`` over ``datasets`` (the opened ``msg.sources``, or the one
    ``msg.dataset``), checked.

    Raises DatasetChanged naming a source that is not the build the hello expects,
    RequestRejected for sources of different tokenizers or a bad schedule, PlanError
    for plan inputs a source cannot take (naming the source).
    """
    names = msg.sources or (msg.dataset,)
    if len(datasets) != len(names):
        raise ValueError(f"{len(datasets)} datasets for sources {list(names)}")
    if msg.sources:
        expected = msg.fingerprints or ("",) * len(names)
        for name, ds, fp in zip(names, datasets, expected, strict=True):
            _check_build(ds, fp, f"mixture source {name!r}")
        _check_one_tokenizer(names, datasets)
        if msg.fingerprint:  # the whole build, as a welcome said it (a reconnect)
            whole = protocol.mixture_fingerprint([ds.fingerprint for ds in datasets])
            if msg.fingerprint != whole:
                raise DatasetChanged(
                    f"the mixture of {list(names)} on this server is build {whole}, but this "
                    f"job expects build {msg.fingerprint}: a source was rebuilt since. "
                    "Restore its build, or start over on purpose from a fresh state"
                )
        try:
            mix = Mixture.from_wire(names, msg.schedule)
        except ConfigError as exc:  # PlanError too: both are the client's input
            raise RequestRejected(f"bad mixture schedule: {exc}") from None
        rows = table_rows(mix)
        if rows > MAX_TABLE_ROWS:
            raise RequestRejected(
                f"bad mixture schedule: its distinct weight vectors have periods summing to "
                f"{rows} rows, over this server's {MAX_TABLE_ROWS}; use fewer distinct "
                "weightings or coarser weights (smaller integers after reduction)"
            )
        mixture: Mixture | None = mix
    else:
        _check_build(datasets[0], msg.fingerprint, f"dataset {msg.dataset!r}")
        mixture = None
    sources = []
    for name, ds in zip(names, datasets, strict=True):
        seed = source_seed(msg.seed, name) if mixture is not None else msg.seed
        try:
            plan = _plan(ds, msg, seed)
        except PlanError as exc:
            if mixture is None:
                raise
            raise PlanError(f"mixture source {name!r}: {exc}") from None
        sources.append(Source(name, ds, plan))
    if mixture is None:
        return Feed(tuple(sources))
    return shared_feed(tuple(sources), mixture)


def shared_feed(sources: tuple[Source, ...], mixture: Mixture) -> Feed:
    """A feed of ``sources`` reading the shared object equal to ``mixture`` (held while
    the feed lives: see :class:`SharedMixtures`)."""
    shared = shared_mixtures.hold(mixture)
    feed = Feed(sources, shared)
    shared_mixtures.release_with(feed, shared)
    return feed


def _plan(ds: Dataset, msg: protocol.Hello, seed: int) -> Plan:
    region_windows, block_regions = msg.region_windows, msg.block_regions
    if msg.shuffle == "block" and not (region_windows and block_regions):
        # Derived from the dataset alone (its shards and seq_len), never from this
        # server's cache, so every server derives the same order for the same build.
        shards = [shard.tokens for shard in ds.manifest.shards]
        derived = default_block_sizes(shards, msg.seq_len)
        region_windows = region_windows or derived[0]
        block_regions = block_regions or derived[1]
    return Plan(
        n_tokens=ds.n_tokens,
        seq_len=msg.seq_len,
        batch_size=msg.batch_size,
        world_size=msg.world_size,
        seed=seed,
        shuffle=msg.shuffle,
        region_windows=region_windows,
        block_regions=block_regions,
    )


def _check_build(ds: Dataset, expected: str, what: str) -> None:
    if expected and expected != ds.fingerprint:
        raise DatasetChanged(
            f"{what} on this server is build {ds.fingerprint}, but this job expects build "
            f"{expected} (it was rebuilt since, e.g. by prepare --overwrite): continuing "
            "would train on different data. Restore that build, or start over on purpose "
            "from a fresh state (no checkpointed loader state)"
        )


def _tokenizer_identity(ds: Dataset) -> dict[str, Any]:
    """What makes token ids mean the same text: (kind, vocabulary size, EOS id,
    tokenizer file hash), and the token dtype.

    The kind is compared only for tokenizers without a file (``byte``): a file names the
    tokenizer exactly, while its kind says how prepare got it, so a source prepared with
    ``--tokenizer`` pointing at another's ``tokenizer.json`` (kind ``hf:tokenizer.json``)
    matches the one that trained it (kind ``bpe:300``).
    """
    t = ds.manifest.tokenizer
    return {
        "kind": t.kind if t.file_hash is None else "(a tokenizer file)",
        "vocab_size": t.vocab_size,
        "eos_id": t.eos_id,
        "tokenizer file hash": t.file_hash,
        "dtype": ds.manifest.dtype,
    }


def _check_one_tokenizer(names: Sequence[str], datasets: Sequence[Dataset]) -> None:
    """Token ids mean the same text in every source, else RequestRejected naming two."""
    first = _tokenizer_identity(datasets[0])
    for name, ds in zip(names[1:], datasets[1:], strict=True):
        other = _tokenizer_identity(ds)
        differ = [f"{k} {first[k]!r} vs {other[k]!r}" for k in first if first[k] != other[k]]
        if differ:
            raise RequestRejected(
                f"mixture sources {names[0]!r} and {name!r} were prepared with different "
                f"tokenizers ({'; '.join(differ)}): the same token id would mean different "
                "text. Prepare every source with one tokenizer, e.g. `tokenfeed-server "
                f"prepare ... --tokenizer` pointing at {names[0]!r}'s tokenizer.json"
            )
