"""The status snapshot the loop publishes for the HTTP side (``/v1/jobs``, ``/v1/status``,
``/metrics``): plain dicts, rebuilt twice a second, so no handler reads the loop's tables."""

from __future__ import annotations

import collections
import sys
import time
from typing import Any

from tokenfeed_server.dataplane.job_view import job_view
from tokenfeed_server.dataplane.registry import Registry

__all__ = ["EMPTY_SNAPSHOT", "held_versions", "make_snapshot"]

#: what the HTTP side reads before the loop's first snapshot
EMPTY_SNAPSHOT: dict[str, Any] = {
    "jobs": [],
    "ended_jobs": [],
    "taken": None,
    "connections": 0,
    "counters": {},
    "memory": {"jobs": 0, "connections": 0, "ended_jobs": 0},
    "held": {},
}


def make_snapshot(
    registry: Registry,
    now: float,
    *,
    server: str,
    endpoint: str,
    counters: collections.Counter[str],
) -> dict[str, Any]:
    """Every job's view, the forgotten jobs' final views (:mod:`.job_view`), the
    connection count and the loop's counters at monotonic ``now``; ``taken`` is the wall
    time, so the HTTP side can say how old what it shows is."""
    # Workers, not connections: the loader's short progress reports and its hello before
    # starting workers come as (rank, worker 0) too, and are no extra worker.
    workers = {(p.job, p.rank, p.worker) for p in registry.peers.values()}
    per_job = collections.Counter(jid for jid, _, _ in workers)
    jobs = [
        job_view(job, now, workers=per_job[job.id], queued=registry.queue.queued(job.id))
        for job in registry.jobs.values()
    ]
    return {
        "server": server,
        "endpoint": endpoint,
        "taken": time.time(),
        "jobs": jobs,
        "ended_jobs": registry.ended.views(now, registry.jobs),
        "connections": len(registry.peers),
        "counters": dict(counters),
        "memory": registry_bytes(registry),
        "held": held_versions(registry),
    }


def held_versions(registry: Registry) -> dict[str, list[str]]:
    """``{dataset: [fingerprint, ...]}``: every version a job reads (mixture sources
    included), for the server's lease (:mod:`tokenfeed_server.store.leases`), which reads
    it from another thread: hence built here, on the loop thread, with the snapshot."""
    held: dict[str, set[str]] = {}
    for job in registry.jobs.values():
        for source in job.feed.sources:
            held.setdefault(source.name, set()).add(source.dataset.fingerprint)
    return {name: sorted(fps) for name, fps in sorted(held.items())}


def registry_bytes(registry: Registry) -> dict[str, int]:
    """Estimated bytes of the loop's own records: ``jobs`` (each job's record, its re-send
    marks and rate windows; its datasets and mixture tables are counted by the store) and
    ``connections`` (each connection's record and name), ``ended_jobs`` (the final views
    of forgotten jobs, at most :data:`~.job_view.MAX_ENDED`). Computed on the loop thread
    with the snapshot, so the HTTP side never walks tables the loop is changing.
    """
    size = sys.getsizeof
    jobs = size(registry.jobs)
    for job in registry.jobs.values():
        jobs += size(job) + size(job.__dict__) + size(job.high_water)
        jobs += sum(size(name) + size(ranks) for name, ranks in job.high_water.items())
        jobs += job.served_rate.held_bytes() + job.consumed_rate.held_bytes()
    peers = size(registry.peers) + size(registry.by_name)
    for ident, peer in registry.peers.items():
        peers += size(ident) + size(peer) + size(peer.__dict__) + size(peer.name)
    return {
        "jobs": jobs if registry.jobs else 0,
        "connections": peers if registry.peers else 0,
        "ended_jobs": registry.ended.held_bytes(),
    }
