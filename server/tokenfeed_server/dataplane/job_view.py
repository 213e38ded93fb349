"""One job as ``/v1/jobs`` shows it (:func:`job_view`), and the final views of the jobs
the data plane has forgotten (:class:`EndedJobs`).

A job leaves the data plane's table when its TTL runs out with no connection, or when a
new job of its tenant needs the room. Without a record its counters vanish with it, and
an operator who looks a second late sees nothing (or a resumed job's fresh zeros). So
the registry hands every job it drops to :class:`EndedJobs`, which keeps the job's last
view (plain dicts, never the job: a job holds its open datasets and mixture tables,
which must be released) for the last :data:`MAX_ENDED` jobs, bounded in count and so in
bytes (estimated for the server's memory figures, owner ``ended_jobs``).
"""

from __future__ import annotations

import collections
import sys
import time
from typing import Any

from tokenfeed_server.dataplane.jobs import Job

__all__ = ["MAX_ENDED", "EndedJobs", "job_view"]

#: How many forgotten jobs keep their final view (the oldest is dropped first).
MAX_ENDED = 64


def job_view(job: Job, now: float, *, workers: int, queued: int) -> dict[str, Any]:
    """One job as ``/v1/jobs`` shows it (a :class:`~tokenfeed_server.http.models.JobView`)
    at monotonic ``now``: its rates are sampled here, so call it once per snapshot."""
    windows = job.feed.n_windows
    served_rate = job.served_rate.sample(now, job.tokens)
    consumed_rate = 0.0
    if job.consumed >= 0:
        # Tokens the model reads: seq_len per window (the +1 is the last label).
        consumed_rate = job.consumed_rate.sample(now, job.consumed * job.spec.seq_len)
    return {
        "id": job.id,
        "tenant": job.tenant,
        "dataset": job.feed.label,
        "run": job.spec.run or None,
        "seq_len": job.spec.seq_len,
        "batch_size": job.spec.batch_size,
        "seed": job.spec.seed,
        "world_size": job.spec.world_size,
        "weight": job.weight,
        "workers": workers,
        "requests": job.requests,
        "batches_served": job.batches,
        "tokens_served": job.tokens,
        "bytes_fetched": job.fetched_bytes,
        "fetched_per_served": _fetched_per_served(job),
        "tokens_per_s": round(served_rate, 1),
        "position": job.position,
        "epoch": job.position // windows,
        "consumed_position": job.consumed if job.consumed >= 0 else None,
        "consumed_epoch": job.consumed // windows if job.consumed >= 0 else None,
        "consumed_tokens_per_s": round(consumed_rate, 1),
        "epoch_windows": windows,
        "idle_s": round(max(0.0, now - job.last_active), 1),
        "retransmits": job.retransmits,
        "queued": queued,
        "created": job.created,
        "ended": job.ended,
        "forgotten": False,
        "resumed_at": job.resumed_at,
        "resumed_clients": job.resumed_clients,
        "skipped": [list(r) for r in job.skipped],
        **job.feed.describe(job.position, job.consumed),
    }


class EndedJobs:
    """The final views of the last :data:`MAX_ENDED` jobs the data plane forgot, newest
    last; a job that comes back (same id) replaces its old entry when it is forgotten
    again, and is not listed twice meanwhile (:meth:`views` skips live ids)."""

    def __init__(self, limit: int = MAX_ENDED) -> None:
        self.limit = limit
        # id -> (final view, monotonic time it was forgotten, estimated bytes)
        self._kept: collections.OrderedDict[str, tuple[dict[str, Any], float, int]] = (
            collections.OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, job: Job, now: float) -> None:
        """Record ``job``'s final view at monotonic ``now``, as it leaves the table. Its
        rates are 0 (it is over); a job that never said bye ends now (TTL or eviction)."""
        if job.ended is None:
            job.ended = time.time()
        view = job_view(job, now, workers=0, queued=0)
        view.update(forgotten=True, tokens_per_s=0.0, consumed_tokens_per_s=0.0)
        self._kept.pop(job.id, None)
        self._kept[job.id] = (view, job.last_active, _deep_size(view))
        while len(self._kept) > self.limit:
            self._kept.popitem(last=False)

    def views(self, now: float, live: set[str] | dict[str, Any]) -> list[dict[str, Any]]:
        """The kept views at monotonic ``now``, newest first, without ids in ``live``;
        ``idle_s`` counts on from the job's last request."""
        return [
            {**view, "idle_s": round(max(0.0, now - last_active), 1)}
            for jid, (view, last_active, _) in reversed(self._kept.items())
            if jid not in live
        ]

    def held_bytes(self) -> int:
        """Estimated bytes of the kept views (owner ``ended_jobs`` of the memory figures)."""
        if not self._kept:
            return 0
        each = sys.getsizeof((None, 0.0, 0)) + sys.getsizeof(0.0)
        return sys.getsizeof(self._kept) + sum(
            size + each + sys.getsizeof(jid) for jid, (_, _, size) in self._kept.items()
        )


def _fetched_per_served(job: Job) -> float | None:
    """Bytes fetched from object storage per byte served (None before any is served)."""
    served = job.tokens * job.feed.first.dataset.dtype.itemsize
    return round(job.fetched_bytes / served, 3) if served else None


def _deep_size(obj: object) -> int:
    """``sys.getsizeof`` of a view and everything in it (dicts, lists, scalars): the view
    is made of plain JSON values, so this walk is complete."""
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(_deep_size(k) + _deep_size(v) for k, v in obj.items())
    elif isinstance(obj, list | tuple):
        size += sum(_deep_size(v) for v in obj)
    return size
