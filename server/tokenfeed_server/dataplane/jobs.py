"""What the data plane keeps per training run (:class:`Job`) and per connection
(:class:`Peer`), and the deterministic id that names a job (:func:`job_id`)."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass, field

from tokenfeed.plan import Plan
from tokenfeed.protocol import JobSpec
from tokenfeed_server.dataplane.rates import Rate
from tokenfeed_server.store.mixing import Feed

__all__ = ["Job", "Peer", "job_id"]

_RATE_WINDOW_S = 10.0


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
    #: when its last connection left (bye or silence; Unix time), None while one is
    #: attached: the page tells a run that ended from one that is training
    ended: float | None = None
    #: the consumed position the job's first request here reported, when above 0: it was
    #: served before elsewhere (another replica: a failover), by this server before a
    #: restart, or the trainer resumed from a checkpoint; None otherwise
    resumed_at: int | None = None
    #: clients (workers) whose first request here came from a training loop already past
    #: position 0: failovers from another replica, mostly (see dataplane.gets)
    resumed_clients: int = 0
    #: bytes the piece cache fetched from object storage for this job's reads and plan
    fetched_bytes: int = 0
    #: stream ranges the run skipped on purpose at a resume, ``(position, samples)``, as
    #: its clients' hello says (from the run's state); shown on the page, never served
    skipped: tuple[tuple[int, ...], ...] = ()
    last_active: float = field(default_factory=time.monotonic)
    # client name -> (rank -> highest position asked): a client re-asking at or below its
    # own mark is re-sending (Lazy Pirate after silence or a restart)
    high_water: dict[str, dict[int, int]] = field(default_factory=dict)
    served_rate: Rate = field(default_factory=lambda: Rate(_RATE_WINDOW_S))
    consumed_rate: Rate = field(default_factory=lambda: Rate(_RATE_WINDOW_S))

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
    derived sizes joins the same job as one that leaves them at 0), and the run id: two
    launches with the same inputs are two jobs. A spec without a run id (a client from
    before run ids) keeps exactly the id it had before them.
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
    if spec.run:
        # Appended only when set (and ``run`` is out of the spec's repr, used above): the
        # keys, and so the ids, of jobs without a run are those from before run ids.
        key = f"{key}|run={spec.run}"
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
