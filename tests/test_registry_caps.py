"""Job caps without sockets: one tenant can not fill the job table or push others out.

The registry is the data plane's table of jobs and connections; its caps are pure
bookkeeping, so they are tested on it directly (the admission path that calls it is
covered end to end in tests/test_security.py).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from tokenfeed.errors import ConnectionLimit
from tokenfeed_server.dataplane.jobs import Job, Peer
from tokenfeed_server.dataplane.registry import Registry


def job(registry: Registry, jid: str, tenant: str, *, attached: bool = False) -> Job:
    made = Job(jid, cast(Any, None), cast(Any, None), tenant)
    registry.add_job(made)
    if attached:
        registry.peers[jid.encode()] = Peer(f"c-{jid}", jid, 0, 0, tenant, 4)
    return made


def test_the_global_cap_never_evicts_another_tenants_job() -> None:
    reg = Registry(quantum=1000)
    for i in range(4):
        job(reg, f"bob-{i}", "bob")  # bob's jobs are idle (a run between checkpoints)
    for i in range(4):
        job(reg, f"alice-{i}", "alice", attached=True)
    with pytest.raises(ConnectionLimit, match=r"max_jobs=8.*tenant 'alice'") as refused:
        reg.make_room_for_a_job(8, "alice")
    assert refused.value.retry
    assert len(reg.jobs) == 8  # bob's idle jobs are still there for him to resume
    # bob himself makes room from his own idle jobs
    reg.make_room_for_a_job(8, "bob")
    assert len(reg.jobs) == 7 and "bob-0" not in reg.jobs


def test_a_tenant_cap_forgets_the_tenants_own_idle_jobs_first() -> None:
    reg = Registry(quantum=1000)
    for i in range(3):
        job(reg, f"alice-{i}", "alice")
    job(reg, "alice-busy", "alice", attached=True)
    job(reg, "bob-0", "bob")
    reg.make_room_for_a_job(100, "alice", tenant_cap=4)
    assert "alice-0" not in reg.jobs and {"alice-1", "alice-2", "bob-0"} <= set(reg.jobs)
    for i in range(3):
        reg.peers[f"x{i}".encode()] = Peer(f"x{i}", f"alice-{i + 1}", 0, 0, "alice", 4)
    job(reg, "alice-3", "alice", attached=True)
    with pytest.raises(ConnectionLimit, match=r"tenant 'alice' runs max_jobs_per_tenant=4"):
        reg.make_room_for_a_job(100, "alice", tenant_cap=4)
    reg.make_room_for_a_job(100, "bob", tenant_cap=4)  # bob is not limited by alice


def test_renames_do_not_grow_a_jobs_resend_record() -> None:
    reg = Registry(quantum=1000)
    made = job(reg, "j", "alice")
    for i in range(1000):  # one connection says hello again and again, under new names
        hello = cast(Any, SimpleNamespace(client=f"name-{i}", rank=0, worker=0))
        reg.register_peer(b"conn", "alice", hello, made, 4)
        made.high_water.setdefault(f"name-{i}", {})[0] = i  # what a get would record
    assert len(made.high_water) == 1 and len(reg.by_name) == 1 and len(reg.peers) == 1
