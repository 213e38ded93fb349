"""``get``: check a request against its connection and job, then queue it on the job.

Nothing is read here: the loop serves queued gets in fair rounds
(:mod:`tokenfeed_server.dataplane.serving`).
"""

from __future__ import annotations

import collections
import time

from tokenfeed import protocol
from tokenfeed.errors import ProtocolError, RequestRejected, ServerError
from tokenfeed_server.dataplane.jobs import Job
from tokenfeed_server.dataplane.registry import Registry

__all__ = ["accept_get"]


def accept_get(
    registry: Registry,
    ident: bytes,
    tenant: str,
    msg: protocol.Get,
    counters: collections.Counter[str] | None = None,
) -> None:
    """Queue get ``msg`` of connection ``ident``, or raise the refusal to answer.

    A client (a DataLoader worker, by name) whose first get to this job here reports a
    consumed position above 0 is counted (``clients_resumed`` in ``counters`` and on the
    job; the job's ``resumed_at`` is that position when it was the job's first get
    here): its training loop took batches before this server served it any. A hello
    carries no position or history, so this is the server's honest sign of a failover
    from another replica; a restart of this server, a client forgotten after silence,
    and a resume from a checkpoint look the same.
    """
    peer = registry.peers.get(ident)
    job = registry.jobs.get(msg.job)
    if peer is None or job is None or peer.job != msg.job or peer.tenant != tenant:
        # After a server restart the client's job is unknown here: it says hello again
        # and re-sends; the answer will be identical because requests are pure. This is
        # the documented recovery path, not a fault: quiet, and counted under its code.
        raise ServerError.from_code(
            "unknown_job",
            f"job {msg.job!r} is not attached on this connection; send hello first",
            retry=True,
            quiet=True,
        )
    peer.last_seen = time.monotonic()
    registry.note_consumed(job.id, msg.consumed)
    if not 0 <= msg.rank < job.spec.world_size:
        raise ProtocolError(f"rank {msg.rank} outside [0, {job.spec.world_size})")
    if not 1 <= msg.count <= job.max_count:
        raise ProtocolError(f"count {msg.count} is outside [1, max_count={job.max_count}]")
    if msg.stride < 1 or msg.pos < 0:
        raise ProtocolError("pos must be >= 0 and stride >= 1")
    if peer.queued >= peer.window:
        raise RequestRejected(
            f"more than window={peer.window} requests outstanding on one connection; "
            "wait for a chunk before sending another get",
        )
    last = msg.pos + (msg.count - 1) * msg.stride * job.plan.global_batch
    if last + job.plan.global_batch >= 1 << 62:
        raise ProtocolError("stream position would overflow int64")
    peer.queued += 1
    if msg.consumed > 0 and peer.name not in job.high_water:
        _note_resumed(job, msg.consumed, counters)
    job.requests += 1
    job.last_active = time.monotonic()
    marks = job.high_water.setdefault(peer.name, {})
    if msg.pos <= marks.get(msg.rank, -1):
        job.retransmits += 1
    marks[msg.rank] = max(marks.get(msg.rank, -1), msg.pos)
    registry.queue.push(job.id, (ident, msg))


def _note_resumed(job: Job, consumed: int, counters: collections.Counter[str] | None) -> None:
    """Count a client that arrived at ``job`` already past ``consumed`` 0 (see
    :func:`accept_get`)."""
    job.resumed_clients += 1
    if job.requests == 0:
        job.resumed_at = consumed
    if counters is not None:
        counters["clients_resumed"] += 1
