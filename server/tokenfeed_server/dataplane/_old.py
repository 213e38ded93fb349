"""The data plane: one ROUTER socket, a blocking poll loop in its own thread.

Each loop turn (1) drains what has arrived, validating every header and answering
``hello`` and ``ping`` at once while queueing ``get`` requests on their job, then (2)
serves one round of deficit round robin over the jobs with queued requests (see
:mod:`tokenfeed_server.dataplane.scheduler`): each job may send up to ``weight x chunk_bytes`` per
round, so a job with eight workers and deep windows gets the same share as a job with
one. Serving a request is a pure function of the request (see
:func:`tokenfeed_server.store.assemble`), so the server holds no cursor and a restarted
server answers re-sent requests exactly as the old one would have.

Nothing here blocks on a client or on the file system: sends use ``ROUTER_MANDATORY``
and ``NOBLOCK``, so a vanished or stalled peer only makes its own requests fail, and
dataset look-ups are answered from the store's memory (a watcher thread notices
replaced datasets).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from tokenfeed import protocol
from tokenfeed.errors import (
    DatasetNotFound,
    InvalidDatasetName,
    PlanError,
    ProtocolError,
    ServerError,
    StoreError,
)
from tokenfeed.plan import Plan
from tokenfeed.protocol import JobSpec
from tokenfeed_server.dataplane.auth import Tenants
from tokenfeed_server.config import ServerConfig
from tokenfeed_server.logbudget import LogBudget
from tokenfeed_server.dataplane.rates import Rate
from tokenfeed_server.dataplane.scheduler import FairQueue, TokenBucket
from tokenfeed_server.store import Dataset, Store
from tokenfeed_server.store.cache import NotResident, Waiter
from tokenfeed_server.store.mixing import Feed, open_feed
from tokenfeed_server.store.prefetch import Prefetcher
from tokenfeed_server.store.remote import RemoteDataset

log = logging.getLogger(__name__)

_DRAIN_MAX = 512  # messages read per turn before serving, so reads cannot starve sends
_MAX_ROWS_PER_CHUNK = 8192  # rows are gathered one by one: bound the work of one request
_MAX_WORKER = 1 << 16
_MAX_POLL_MS = 100  # the loop looks at its stop flag and housekeeping at least this often
_SNAPSHOT_EVERY_S = 0.5
_RATE_WINDOW_S = 10.0


class Refusal(Exception):
    """A request the data plane answers with an ``err`` carrying this wire code.

    ``quiet`` refusals are expected on a healthy system (a client's documented recovery
    path) and are logged at debug level only.
    """

    def __init__(self, code: str, message: str, *, retry: bool = False, quiet: bool = False):
        assert code in protocol.ERROR_CODES, code
        super().__init__(message)
        self.code, self.retry, self.quiet = code, retry, quiet


@dataclass
class Job:
    """A training run as the server sees it: what it reads (its feed), its counters.

    ``spec.dataset`` is the dataset's name (``""`` for a mixture: ``spec.sources``);
    ``feed`` holds the open datasets and one plan per source (see
    :mod:`tokenfeed_server.store.mixing`).
    """

    id: str
    spec: JobSpec
    feed: Feed
    tenant: str
    weight: float = 1.0
    max_count: int = 1
    batches: int = 0
    tokens: int = 0
    requests: int = 0
    retransmits: int = 0
    #: furthest stream position served (what the trainer has prefetched)
    position: int = 0
    #: largest consumed position the trainer reported (-1: none yet); see protocol.Get
    consumed: int = -1
    created: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.monotonic)
    # client name -> (rank -> highest position asked): a client re-asking at or below its
    # own mark is re-sending (Lazy Pirate after silence or a restart)
    high_water: dict[str, dict[int, int]] = field(default_factory=dict)
    served_rate: Rate = field(default_factory=lambda: Rate(_RATE_WINDOW_S))
    consumed_rate: Rate = field(default_factory=lambda: Rate(_RATE_WINDOW_S))

    @property
    def reader(self) -> Dataset:
        """The open dataset of a single-dataset job (a mixture's first source)."""
        return self.feed.first.dataset

    @property
    def plan(self) -> Plan:
        """The plan of a single-dataset job (a mixture's first source's: batch, world
        and positions are the same in every source's plan)."""
        return self.feed.first.plan


@dataclass
class Peer:
    """One client connection (one DataLoader worker) attached to a job."""

    name: str
    job: str
    rank: int
    worker: int
    tenant: str
    window: int
    queued: int = 0
    last_seen: float = field(default_factory=time.monotonic)


def job_id(spec: JobSpec, feed: Feed, tenant: str) -> str:
    """Deterministic id: every rank and worker of a run, and a restarted server, agree.

    It covers the spec (a mixture's reduced schedule included), every source's build and
    the block sizes each source's plan uses (derived ones too, so a hello that names the
    derived sizes joins the same job as one that leaves them at 0).
    """
    if not spec.is_mixture and spec.shuffle == "global":
        # The key of single-dataset jobs from before mixtures: their ids do not change.
        plain = (
            f"JobSpec(dataset={spec.dataset!r}, seq_len={spec.seq_len}, "
            f"batch_size={spec.batch_size}, seed={spec.seed}, world_size={spec.world_size})"
        )
        key = f"{plain}|{feed.fingerprint}|{tenant}"
    else:
        # The sizes each plan uses, not the ones asked for (0: derive).
        asked = dataclasses.replace(spec, region_windows=0, block_regions=0)
        sources = ";".join(
            f"{s.name}:{s.dataset.fingerprint}:{s.plan.region_windows}:{s.plan.block_regions}"
            for s in feed.sources
        )
        key = f"{asked}|{sources}|{tenant}"
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


class DataPlane:
    """The ROUTER loop. ``start()`` binds and runs it in a thread; ``stop()`` ends it."""

    def __init__(
        self,
        config: ServerConfig,
        store: Store,
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        configure_socket: Callable[[zmq.Socket[bytes]], None] | None = None,
        tenants: Tenants | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.instance = uuid.uuid4().hex[:12]
        self._ctx = context or zmq.Context.instance()
        self._configure_socket = configure_socket
        self.tenants = tenants
        self._bucket = TokenBucket(config.max_tokens_per_s)
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread: threading.Thread | None = None
        self._startup_error: BaseException | None = None
        self.endpoint = ""
        self.jobs: dict[str, Job] = {}
        self.peers: dict[bytes, Peer] = {}
        # (tenant, client name) -> that client's current connection
        self._by_name: dict[tuple[str, str], bytes] = {}
        # queued gets (connection, request) per job id
        self._queue: FairQueue[str, tuple[bytes, protocol.Get]] = FairQueue(
            float(max(1, config.chunk_bytes))
        )
        self.counters: collections.Counter[str] = collections.Counter()
        self.snapshot: dict[str, Any] = {"jobs": [], "connections": 0, "counters": {}}
        self._last_snapshot = 0.0
        self._log_budget = LogBudget()
        # Requests waiting for pieces of a remote store: (waiter, jid, connection, get);
        # and the waiters of requests re-queued last turn, released after their retry.
        self._parked: list[tuple[Waiter, str, bytes, protocol.Get]] = []
        self._retried: list[Waiter] = []
        self._prefetcher = Prefetcher(store.cache) if store.cache is not None else None

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> str:
        """Bind the socket, start the loop thread, return the bound endpoint."""
        self._thread = threading.Thread(target=self._run, name="tokenfeed-dataplane", daemon=True)
        self._thread.start()
        self._bound.wait()
        if self._startup_error is not None:
            raise self._startup_error
        return self.endpoint

    @property
    def alive(self) -> bool:
        """True while the loop thread runs (readiness depends on it)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the loop to finish and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _bind(self) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.limits.max_message_bytes)
        # Credit windows bound what is queued per peer; the HWM is only a backstop.
        sock.setsockopt(zmq.SNDHWM, self.config.limits.max_window + 4)
        sock.setsockopt(zmq.RCVHWM, 4096)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
        if self._configure_socket is not None:
            self._configure_socket(sock)
        host = self.config.host
        wire_host = f"[{host}]" if ":" in host else host
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        port = self.config.zmq_port or "*"
        try:
            sock.bind(f"tcp://{wire_host}:{port}")
        except zmq.ZMQError as exc:
            sock.close()
            raise StoreError(
                f"cannot bind the data port tcp://{wire_host}:{port}: {exc}; "
                "pick another with --zmq-port (0 picks a free one)"
            ) from None
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return sock

    def _run(self) -> None:
        try:
            sock = self._bind()
        except BaseException as exc:
            self._startup_error = exc
            self._bound.set()
            return
        self._bound.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if self.store.cache is not None:  # readable when parked requests' pieces are in
            poller.register(self.store.cache.wake_fd, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                wait = _MAX_POLL_MS
                if self._queue:  # wake when the egress cap lets the next chunk go
                    wait = min(wait, int(self._bucket.wait_s() * 1000 + 0.999))
                if poller.poll(wait):
                    self._drain(sock)
                self._unpark(sock)
                self._queue.serve_round(
                    lambda jid, item: self._serve(sock, jid, *item), self._bucket.ready
                )
                self._housekeeping()
        except Exception:  # pragma: no cover - a bug; keep the cause in the log
            log.exception("data plane crashed")
            raise
        finally:
            sock.close(linger=0)

    # -- receiving -------------------------------------------------------------------

    def _drain(self, sock: zmq.Socket[bytes]) -> None:
        for _ in range(_DRAIN_MAX):
            # Ask first: an empty NOBLOCK receive raises zmq.Again, and building that
            # exception on every drain cost more than the check (benchmarks/bench_loaders.py).
            if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = frames[0].bytes
            tenant = _tenant_of(frames[-1])
            self.counters["messages"] += 1
            try:
                self._handle(sock, ident, tenant, frames[1:])
            except (ProtocolError, PlanError) as exc:
                self._reject(sock, ident, "bad_request", str(exc))
            except Refusal as exc:
                self._reject(sock, ident, exc.code, str(exc), retry=exc.retry, quiet=exc.quiet)
            except ServerError as exc:  # e.g. the tenants' refusals
                self._reject(sock, ident, exc.code, str(exc), retry=exc.retry)
            except Exception:  # a bug must cost one request, never the server
                if self._log_budget.take():
                    log.exception("internal error handling a request from %s", ident.hex()[:16])
                self._reject(sock, ident, "internal", "internal server error; see server log")

    def _handle(
        self, sock: zmq.Socket[bytes], ident: bytes, tenant: str, frames: list[zmq.Frame]
    ) -> None:
        if len(frames) != 1:
            raise ProtocolError(f"requests are exactly one header frame, got {len(frames)} frames")
        msg = protocol.decode_header(frames[0].buffer)
        if isinstance(msg, protocol.Get):
            self._on_get(ident, tenant, msg)
        elif isinstance(msg, protocol.Hello):
            self._on_hello(sock, ident, tenant, msg)
        elif isinstance(msg, protocol.Ping):
            self._send(sock, ident, [protocol.Pong().header()])
        elif isinstance(msg, protocol.Bye):
            peer = self.peers.get(ident)
            if peer is not None and peer.tenant == tenant:
                self._note_consumed(peer.job, msg.consumed)
            self._forget_peer(ident, gone=True)
        else:
            raise ProtocolError(f"a client may not send {msg.TYPE!r} messages")

    # -- hello: authorize, resolve the job, register the peer ------------------------

    def _on_hello(
        self, sock: zmq.Socket[bytes], ident: bytes, tenant: str, msg: protocol.Hello
    ) -> None:
        window = self._authorize(ident, tenant, msg)
        job = self._resolve_job(tenant, msg)
        self._register_peer(ident, tenant, msg, job, window)
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
        welcome = protocol.Welcome(
            server=self.instance,
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
        self._send(sock, ident, [welcome.header()])

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
            raise Refusal(
                "bad_request",
                f"a batch of {msg.batch_size} x {msg.seq_len + 1} tokens exceeds "
                f"max_batch_tokens={limits.max_batch_tokens}; lower batch_size or seq_len",
            )
        if not 0 <= msg.rank < msg.world_size:
            raise ProtocolError(f"rank {msg.rank} is outside [0, world_size={msg.world_size})")
        if not 0 <= msg.worker < _MAX_WORKER:
            raise ProtocolError(f"worker {msg.worker} is outside [0, {_MAX_WORKER})")
        # A client that reconnected (new socket, same name) replaces its old connection
        # instead of holding two slots until the old one times out.
        previous = self._by_name.get((tenant, msg.client))  # never another tenant's
        if previous is not None and previous != ident:
            self._forget_peer(previous)
        if ident not in self.peers:
            self._check_connection_caps(tenant)
        # The credit window is negotiated: the server grants at most its max_window.
        return min(msg.window, limits.max_window)

    def _resolve_job(self, tenant: str, msg: protocol.Hello) -> Job:
        """The job these inputs name, created on first sight; its datasets from memory.

        A mixture's hello names its sources: each is looked up and checked (build,
        tokenizer) and gets its own plan (see :func:`~tokenfeed_server.store.mixing.open_feed`).
        """
        names = msg.sources or (msg.dataset,)
        feed = open_feed([self._dataset(tenant, name) for name in names], msg)
        schedule = feed.mixture.to_wire() if feed.mixture is not None else ()
        spec = JobSpec(
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
        )
        jid = job_id(spec, feed, tenant)
        job = self.jobs.get(jid)
        if job is not None:
            if not any(p.job == jid for p in self.peers.values()):
                # Nobody attached: the trainer starts again (a restart from a checkpoint
                # joins the same job id), so its old consumed position says nothing. The
                # rate keeps its samples: it reads a fall as 0, and the loader's own
                # end-of-loop report (a hello of its own) must not zero a live rate.
                job.consumed = -1
            return job
        limits = self.config.limits
        # batches per chunk: about chunk_bytes, never over max_chunk_bytes, at least 1
        batch_bytes = msg.batch_size * (msg.seq_len + 1) * feed.first.dataset.dtype.itemsize
        if batch_bytes > limits.max_chunk_bytes:
            raise Refusal(
                "bad_request",
                f"one batch is {batch_bytes} bytes, over max_chunk_bytes="
                f"{limits.max_chunk_bytes}; lower batch_size or seq_len",
            )
        chunk = min(self.config.chunk_bytes, limits.max_chunk_bytes)
        max_count = min(chunk // batch_bytes, _MAX_ROWS_PER_CHUNK // msg.batch_size)
        row_bytes = (msg.seq_len + 1) * feed.first.dataset.dtype.itemsize
        remote = [s.dataset for s in feed.sources if isinstance(s.dataset, RemoteDataset)]
        # every remote source of a mixture together: one request reads from all of them
        remote_bytes = sum(ds.nbytes for ds in remote)
        for ds in remote:
            # A request's pieces must fit in the cache at once (else CacheTooSmall);
            # clients split requests by max_count, so the batches do not change.
            rows = ds.cache.rows_per_request(ds.piece_bytes, row_bytes, remote_bytes)
            max_count = min(max_count, rows // msg.batch_size)
        self._make_room_for_a_job()
        weight = self.tenants.weight(tenant) if self.tenants is not None else 1.0
        job = Job(jid, spec, feed, tenant, weight=weight, max_count=max(1, max_count))
        self.jobs[jid] = job
        self._queue.add(jid, weight)
        if self._log_budget.take():
            log.info("job %s: %s (tenant %s)", jid, spec, tenant)
        return job

    def _register_peer(
        self, ident: bytes, tenant: str, msg: protocol.Hello, job: Job, window: int
    ) -> Peer:
        """Attach connection ``ident`` to ``job`` (moving it off another job if need be)."""
        old = self.peers.get(ident)
        if old is not None and (old.job != job.id or old.name != msg.client):
            # One name per connection: a name left behind would let a later connection
            # under that name pass for this one's reconnect and evict it (and the table
            # of names would grow with every rename).
            self._forget_peer(ident)
            old = None
        peer = old or Peer(msg.client, job.id, msg.rank, msg.worker, tenant, window)
        peer.rank, peer.worker = msg.rank, msg.worker
        peer.window, peer.last_seen = window, time.monotonic()
        self.peers[ident] = peer
        self._by_name[(tenant, msg.client)] = ident
        return peer

    def _dataset(self, tenant: str, name: str) -> Dataset:
        try:
            return self.store.get(name)
        except DatasetNotFound:
            # Name only what this tenant may read, and never the store's path.
            names = [
                n
                for n in self.store.names()
                if self.tenants is None or self.tenants.authorize(tenant, n) is None
            ]
            raise Refusal(
                "unknown_dataset",
                f"no dataset {name!r} on this server; available: {', '.join(names) or 'none'}",
            ) from None
        except InvalidDatasetName as exc:  # the client's mistake, not a damaged dataset
            raise ProtocolError(str(exc)) from None
        except StoreError as exc:
            if self._log_budget.take():
                log.error("dataset %s cannot be served: %s", name, exc)
            raise Refusal(
                "unknown_dataset",
                f"dataset {name!r} is damaged on the server and cannot be served; "
                "the operator should check the server log and rebuild it",
            ) from None

    def _make_room_for_a_job(self) -> None:
        cap = self.config.limits.max_jobs
        if len(self.jobs) < cap:
            return
        # Forget the longest-idle jobs that no connection is attached to.
        attached = {p.job for p in self.peers.values()}
        idle = sorted(
            (
                j
                for j in self.jobs.values()
                if j.id not in attached and not self._queue.queued(j.id)
            ),
            key=lambda j: j.last_active,
        )
        for job in idle[: len(self.jobs) - cap + 1]:
            self._drop_job(job.id)
        if len(self.jobs) >= cap:
            raise Refusal(
                "connection_limit",
                f"the server runs max_jobs={cap} active jobs; try again later or ask the "
                "operator to raise the limit",
                retry=True,
            )

    def _drop_job(self, jid: str) -> None:
        del self.jobs[jid]
        self._queue.remove(jid)

    def _check_connection_caps(self, tenant: str) -> None:
        limits = self.config.limits
        if len(self.peers) >= limits.max_connections:
            raise Refusal(
                "connection_limit",
                f"the server has max_connections={limits.max_connections} attached; "
                "try again later or ask the operator to raise the limit",
            )
        mine = sum(1 for p in self.peers.values() if p.tenant == tenant)
        own = self.tenants.max_connections(tenant) if self.tenants is not None else None
        cap = own or limits.max_connections_per_tenant
        if mine >= cap:
            raise Refusal(
                "connection_limit",
                f"tenant {tenant!r} already has {mine} connections (its cap is {cap}); "
                "use fewer DataLoader workers or ranks, or ask the operator for more",
            )

    # -- get -------------------------------------------------------------------------

    def _on_get(self, ident: bytes, tenant: str, msg: protocol.Get) -> None:
        peer = self.peers.get(ident)
        job = self.jobs.get(msg.job)
        if peer is None or job is None or peer.job != msg.job or peer.tenant != tenant:
            # After a server restart the client's job is unknown here: it says hello again
            # and re-sends; the answer will be identical because requests are pure. This is
            # the documented recovery path, not a fault: quiet, and counted under its code.
            raise Refusal(
                "unknown_job",
                f"job {msg.job!r} is not attached on this connection; send hello first",
                retry=True,
                quiet=True,
            )
        peer.last_seen = time.monotonic()
        self._note_consumed(job.id, msg.consumed)
        if not 0 <= msg.rank < job.spec.world_size:
            raise ProtocolError(f"rank {msg.rank} outside [0, {job.spec.world_size})")
        if not 1 <= msg.count <= job.max_count:
            raise ProtocolError(f"count {msg.count} is outside [1, max_count={job.max_count}]")
        if msg.stride < 1 or msg.pos < 0:
            raise ProtocolError("pos must be >= 0 and stride >= 1")
        if peer.queued >= peer.window:
            raise Refusal(
                "bad_request",
                f"more than window={peer.window} requests outstanding on one connection; "
                "wait for a chunk before sending another get",
            )
        last = msg.pos + (msg.count - 1) * msg.stride * job.plan.global_batch
        if last + job.plan.global_batch >= 1 << 62:
            raise ProtocolError("stream position would overflow int64")
        peer.queued += 1
        job.requests += 1
        job.last_active = time.monotonic()
        marks = job.high_water.setdefault(peer.name, {})
        if msg.pos <= marks.get(msg.rank, -1):
            job.retransmits += 1
        marks[msg.rank] = max(marks.get(msg.rank, -1), msg.pos)
        self._queue.push(job.id, (ident, msg))

    def _note_consumed(self, jid: str, consumed: int) -> None:
        """Keep the furthest consumed position reported for job ``jid``: workers read the
        trainer's counter at different times, so a report may be older than the last."""
        job = self.jobs.get(jid)
        if job is None:
            return
        # Never past what was served: a wild report must not pin the figure forever.
        consumed = min(consumed, job.position)
        job.consumed = max(job.consumed, consumed)

    # -- serving ---------------------------------------------------------------------

    def _serve(self, sock: zmq.Socket[bytes], jid: str, ident: bytes, req: protocol.Get) -> int:
        """Answer one queued get; return the bytes sent (its cost in the fair queue)."""
        peer = self.peers.get(ident)
        job = self.jobs[jid]
        if peer is None:
            return 0  # the peer was dropped while this waited: nothing to send
        peer.queued -= 1
        try:
            tokens, rows = job.feed.assemble(req.rank, req.pos, count=req.count, stride=req.stride)
        except NotResident as exc:  # nothing read; answered once the pieces are in
            peer.queued += 1  # still outstanding on its connection
            self._parked.append((exc.waiter, jid, ident, req))
            self.counters["parked"] += 1
            return 0
        except StoreError as exc:  # e.g. a shard truncated under the running server
            if self._log_budget.take():
                log.error("job %s: %s", job.id, exc)
            # Only this dataset's jobs fail; the message names it, never the store's path.
            err = protocol.Err(
                code="unknown_dataset",
                message=f"dataset {job.feed.label!r} cannot be read on the server (a shard "
                "changed under it); the operator should check the server log and rebuild it",
                retry=False,
                req=req.req,
            )
            self._send(sock, ident, [err.header()])
            return 0
        except Exception:  # a bug: keep the cause in the log, let the client retry
            if self._log_budget.take():
                log.exception("cannot assemble %s for job %s", req, job.id)
            err = protocol.Err(
                code="internal",
                message="the server could not read the dataset; the operator should check its log",
                retry=True,
                req=req.req,
            )
            self._send(sock, ident, [err.header()])
            return 0
        if not self._send(sock, ident, protocol.chunk_frames(req.req, tokens, rows)):
            return 0
        job.batches += req.count
        job.tokens += tokens.size
        end = req.pos + (req.count - 1) * req.stride * job.plan.global_batch
        job.position = max(job.position, end + job.plan.global_batch)
        self.counters["chunks"] += 1
        self.counters["bytes_sent"] += tokens.nbytes
        self._bucket.spend(tokens.size)
        return int(tokens.nbytes)

    def _unpark(self, sock: zmq.Socket[bytes]) -> None:
        """Each loop turn: unpin the pieces of requests retried last turn, re-queue the
        parked requests whose pieces are in (their job's turn serves them now), and fail
        those whose pieces stay unreadable, with an error naming the object."""
        cache = self.store.cache
        if cache is None:
            return
        for waiter in self._retried:
            cache.release(waiter)
        self._retried = []
        cache.completed()  # clears the wake descriptor
        if not self._parked:
            return
        waiting = []
        for item in self._parked:
            waiter, jid, ident, req = item
            if not waiter.done:
                waiting.append(item)
                continue
            peer = self.peers.get(ident)
            job = self.jobs.get(jid)
            if peer is None or job is None or peer.job != jid:
                cache.release(waiter)  # its connection or job went away meanwhile
                continue
            if waiter.error is not None:
                cache.release(waiter)
                peer.queued -= 1
                self.counters["err_unreadable"] += 1
                if self._log_budget.take():
                    log.error("job %s: %s", job.id, waiter.error)
                err = protocol.Err(
                    code="unknown_dataset",
                    message=f"dataset {job.feed.label!r} cannot be served: {waiter.error}",
                    retry=False,
                    req=req.req,
                )
                self._send(sock, ident, [err.header()])
                continue
            self._retried.append(waiter)
            self._queue.push(jid, (ident, req))
        self._parked = waiting

    def _send(self, sock: zmq.Socket[bytes], ident: bytes, frames: list[Any]) -> bool:
        try:
            sock.send_multipart([ident, *frames], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            # EHOSTUNREACH: the peer is gone; EAGAIN: it stopped reading past its window.
            if self._log_budget.take():
                log.info("dropping connection %s: %s", ident.hex()[:16], exc.strerror)
            self._forget_peer(ident)
            return False
        return True

    def _reject(
        self,
        sock: zmq.Socket[bytes],
        ident: bytes,
        code: str,
        message: str,
        *,
        retry: bool = False,
        quiet: bool = False,
    ) -> None:
        self.counters[f"err_{code}"] += 1
        if quiet:
            log.debug("answered %s from %s: %s", code, ident.hex()[:16], message)
        elif self._log_budget.take():
            log.warning("refused a request from %s: %s: %s", ident.hex()[:16], code, message)
        err = protocol.Err(code=code, message=message, retry=retry, req=-1)
        self._send(sock, ident, [err.header()])

    def _forget_peer(self, ident: bytes, *, gone: bool = False) -> None:
        """Drop connection ``ident`` and its queued gets. ``gone``: the client itself is
        done (bye, timeout), not just this socket, so its re-send marks go too."""
        peer = self.peers.pop(ident, None)
        if peer is None:
            return
        if self._by_name.get((peer.tenant, peer.name)) == ident:
            del self._by_name[(peer.tenant, peer.name)]
        job = self.jobs.get(peer.job)
        if job is None:
            return
        if gone:
            job.high_water.pop(peer.name, None)
        if peer.queued:
            self._queue.discard(job.id, lambda item: item[0] == ident)

    # -- bookkeeping -----------------------------------------------------------------

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now - self._last_snapshot < _SNAPSHOT_EVERY_S:
            return
        self._last_snapshot = now
        if self._prefetcher is not None:  # the pieces active jobs read next, fetched ahead
            self._prefetcher.update(self.jobs.values(), now)
        for ident, peer in list(self.peers.items()):
            if now - peer.last_seen > self.config.peer_timeout_s:
                self._forget_peer(ident, gone=True)
        attached = collections.Counter(p.job for p in self.peers.values())
        for jid, job in list(self.jobs.items()):
            if (
                not attached[jid]
                and not self._queue.queued(jid)
                and now - job.last_active > self.config.job_ttl_s
            ):
                self._drop_job(jid)
        self.snapshot = self._make_snapshot(now)

    def _make_snapshot(self, now: float) -> dict[str, Any]:
        # Workers, not connections: the loader's short progress reports and its hello before
        # starting workers come as (rank, worker 0) too, and are no extra worker.
        workers = {(p.job, p.rank, p.worker) for p in self.peers.values()}
        per_job = collections.Counter(jid for jid, _, _ in workers)
        jobs = []
        for job in self.jobs.values():
            windows = job.feed.n_windows
            served_rate = job.served_rate.sample(now, job.tokens)
            consumed_rate = 0.0
            if job.consumed >= 0:
                # Tokens the model reads: seq_len per window (the +1 is the last label).
                consumed_rate = job.consumed_rate.sample(now, job.consumed * job.spec.seq_len)
            jobs.append(
                {
                    "id": job.id,
                    "tenant": job.tenant,
                    "dataset": job.feed.label,
                    "seq_len": job.spec.seq_len,
                    "batch_size": job.spec.batch_size,
                    "seed": job.spec.seed,
                    "world_size": job.spec.world_size,
                    "weight": job.weight,
                    "workers": per_job[job.id],
                    "requests": job.requests,
                    "batches_served": job.batches,
                    "tokens_served": job.tokens,
                    "tokens_per_s": round(served_rate, 1),
                    "position": job.position,
                    "epoch": job.position // windows,
                    "consumed_position": job.consumed if job.consumed >= 0 else None,
                    "consumed_epoch": job.consumed // windows if job.consumed >= 0 else None,
                    "consumed_tokens_per_s": round(consumed_rate, 1),
                    "epoch_windows": windows,
                    "idle_s": round(max(0.0, now - job.last_active), 1),
                    "retransmits": job.retransmits,
                    "queued": self._queue.queued(job.id),
                    "created": job.created,
                    **job.feed.describe(job.position, job.consumed),
                }
            )
        return {
            "server": self.instance,
            "endpoint": self.endpoint,
            "jobs": jobs,
            "connections": len(self.peers),
            "counters": dict(self.counters),
        }


def _tenant_of(frame: zmq.Frame) -> str:
    # ZAP puts the authenticated identity on every frame; without ZAP there is none.
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        return "anonymous"
    return str(user) if user else "anonymous"
