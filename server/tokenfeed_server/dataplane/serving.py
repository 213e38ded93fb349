"""Serving queued gets: assemble each request's rows and send them as one chunk.

Serving a request is a pure function of the request (see
:func:`tokenfeed_server.store.assemble`), so the server holds no cursor and a restarted
server answers re-sent requests exactly as the old one would have. A request whose
pieces of a remote store are not in the cache yet is *parked* (nothing read) and queued
again once they are, so a slow object store never blocks the loop.

The pieces a parked request waited for stay pinned until the retried request has been
served (or its connection or job is gone): released any earlier, a cache under pressure
could evict them for another request before this one reads them, fetch them again, and
so on without end. While object storage does not answer for a parked request's pieces,
its trainer is told so every few seconds (a retryable ``storage_unavailable`` naming the
object, the last error and how long the server keeps trying): the request stays parked
and its fetch goes on; the trainer waits instead of taking the silence for a dead server.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

from tokenfeed import protocol
from tokenfeed.errors import ServerError, StorageUnavailable, StoreError
from tokenfeed_server.dataplane.registry import Registry
from tokenfeed_server.dataplane.rings import Rings
from tokenfeed_server.dataplane.scheduler import TokenBucket
from tokenfeed_server.dataplane.wire import Wire
from tokenfeed_server.logbudget import LogBudget
from tokenfeed_server.store import wire_error
from tokenfeed_server.store.cache import PieceCache
from tokenfeed_server.store.errors import CacheOutOfDescriptors
from tokenfeed_server.store.waiters import NotResident, Waiter

__all__ = ["NOTICE_EVERY_S", "Serving"]

log = logging.getLogger(__name__)

#: Seconds between two storage notices to one client (well within a client's default
#: request_timeout of 10 s, so a waiting trainer never mistakes the wait for silence).
NOTICE_EVERY_S = 3.0
_SWEEP_EVERY_S = 1.0


@dataclass(eq=False)
class _Parked:
    """A request waiting for pieces: its waiter, where it goes, since when it waits."""

    waiter: Waiter
    jid: str
    ident: bytes
    req: protocol.Get
    since: float


class Serving:
    """Answers the gets the fair queue hands out, parking those that wait for pieces."""

    def __init__(
        self,
        wire: Wire,
        registry: Registry,
        *,
        cache: PieceCache | None,
        bucket: TokenBucket,
        counters: collections.Counter[str],
        log_budget: LogBudget,
        rings: Rings | None = None,
    ) -> None:
        self.wire = wire
        self.rings = rings
        self.registry = registry
        self.cache = cache
        self.bucket = bucket
        self.counters = counters
        self._log_budget = log_budget
        self._parked: list[_Parked] = []
        # Requests queued again once their pieces came in, by id(get): the get (kept
        # alive, so its id stays its own) and the waiter whose pins it holds until served.
        self._held: dict[int, _Parked] = {}
        # (tenant, client name) -> when that client was last told of a storage fault
        self._noticed: dict[tuple[str, str], float] = {}
        self._last_sweep = 0.0

    def serve(self, jid: str, ident: bytes, req: protocol.Get) -> int:
        """Answer one queued get; return the bytes sent (its cost in the fair queue)."""
        held = self._held.pop(id(req), None)
        try:
            return self._serve(jid, ident, req)
        finally:  # served, parked again (new pins taken first) or failed: unpin the wait
            if held is not None and self.cache is not None:
                self.cache.release(held.waiter)

    def _serve(self, jid: str, ident: bytes, req: protocol.Get) -> int:
        peer = self.registry.peers.get(ident)
        job = self.registry.jobs[jid]
        if peer is None:
            return 0  # the peer was dropped while this waited: nothing to send
        peer.queued -= 1
        if self.cache is not None:  # what this read makes the cache fetch is the job's
            self.cache.ledger.owner = jid
        # A trainer on this host with room in its ring gets the rows read straight into
        # the ring (the header and provenance still over ZeroMQ, in order with everything
        # else): no copy of the chunk after the read. Else TCP from a pooled buffer.
        space = None
        if self.rings is not None:
            space = self.rings.space(ident, *job.feed.chunk_shape(req.count))
        try:
            tokens, rows = job.feed.assemble(
                req.rank, req.pos, count=req.count, stride=req.stride,
                out=None if space is None else space.out,
            )  # fmt: skip
        except NotResident as exc:  # nothing read; answered once the pieces are in
            peer.queued += 1  # still outstanding on its connection
            self._parked.append(_Parked(exc.waiter, jid, ident, req, time.monotonic()))
            self.counters["parked"] += 1
            return 0
        except StoreError as exc:  # e.g. a shard truncated under the running server
            self._refuse_unreadable(job.id, job.feed.label, ident, req, exc)
            return 0
        except Exception:  # a bug: keep the cause in the log, let the client retry
            if self._log_budget.take():
                log.exception("cannot assemble %s for job %s", req, job.id)
            message = "the server could not read the dataset; the operator should check its log"
            self.wire.send_error(ident, ServerError(message, retry=True), req=req.req)
            return 0
        ring = None if space is None else space.commit()
        del space  # the ring's memory: no view of it outlives the read
        if not self.wire.send(ident, protocol.chunk_frames(req.req, tokens, rows, ring)):
            return 0
        if ring is not None:
            self.counters["ring_chunks"] += 1
        job.batches += req.count
        job.tokens += tokens.size
        end = req.pos + (req.count - 1) * req.stride * job.plan.global_batch
        job.position = max(job.position, end + job.plan.global_batch)
        self.counters["chunks"] += 1
        self.counters["bytes_sent"] += tokens.nbytes
        self.bucket.spend(tokens.size)
        return int(tokens.nbytes)

    def _refuse_unreadable(
        self, jid: str, label: str, ident: bytes, req: protocol.Get, exc: StoreError
    ) -> None:
        """Answer a request whose rows cannot be read. Only this dataset's jobs fail; the
        message names it, never a path of the server (the log names the cache's)."""
        if self._log_budget.take():
            where = f" (cache directory {self.cache.directory})" if self.cache else ""
            log.error("job %s: %s%s", jid, exc, where)
        if isinstance(exc, CacheOutOfDescriptors):  # the server's fault, said as such
            message = str(exc)
        else:
            message = (
                f"dataset {label!r} cannot be read on the server (a shard changed under "
                "it); the operator should check the server log and rebuild it"
            )
        self.wire.send_error(ident, wire_error(exc, message), req=req.req)

    def unpark(self) -> None:
        """Each loop turn: re-queue the parked requests whose pieces are in (their job's
        turn serves them now, their pins held until then), fail those whose pieces stay
        unreadable with an error naming the object, tell those that wait on object
        storage why, and let go of requests whose connection or job is gone."""
        cache = self.cache
        if cache is None:
            return
        cache.completed()  # clears the wake descriptor
        now = time.monotonic()
        if now - self._last_sweep >= _SWEEP_EVERY_S:
            self._last_sweep = now
            self._sweep(cache, now)
            self._charge_fetches(cache)
        if not self._parked:
            return
        waiting = []
        for item in self._parked:
            if not item.waiter.done:
                waiting.append(item)
                self._notice(cache, item, now)
            else:
                cache.health.waited(now - item.since)
                self._unparked(cache, item)
        self._parked = waiting

    def _unparked(self, cache: PieceCache, item: _Parked) -> None:
        """A parked request's wait is over: queue it again, or answer its error."""
        peer = self.registry.peers.get(item.ident)
        job = self.registry.jobs.get(item.jid)
        if peer is None or job is None or peer.job != item.jid:
            cache.release(item.waiter)  # its connection or job went away meanwhile
            return
        error = item.waiter.error
        if error is not None:
            cache.release(item.waiter)
            peer.queued -= 1
            self.counters["err_unreadable"] += 1
            if self._log_budget.take():
                log.error("job %s: %s", job.id, error)
            message = f"dataset {job.feed.label!r} cannot be served: {error}"
            self.wire.send_error(item.ident, wire_error(error, message), req=item.req.req)
            return
        self._held[id(item.req)] = item
        self.registry.queue.push(item.jid, (item.ident, item.req))

    def _notice(self, cache: PieceCache, item: _Parked, now: float) -> None:
        """Tell the trainer of a parked request why it waits, if object storage does not
        answer (at most every few seconds per client, whatever its connections)."""
        fault = cache.fault_of(item.waiter)
        if fault is None:
            return
        peer = self.registry.peers.get(item.ident)
        if peer is None or peer.job != item.jid:
            return
        key = (peer.tenant, peer.name)
        if now - self._noticed.get(key, -NOTICE_EVERY_S) < NOTICE_EVERY_S:
            return
        self._noticed[key] = now
        self.counters["storage_notices"] += 1
        notice = StorageUnavailable(fault.notice(now), retry=True)
        self.wire.send_error(item.ident, notice, req=item.req.req)

    def _charge_fetches(self, cache: PieceCache) -> None:
        """Add the bytes the cache fetched for each job since the last call to it."""
        jobs = self.registry.jobs
        for jid, nbytes in cache.take_fetched().items():
            job = jobs.get(jid)
            if job is not None:
                job.fetched_bytes += nbytes

    def _sweep(self, cache: PieceCache, now: float) -> None:
        """Release the pins of requests whose connection or job is gone (a reconnected
        client asks again on its new connection: those pieces are pinned anew). A
        connection with a parked request is not idle: its client waits for the server,
        which must not forget it (``--peer-timeout-s``) however long storage is away."""
        peers, jobs = self.registry.peers, self.registry.jobs
        for key, item in list(self._held.items()):
            peer = peers.get(item.ident)
            if peer is None or item.jid not in jobs or peer.job != item.jid:
                del self._held[key]
                cache.release(item.waiter)
        kept = []
        for item in self._parked:
            peer = peers.get(item.ident)
            if peer is None or item.jid not in jobs or peer.job != item.jid:
                cache.release(item.waiter)
            else:
                peer.last_seen = max(peer.last_seen, now)
                kept.append(item)
        self._parked = kept
        stale = now - 10 * NOTICE_EVERY_S
        self._noticed = {k: t for k, t in self._noticed.items() if t >= stale}
