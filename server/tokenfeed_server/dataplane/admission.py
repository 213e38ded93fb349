"""``hello``: authorize the tenant, check the limits, resolve (or create) the job the
inputs name, attach the connection, and say ``welcome`` with the job's shape.

Every refusal is a :class:`~tokenfeed.errors.ServerError` (its ``.code`` goes on the
wire) or a :class:`~tokenfeed.errors.ProtocolError` (``bad_request``); the loop answers
it (:mod:`tokenfeed_server.dataplane.plane`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from tokenfeed import protocol
from tokenfeed.errors import (
    ConnectionLimit,
    DatasetChanged,
    DatasetNotFound,
    InvalidDatasetName,
    ProtocolError,
    RequestRejected,
    ServerError,
    StorageUnavailable,
    StoreError,
    UnknownDataset,
)
from tokenfeed.protocol import JobSpec
from tokenfeed_server.config import ServerConfig
from tokenfeed_server.dataplane.auth import Tenants
from tokenfeed_server.dataplane.cache_fit import check_remote_cache, remote_rows
from tokenfeed_server.dataplane.jobs import Job, job_id
from tokenfeed_server.dataplane.registry import Registry
from tokenfeed_server.dataplane.rings import Rings
from tokenfeed_server.logbudget import LogBudget
from tokenfeed_server.store import Dataset, Store, wire_error
from tokenfeed_server.store.mixing import Feed, open_feed
from tokenfeed_server.store.mixture_tables import shared_mixtures, table_rows
from tokenfeed_server.store.pinned import VersionGone, VersionOpening

__all__ = ["Admission"]

log = logging.getLogger(__name__)

_MAX_ROWS_PER_CHUNK = 8192  # rows are gathered one by one: bound the work of one request
_MAX_WORKER = 1 << 16


class Admission:
    """Answers ``hello`` for the loop: everything but the socket."""

    def __init__(
        self,
        config: ServerConfig,
        store: Store,
        registry: Registry,
        *,
        tenants: Tenants | None,
        instance: str,
        log_budget: LogBudget,
        rings: Rings | None = None,
    ) -> None:
        self.config = config
        self.rings = rings
        self.store = store
        self.registry = registry
        self.tenants = tenants
        self.instance = instance
        self._log_budget = log_budget

    def hello(self, ident: bytes, tenant: str, msg: protocol.Hello) -> protocol.Welcome:
        """Admit connection ``ident`` of ``tenant`` to the job ``msg`` names."""
        window = self._authorize(ident, tenant, msg)
        job, feed = self._resolve_job(tenant, msg)
        if msg.skipped:  # a resumed run's skipped ranges (every client sends the same)
            job.skipped = msg.skipped
        self.registry.register_peer(ident, tenant, msg, job, window)
        if job.feed.closed is not None:  # it closed (now or before): it reads again
            job.feed = feed
        welcome = _welcome(job, server=self.instance, window=window)
        if msg.ring and self.rings is not None:  # a trainer on this host: offer a ring
            door, key = self.rings.offer(ident, msg.client)
            welcome = dataclasses.replace(welcome, ring_door=door, ring_key=key)
        return welcome

    def _authorize(self, ident: bytes, tenant: str, msg: protocol.Hello) -> int:
        """Check the tenant may read the dataset, the request fits the limits, and a
        connection slot is free; return the granted credit window."""
        limits = self.config.limits
        if self.tenants is not None:
            for name in msg.sources or (msg.dataset,):
                denied = self.tenants.authorize(tenant, name)
                if denied is not None:
                    if msg.sources:  # say which source of the mixture is not allowed
                        message = f"mixture source {name!r}: {denied}"
                        raise ServerError.from_code(denied.code, message, retry=denied.retry)
                    raise denied
        if msg.window < 1:
            raise ProtocolError(f"window must be >= 1, got {msg.window}")
        if msg.batch_size * (msg.seq_len + 1) > limits.max_batch_tokens:
            raise RequestRejected(
                f"a batch of {msg.batch_size} x {msg.seq_len + 1} tokens exceeds "
                f"max_batch_tokens={limits.max_batch_tokens}; lower batch_size or seq_len",
            )
        if not 0 <= msg.rank < msg.world_size:
            raise ProtocolError(f"rank {msg.rank} is outside [0, world_size={msg.world_size})")
        if not 0 <= msg.worker < _MAX_WORKER:
            raise ProtocolError(f"worker {msg.worker} is outside [0, {_MAX_WORKER})")
        self.registry.replace_reconnected(tenant, msg.client, ident)
        if ident not in self.registry.peers:
            self._check_connection_caps(tenant)
        # The credit window is negotiated: the server grants at most its max_window.
        return min(msg.window, limits.max_window)

    def _check_connection_caps(self, tenant: str) -> None:
        limits = self.config.limits
        if len(self.registry.peers) >= limits.max_connections:
            raise ConnectionLimit(
                f"the server has max_connections={limits.max_connections} attached; "
                "try again later or ask the operator to raise the limit",
            )
        mine = self.registry.tenant_connections(tenant)
        own = self.tenants.max_connections(tenant) if self.tenants is not None else None
        cap = own or limits.max_connections_per_tenant
        if mine >= cap:
            raise ConnectionLimit(
                f"tenant {tenant!r} already has {mine} connections (its cap is {cap}); "
                "use fewer DataLoader workers or ranks, or ask the operator for more",
            )

    def _resolve_job(self, tenant: str, msg: protocol.Hello) -> tuple[Job, Feed]:
        """The job these inputs name, created on first sight, and the feed the hello
        opened (its tables ready); its datasets from memory.

        The run id is one of the inputs: every launch is a job of its own, and a resumed
        run (its state carries the id) re-attaches to its own job.

        A mixture's hello names its sources: each is looked up and checked (build,
        tokenizer) and gets its own plan (see :func:`~tokenfeed_server.store.mixing.open_feed`).

        Each source is read in the version the hello pins (its fingerprint: from a
        checkpoint, or the welcome of an earlier connection), kept while the store keeps
        it, the current one when it pins none: a job reads the build it started on until
        it ends, whatever was published since, and its job id stays the same.
        """
        feed = open_feed(self._datasets(tenant, msg), msg)
        spec = _job_spec(msg, feed)
        jid = job_id(spec, feed, tenant)
        job = self.registry.jobs.get(jid)
        if job is not None:
            _tables_ready(feed, new=False)  # built unless the job closed and let them go
            if not self.registry.has_peers(jid):
                # Nobody attached: the trainer starts again (a restart from a checkpoint
                # joins the same job id), so its old consumed position says nothing. The
                # rate keeps its samples: it reads a fall as 0, and the loader's own
                # end-of-loop report (a hello of its own) must not zero a live rate.
                job.consumed = -1
            return job, feed
        max_count = _max_count(self.config, msg, feed)
        check_remote_cache(msg, feed)
        limits = self.config.limits
        own_cap = self.tenants.max_jobs(tenant) if self.tenants is not None else None
        self.registry.make_room_for_a_job(
            limits.max_jobs, tenant, own_cap or limits.max_jobs_per_tenant
        )
        _tables_ready(feed)  # after the caps: a refused job never builds tables
        weight = self.tenants.weight(tenant) if self.tenants is not None else 1.0
        job = Job(jid, spec, feed, tenant, weight=weight, max_count=max_count)
        self.registry.add_job(job)
        if self._log_budget.take():
            log.info("job %s: %s (tenant %s, run %s)", jid, spec, tenant, spec.run or "-")
        return job, feed

    def _datasets(self, tenant: str, msg: protocol.Hello) -> list[Dataset]:
        """The datasets the hello names, each in the version it pins: a mixture's as a
        whole. Every source is looked up before anything is refused, so one answer
        covers them all: the first source that cannot be served refuses the whole job,
        named, and sources still being opened (off the loop) are all asked for at once
        and refused retryably together, never one per round trip."""
        names = msg.sources or (msg.dataset,)
        # a mixture's hello pins each source (none: an older client's, or a new job)
        pins = tuple(msg.fingerprints) if msg.sources else (msg.fingerprint,)
        if not msg.sources:
            return [self._dataset(tenant, names[0], pins[0], False)]
        datasets: list[Dataset] = []
        opening: list[str] = []
        for i, name in enumerate(names):
            try:
                datasets.append(self._dataset(tenant, name, pins[i] if i < len(pins) else "", True))
            except StorageUnavailable as exc:
                if not exc.retry:
                    raise _whole(name, len(names), exc) from None
                opening.append(name)
            except ServerError as exc:
                raise _whole(name, len(names), exc) from None
        if opening:
            raise StorageUnavailable(
                f"mixture sources {opening} (of {len(names)}) are being opened or their "
                "storage does not answer yet; the job is admitted once all are: ask again "
                "shortly",
                retry=True,
            )
        return datasets

    def _dataset(self, tenant: str, name: str, fingerprint: str, source: bool) -> Dataset:
        """Version ``fingerprint`` of dataset ``name`` (``source``: of a mixture)."""
        try:
            return self.store.version(name, fingerprint)
        except VersionOpening as exc:  # opened off the loop: the client asks again
            raise StorageUnavailable(str(exc), retry=True) from None
        except VersionGone as exc:
            raise DatasetChanged(
                f"mixture source {name!r}: {exc}" if source else str(exc)
            ) from None
        except DatasetNotFound:
            # Name only what this tenant may read, and never the store's path.
            names = [
                n
                for n in self.store.names()
                if self.tenants is None or self.tenants.authorize(tenant, n) is None
            ]
            raise UnknownDataset(
                f"no dataset {name!r} on this server; available: {', '.join(names) or 'none'}",
            ) from None
        except InvalidDatasetName as exc:  # the client's mistake, not a damaged dataset
            raise ProtocolError(str(exc)) from None
        except StoreError as exc:
            if self._log_budget.take():
                log.error("dataset %s cannot be served: %s", name, exc)
            # The kind of fault (object storage down, an object missing or damaged) is
            # the store's to tell; the message never shows the store's path.
            raise wire_error(
                exc,
                f"dataset {name!r} is damaged on the server and cannot be served; "
                "the operator should check the server log and rebuild it",
            ) from None


def _whole(name: str, sources: int, exc: ServerError) -> ServerError:
    """``exc`` of mixture source ``name``, said as the refusal of the whole mixture."""
    message = str(exc)
    if not message.startswith("mixture source"):
        message = f"mixture source {name!r}: {message}"
    message += f" (the mixture of {sources} sources is not admitted: no source is read)"
    return ServerError.from_code(exc.code, message, retry=exc.retry, quiet=exc.quiet)


def _tables_ready(feed: Feed, *, new: bool = True) -> None:
    """Refuse retryably while ``feed``'s mixture tables (and a ``new`` job's first block
    of order) are built off the loop (see
    :meth:`~tokenfeed_server.store.mixture_tables.SharedMixtures.ready`)."""
    first = feed.first_block() if new else None
    if feed.mixture is not None and not shared_mixtures.ready(feed.mixture, first):
        raise ServerError(
            f"the tables of this mixture ({table_rows(feed.mixture)} rows) or its first "
            "block of order are being built for it; ask again shortly",
            retry=True,
            code="overloaded",
            quiet=True,
        )


def _job_spec(msg: protocol.Hello, feed: Feed) -> JobSpec:
    """The job's key inputs: the hello's, with a mixture's schedule as the feed reduced it."""
    schedule = feed.mixture.to_wire() if feed.mixture is not None else ()
    return JobSpec(
        msg.dataset,
        msg.seq_len,
        msg.batch_size,
        msg.seed,
        msg.world_size,
        sources=msg.sources,
        schedule=schedule,  # type: ignore[arg-type]  # lists, made tuples by JobSpec
        shuffle=msg.shuffle,
        region_windows=msg.region_windows,
        block_regions=msg.block_regions,
        run=msg.run,
    )


def _max_count(config: ServerConfig, msg: protocol.Hello, feed: Feed) -> int:
    """Batches per chunk: about ``chunk_bytes``, never over ``max_chunk_bytes``, at least 1,
    and few enough that one request's pieces of a remote store fit in its cache at once."""
    limits = config.limits
    itemsize = feed.first.dataset.dtype.itemsize
    batch_bytes = msg.batch_size * (msg.seq_len + 1) * itemsize
    if batch_bytes > limits.max_chunk_bytes:
        raise RequestRejected(
            f"one batch is {batch_bytes} bytes, over max_chunk_bytes="
            f"{limits.max_chunk_bytes}; lower batch_size or seq_len",
        )
    chunk = min(config.chunk_bytes, limits.max_chunk_bytes)
    max_count = min(chunk // batch_bytes, _MAX_ROWS_PER_CHUNK // msg.batch_size)
    return max(1, min(max_count, remote_rows(msg, feed) // msg.batch_size))


def _welcome(job: Job, *, server: str, window: int) -> protocol.Welcome:
    """The ``welcome`` for a connection attached to ``job``: its shape, per source for a
    mixture."""
    feed = job.feed
    manifest = feed.first.dataset.manifest  # dtype and EOS: the same in every source
    per_source: dict[str, Any] = {}
    if feed.is_mixture:
        per_source = {
            "source_fingerprints": [s.dataset.fingerprint for s in feed.sources],
            "source_tokens": [s.dataset.n_tokens for s in feed.sources],
            "source_windows": [s.plan.n_windows for s in feed.sources],
            "source_region_windows": [s.plan.region_windows for s in feed.sources],
            "source_block_regions": [s.plan.block_regions for s in feed.sources],
        }
    else:
        per_source = {
            "region_windows": job.plan.region_windows,
            "block_regions": job.plan.block_regions,
        }
    return protocol.Welcome(
        server=server,
        job=job.id,
        fingerprint=feed.fingerprint,
        n_tokens=feed.n_tokens,
        n_windows=feed.n_windows,
        dtype=manifest.dtype,
        window=window,
        max_count=job.max_count,
        eos_id=manifest.tokenizer.eos_id,
        **per_source,
    )
