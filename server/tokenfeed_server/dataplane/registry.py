"""The data plane's tables: the jobs, the connections attached to them, and the fair
queue of their pending gets, kept consistent with each other.

Only the loop thread touches a :class:`Registry`; the HTTP side reads the snapshot the
loop publishes (:mod:`tokenfeed_server.dataplane.snapshot`), never these tables.
"""

from __future__ import annotations

import collections
import time

from tokenfeed import protocol
from tokenfeed.errors import ConnectionLimit
from tokenfeed_server.dataplane.job_view import EndedJobs
from tokenfeed_server.dataplane.jobs import Job, Peer
from tokenfeed_server.dataplane.scheduler import FairQueue
from tokenfeed_server.store.mixture_tables import shared_mixtures

__all__ = ["QueuedGet", "Registry"]

#: a get waiting in its job's queue: (connection, request)
QueuedGet = tuple[bytes, protocol.Get]


class Registry:
    """Jobs by id, connections by ZeroMQ identity, and the gets queued per job."""

    def __init__(self, quantum: float) -> None:
        self.jobs: dict[str, Job] = {}
        self.peers: dict[bytes, Peer] = {}
        # (tenant, client name) -> that client's current connection
        self.by_name: dict[tuple[str, str], bytes] = {}
        #: queued gets per job id, served by deficit round robin (``quantum`` bytes a round)
        self.queue: FairQueue[str, QueuedGet] = FairQueue(quantum)
        #: the final views of the jobs forgotten last (``/v1/jobs?forgotten=true``)
        self.ended = EndedJobs()

    # -- jobs ------------------------------------------------------------------------

    def add_job(self, job: Job) -> None:
        """Start tracking ``job`` in its tenant's group of the fair queue (the tenant's
        weight is its group's share; its jobs split it)."""
        self.jobs[job.id] = job
        self.queue.add(job.id, job.weight, group=job.tenant)

    def drop_job(self, jid: str) -> None:
        """Forget job ``jid`` and its queue, keeping its final view (:class:`EndedJobs`)."""
        self.ended.keep(self.jobs.pop(jid), time.monotonic())
        self.queue.remove(jid)

    def has_peers(self, jid: str) -> bool:
        """True if a connection is attached to job ``jid``."""
        return any(p.job == jid for p in self.peers.values())

    def make_room_for_a_job(self, cap: int, tenant: str = "", tenant_cap: int = 0) -> None:
        """Make room for a new job of ``tenant`` under the server's ``cap`` and the
        tenant's own ``tenant_cap`` (0: none) by forgetting that tenant's longest-idle
        jobs (no connection, nothing queued); never another tenant's, so one tenant can
        not push the others out. ConnectionLimit (retryable) names the cap still full."""
        attached = {p.job for p in self.peers.values()}
        own = [j for j in self.jobs.values() if j.tenant == tenant]
        idle = sorted(
            (j for j in own if j.id not in attached and not self.queue.queued(j.id)),
            key=lambda j: j.last_active,
        )
        excess = max(len(self.jobs) - cap + 1, len(own) - tenant_cap + 1 if tenant_cap else 0, 0)
        for job in idle[:excess]:
            self.drop_job(job.id)
        if tenant_cap and len(own) - min(excess, len(idle)) >= tenant_cap:
            raise ConnectionLimit(
                f"tenant {tenant!r} runs max_jobs_per_tenant={tenant_cap} jobs with "
                "connections; end some (or let them go idle), or ask the operator to raise "
                "the tenant's max_jobs",
                retry=True,
            )
        if len(self.jobs) >= cap:
            raise ConnectionLimit(
                f"the server runs max_jobs={cap} jobs, none of them an idle one of tenant "
                f"{tenant!r}; try again later or ask the operator to raise the limit",
                retry=True,
            )

    def note_consumed(self, jid: str, consumed: int) -> None:
        """Keep the furthest consumed position reported for job ``jid``: workers read the
        trainer's counter at different times, so a report may be older than the last."""
        job = self.jobs.get(jid)
        if job is None:
            return
        # Never past what was served: a wild report must not pin the figure forever.
        consumed = min(consumed, job.position)
        job.consumed = max(job.consumed, consumed)

    # -- connections -----------------------------------------------------------------

    def tenant_connections(self, tenant: str) -> int:
        """How many connections tenant ``tenant`` has attached."""
        return sum(1 for p in self.peers.values() if p.tenant == tenant)

    def replace_reconnected(self, tenant: str, client: str, ident: bytes) -> None:
        """A client that reconnected (new socket, same name) replaces its old connection
        instead of holding two slots until the old one times out."""
        previous = self.by_name.get((tenant, client))  # never another tenant's
        if previous is not None and previous != ident:
            self.forget_peer(previous)

    def register_peer(
        self, ident: bytes, tenant: str, msg: protocol.Hello, job: Job, window: int
    ) -> Peer:
        """Attach connection ``ident`` to ``job`` (moving it off another job if need be)."""
        old = self.peers.get(ident)
        if old is not None and (old.job != job.id or old.name != msg.client):
            # One name per connection: a name left behind would let a later connection
            # under that name pass for this one's reconnect and evict it (and the table
            # of names would grow with every rename). A renamed client's re-send marks go
            # with its old name: kept, they grew the job's record with every rename.
            self.forget_peer(ident, gone=old.name != msg.client)
            old = None
        peer = old or Peer(msg.client, job.id, msg.rank, msg.worker, tenant, window)
        peer.rank, peer.worker = msg.rank, msg.worker
        peer.window, peer.last_seen = window, time.monotonic()
        job.ended = None
        self.peers[ident] = peer
        self.by_name[(tenant, msg.client)] = ident
        return peer

    def forget_peer(self, ident: bytes, *, gone: bool = False) -> None:
        """Drop connection ``ident`` and its queued gets. ``gone``: the client itself is
        done (bye, timeout), not just this socket, so its re-send marks go too."""
        peer = self.peers.pop(ident, None)
        if peer is None:
            return
        if self.by_name.get((peer.tenant, peer.name)) == ident:
            del self.by_name[(peer.tenant, peer.name)]
        job = self.jobs.get(peer.job)
        if job is None:
            return
        if gone:
            job.high_water.pop(peer.name, None)
            if not self.has_peers(job.id):  # its last connection is done: the run ended
                job.ended = time.time()
                # its record stays (counters, until forgotten), its memory goes now: the
                # mixture's tables with the last running job of that mixture
                job.feed = job.feed.closed_feed(job.position, job.consumed)
        if peer.queued:
            self.queue.discard(job.id, lambda item: item[0] == ident)

    # -- expiry ----------------------------------------------------------------------

    def expire(self, now: float, *, peer_timeout_s: float, job_ttl_s: float) -> None:
        """Forget connections silent for ``peer_timeout_s`` and jobs with no connection,
        nothing queued and no activity for ``job_ttl_s``; let go of mixture tables built
        for hellos that a job now holds or nobody came back for."""
        shared_mixtures.sweep(now)
        for ident, peer in list(self.peers.items()):
            if now - peer.last_seen > peer_timeout_s:
                self.forget_peer(ident, gone=True)
        attached = collections.Counter(p.job for p in self.peers.values())
        for jid, job in list(self.jobs.items()):
            if (
                not attached[jid]
                and not self.queue.queued(jid)
                and now - job.last_active > job_ttl_s
            ):
                self.drop_job(jid)
