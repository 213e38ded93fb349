"""The ROUTER loop: one socket, a blocking poll loop in its own thread.

Each loop turn (1) drains what has arrived, validating every header and answering
``hello`` (:mod:`.admission`) and ``ping`` at once while queueing ``get`` requests on
their job (:mod:`.gets`), then (2) serves one round of deficit round robin over the jobs
with queued requests (:mod:`.scheduler`, :mod:`.serving`): each job may send up to
``weight x chunk_bytes`` per round, so a job with eight workers and deep windows gets the
same share as a job with one.

Nothing here blocks on a client or on the file system: sends use ``ROUTER_MANDATORY``
and ``NOBLOCK`` (:mod:`.wire`), so a vanished or stalled peer only makes its own requests
fail, and dataset look-ups are answered from the store's memory (a watcher thread
notices replaced datasets). A refusal is a :class:`~tokenfeed.errors.ServerError`,
answered with ``err`` carrying its ``.code`` and ``.retry``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from tokenfeed import protocol
from tokenfeed.errors import PlanError, ProtocolError, RequestRejected, ServerError, StoreError
from tokenfeed_server.config import ServerConfig
from tokenfeed_server.dataplane.admission import Admission
from tokenfeed_server.dataplane.auth import Tenants
from tokenfeed_server.dataplane.busy import LoopBusy
from tokenfeed_server.dataplane.gets import accept_get
from tokenfeed_server.dataplane.registry import Registry
from tokenfeed_server.dataplane.rings import open_rings
from tokenfeed_server.dataplane.scheduler import TokenBucket
from tokenfeed_server.dataplane.serving import Serving
from tokenfeed_server.dataplane.snapshot import EMPTY_SNAPSHOT, make_snapshot
from tokenfeed_server.dataplane.unattached import Unattached
from tokenfeed_server.dataplane.wire import Wire, tenant_of
from tokenfeed_server.logbudget import LogBudget
from tokenfeed_server.store import Store
from tokenfeed_server.store.mixture_tables import shared_mixtures
from tokenfeed_server.store.prefetch import Prefetcher
from tokenfeed_server.store.redact import Redactor

__all__ = ["DataPlane"]

log = logging.getLogger(__name__)

_DRAIN_MAX = 512  # messages read per turn before serving, so reads cannot starve sends
_MAX_POLL_MS = 100  # the loop looks at its stop flag and housekeeping at least this often
_SNAPSHOT_EVERY_S = 0.5


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
        self.tenants = tenants
        self.instance = uuid.uuid4().hex[:12]
        self.endpoint = ""
        self.counters: collections.Counter[str] = collections.Counter()
        #: busy time of the loop's turns (published in the snapshot)
        self.busy = LoopBusy()
        #: what the HTTP side reads (see :mod:`tokenfeed_server.dataplane.snapshot`)
        self.snapshot: dict[str, Any] = EMPTY_SNAPSHOT
        self.registry = Registry(float(max(1, config.chunk_bytes)))
        self._ctx = context or zmq.Context.instance()
        self._configure_socket = configure_socket
        self._bucket = TokenBucket(config.max_tokens_per_s)
        self._log_budget = LogBudget()
        #: shared-memory rings of connections on this host (see dataplane/rings.py)
        self.rings = open_rings(config.ring_door, config.ring_size)
        self._admission = Admission(
            config,
            store,
            self.registry,
            tenants=tenants,
            instance=self.instance,
            log_budget=self._log_budget,
            rings=self.rings,
        )
        self._prefetcher = (
            Prefetcher(store.cache, **config.cache.prefetch_options())
            if store.cache is not None
            else None
        )
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread: threading.Thread | None = None
        self._startup_error: BaseException | None = None
        self._last_snapshot = 0.0
        self._unattached: Unattached | None = None  # made with the socket, in its thread

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
        try:
            self._loop(sock)
        except Exception:  # pragma: no cover - a bug; keep the cause in the log
            log.exception("data plane crashed")
            raise
        finally:
            if self._unattached is not None:
                sock.disable_monitor()
                self._unattached.close()
            sock.close(linger=0)
            self.rings.close()

    def _loop(self, sock: zmq.Socket[bytes]) -> None:
        wire = Wire(
            sock, self.registry, self.counters, self._log_budget, Redactor.for_store(self.store)
        )
        serving = Serving(
            wire,
            self.registry,
            cache=self.store.cache,
            bucket=self._bucket,
            counters=self.counters,
            log_budget=self._log_budget,
            rings=self.rings,
        )
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        unattached = self._unattached = Unattached(
            sock,
            max_count=self.config.max_unattached_connections,
            timeout_s=self.config.hello_timeout_s,
            counters=self.counters,
            log_budget=self._log_budget,
        )
        poller.register(unattached.monitor, zmq.POLLIN)
        if self.store.cache is not None:  # readable when parked requests' pieces are in
            poller.register(self.store.cache.wake_fd, zmq.POLLIN)
        queue = self.registry.queue
        while not self._stop.is_set():
            wait = _MAX_POLL_MS
            if queue:  # wake when the egress cap lets the next chunk go
                wait = min(wait, int(self._bucket.wait_s() * 1000 + 0.999))
            ready = poller.poll(wait)
            started = time.perf_counter()  # the turn's busy time: everyone else waits it
            if ready:
                unattached.events()  # before the messages: a hello then finds its fd
                self._drain(sock, wire)
            serving.unpark()
            queue.serve_round(lambda jid, item: serving.serve(jid, *item), self._bucket.ready)
            self._housekeeping()
            self.busy.note(time.perf_counter() - started)

    # -- receiving -------------------------------------------------------------------

    def _drain(self, sock: zmq.Socket[bytes], wire: Wire) -> None:
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
            tenant = tenant_of(frames[-1])
            self.counters["messages"] += 1
            try:
                self._handle(wire, ident, tenant, frames[1:])
            except (ProtocolError, PlanError) as exc:
                wire.refuse(ident, RequestRejected(str(exc)))
            except ServerError as exc:  # a refusal: a limit, a tenant's rights, a dataset
                wire.refuse(ident, exc)
            except Exception:  # a bug must cost one request, never the server
                if self._log_budget.take():
                    log.exception("internal error handling a request from %s", ident.hex()[:16])
                wire.refuse(ident, ServerError("internal server error; see server log"))

    def _handle(self, wire: Wire, ident: bytes, tenant: str, frames: list[zmq.Frame]) -> None:
        if len(frames) != 1:
            raise ProtocolError(f"requests are exactly one header frame, got {len(frames)} frames")
        msg = protocol.decode_header(frames[0].buffer)
        if isinstance(msg, protocol.Get):
            accept_get(self.registry, ident, tenant, msg, self.counters)
        elif isinstance(msg, protocol.Hello):
            wire.send(ident, [self._admission.hello(ident, tenant, msg).header()])
            if self._unattached is not None:
                self._unattached.attach(int(frames[0].get(zmq.SRCFD)))
        elif isinstance(msg, protocol.Ping):
            wire.send(ident, [protocol.Pong().header()])
        elif isinstance(msg, protocol.Bye):
            peer = self.registry.peers.get(ident)
            if peer is not None and peer.tenant == tenant:
                self.registry.note_consumed(peer.job, msg.consumed)
            self.registry.forget_peer(ident, gone=True)
        else:
            raise ProtocolError(f"a client may not send {msg.TYPE!r} messages")

    # -- bookkeeping -----------------------------------------------------------------

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now - self._last_snapshot < _SNAPSHOT_EVERY_S:
            return
        self._last_snapshot = now
        if self._prefetcher is not None:  # the pieces active jobs read next, fetched ahead
            self._prefetcher.update(self.registry.jobs.values(), now)
        self.registry.expire(
            now, peer_timeout_s=self.config.peer_timeout_s, job_ttl_s=self.config.job_ttl_s
        )
        if self._unattached is not None:
            self._unattached.expire(now)
        self.rings.sweep(self.registry.peers)  # a forgotten connection's ring goes now
        snap = make_snapshot(
            self.registry,
            now,
            server=self.instance,
            endpoint=self.endpoint,
            counters=self.counters,
        )
        snap["loop"] = self.busy.view()
        snap["unattached"] = self._unattached.count if self._unattached is not None else 0
        snap["rings"] = {"open": len(self.rings)}
        self.counters["rings_handed"] = self.rings.handed  # the door counts on its thread
        snap["counters"].update(shared_mixtures.counters())  # where tables were built
        self.snapshot = snap  # published whole: the HTTP side never sees it half made
