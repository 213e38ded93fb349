"""``get``: check a request against its connection and job, then queue it on the job.

Nothing is read here: the loop serves queued gets in fair rounds
(:mod:`tokenfeed_server.dataplane.serving`).
"""

from __future__ import annotations

import time

from tokenfeed import protocol
from tokenfeed.errors import ProtocolError, RequestRejected, ServerError
from tokenfeed_server.dataplane.registry import Registry

__all__ = ["accept_get"]


def accept_get(registry: Registry, ident: bytes, tenant: str, msg: protocol.Get) -> None:
    """Queue get ``msg`` of connection ``ident``, or raise the refusal to answer."""
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
    job.requests += 1
    job.last_active = time.monotonic()
    marks = job.high_water.setdefault(peer.name, {})
    if msg.pos <= marks.get(msg.rank, -1):
        job.retransmits += 1
    marks[msg.rank] = max(marks.get(msg.rank, -1), msg.pos)
    registry.queue.push(job.id, (ident, msg))
