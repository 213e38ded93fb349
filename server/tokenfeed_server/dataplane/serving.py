"""Serving queued gets: assemble each request's rows and send them as one chunk.

Serving a request is a pure function of the request (see
:func:`tokenfeed_server.store.assemble`), so the server holds no cursor and a restarted
server answers re-sent requests exactly as the old one would have. A request whose
pieces of a remote store are not in the cache yet is *parked* (nothing read) and queued
again once they are, so a slow object store never blocks the loop.
"""

from __future__ import annotations

import collections
import logging

from tokenfeed import protocol
from tokenfeed.errors import ServerError, StoreError
from tokenfeed_server.dataplane.registry import Registry
from tokenfeed_server.dataplane.scheduler import TokenBucket
from tokenfeed_server.dataplane.wire import Wire
from tokenfeed_server.logbudget import LogBudget
from tokenfeed_server.store import wire_error
from tokenfeed_server.store.cache import PieceCache
from tokenfeed_server.store.waiters import NotResident, Waiter

__all__ = ["Serving"]

log = logging.getLogger(__name__)


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
    ) -> None:
        self.wire = wire
        self.registry = registry
        self.cache = cache
        self.bucket = bucket
        self.counters = counters
        self._log_budget = log_budget
        # Requests waiting for pieces of a remote store: (waiter, jid, connection, get);
        # and the waiters of requests re-queued last turn, released after their retry.
        self._parked: list[tuple[Waiter, str, bytes, protocol.Get]] = []
        self._retried: list[Waiter] = []

    def serve(self, jid: str, ident: bytes, req: protocol.Get) -> int:
        """Answer one queued get; return the bytes sent (its cost in the fair queue)."""
        peer = self.registry.peers.get(ident)
        job = self.registry.jobs[jid]
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
            message = (
                f"dataset {job.feed.label!r} cannot be read on the server (a shard "
                "changed under it); the operator should check the server log and rebuild it"
            )
            self.wire.send_error(ident, wire_error(exc, message), req=req.req)
            return 0
        except Exception:  # a bug: keep the cause in the log, let the client retry
            if self._log_budget.take():
                log.exception("cannot assemble %s for job %s", req, job.id)
            message = "the server could not read the dataset; the operator should check its log"
            self.wire.send_error(ident, ServerError(message, retry=True), req=req.req)
            return 0
        if not self.wire.send(ident, protocol.chunk_frames(req.req, tokens, rows)):
            return 0
        job.batches += req.count
        job.tokens += tokens.size
        end = req.pos + (req.count - 1) * req.stride * job.plan.global_batch
        job.position = max(job.position, end + job.plan.global_batch)
        self.counters["chunks"] += 1
        self.counters["bytes_sent"] += tokens.nbytes
        self.bucket.spend(tokens.size)
        return int(tokens.nbytes)

    def unpark(self) -> None:
        """Each loop turn: unpin the pieces of requests retried last turn, re-queue the
        parked requests whose pieces are in (their job's turn serves them now), and fail
        those whose pieces stay unreadable, with an error naming the object."""
        cache = self.cache
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
            peer = self.registry.peers.get(ident)
            job = self.registry.jobs.get(jid)
            if peer is None or job is None or peer.job != jid:
                cache.release(waiter)  # its connection or job went away meanwhile
                continue
            if waiter.error is not None:
                cache.release(waiter)
                peer.queued -= 1
                self.counters["err_unreadable"] += 1
                if self._log_budget.take():
                    log.error("job %s: %s", job.id, waiter.error)
                message = f"dataset {job.feed.label!r} cannot be served: {waiter.error}"
                self.wire.send_error(ident, wire_error(waiter.error, message), req=req.req)
                continue
            self._retried.append(waiter)
            self.registry.queue.push(jid, (ident, req))
        self._parked = waiting
