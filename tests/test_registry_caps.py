"""Job caps without sockets: one tenant can not fill the job table or push others out.

The registry is the data plane's table of jobs and connections; its caps are pure
bookkeeping, so they are tested on it directly (the admission path that calls it is
covered end to end in tests/test_security.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from shard_data import BYTE
from tokenfeed.errors import ConnectionLimit
from tokenfeed.plan import Plan
from tokenfeed.protocol import Hello, JobSpec
from tokenfeed_server.dataplane.jobs import Job, Peer
from tokenfeed_server.dataplane.registry import Registry
from tokenfeed_server.store import Dataset, open_dataset, write_dataset
from tokenfeed_server.store.mixing import Feed, Source


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dataset]:
    root = tmp_path_factory.mktemp("caps")
    docs = [np.arange(500, dtype=np.uint16) % 256 for _ in range(4)]
    write_dataset(root, "alpha", docs, tokenizer=BYTE, shuffle_seed=0)
    ds = open_dataset(root, "alpha")
    try:
        yield ds
    finally:
        ds.close()


def job(registry: Registry, ds: Dataset, jid: str, tenant: str, *, attached: bool = False) -> Job:
    plan = Plan(ds.n_tokens, 64, 2, 1, 0)
    feed = Feed((Source("alpha", ds, plan),))
    made = Job(jid, JobSpec("alpha", 64, 2, 0, 1), feed, tenant)
    registry.add_job(made)
    if attached:
        registry.peers[jid.encode()] = Peer(f"c-{jid}", jid, 0, 0, tenant, 4)
    return made


def test_the_global_cap_never_evicts_another_tenants_job(dataset: Dataset) -> None:
    reg = Registry(quantum=1000)
    for i in range(4):
        job(reg, dataset, f"bob-{i}", "bob")  # bob's jobs are idle (a run between checkpoints)
    for i in range(4):
        job(reg, dataset, f"alice-{i}", "alice", attached=True)
    with pytest.raises(ConnectionLimit, match=r"max_jobs=8.*tenant 'alice'") as refused:
        reg.make_room_for_a_job(8, "alice")
    assert refused.value.retry
    assert len(reg.jobs) == 8  # bob's idle jobs are still there for him to resume
    # bob himself makes room from his own idle jobs
    reg.make_room_for_a_job(8, "bob")
    assert len(reg.jobs) == 7 and "bob-0" not in reg.jobs


def test_a_tenant_cap_forgets_the_tenants_own_idle_jobs_first(dataset: Dataset) -> None:
    reg = Registry(quantum=1000)
    for i in range(3):
        job(reg, dataset, f"alice-{i}", "alice")
    job(reg, dataset, "alice-busy", "alice", attached=True)
    job(reg, dataset, "bob-0", "bob")
    reg.make_room_for_a_job(100, "alice", tenant_cap=4)
    assert "alice-0" not in reg.jobs and {"alice-1", "alice-2", "bob-0"} <= set(reg.jobs)
    for i in range(3):
        reg.peers[f"x{i}".encode()] = Peer(f"x{i}", f"alice-{i + 1}", 0, 0, "alice", 4)
    job(reg, dataset, "alice-3", "alice", attached=True)
    with pytest.raises(ConnectionLimit, match=r"tenant 'alice' runs max_jobs_per_tenant=4"):
        reg.make_room_for_a_job(100, "alice", tenant_cap=4)
    reg.make_room_for_a_job(100, "bob", tenant_cap=4)  # bob is not limited by alice


def test_renames_do_not_grow_a_jobs_resend_record(dataset: Dataset) -> None:
    reg = Registry(quantum=1000)
    made = job(reg, dataset, "j", "alice")
    for i in range(1000):  # one connection says hello again and again, under new names
        hello = Hello("alpha", 64, 2, 0, 1, 0, 0, 4, f"name-{i}")
        reg.register_peer(b"conn", "alice", hello, made, 4)
        made.high_water.setdefault(f"name-{i}", {})[0] = i  # what a get would record
    assert len(made.high_water) == 1 and len(reg.by_name) == 1 and len(reg.peers) == 1


def test_a_crash_looping_trainer_does_not_lock_itself_out(dataset: Dataset) -> None:
    """Every launch is a job of its own (a new run id). A trainer that crashes leaves its
    connections behind, silent: once they time out, its old jobs are idle and make room
    for the next launch; one that ends cleanly (bye) makes room at once."""
    reg = Registry(quantum=1000)
    job(reg, dataset, "launch-0", "alice", attached=True)  # crashed: its connection stays
    job(reg, dataset, "launch-1", "alice", attached=True)
    with pytest.raises(ConnectionLimit, match=r"max_jobs_per_tenant=2") as refused:
        reg.make_room_for_a_job(100, "alice", tenant_cap=2)
    assert refused.value.retry  # the relaunch waits and asks again
    silent_since = min(p.last_seen for p in reg.peers.values())
    reg.expire(silent_since + 61.0, peer_timeout_s=60.0, job_ttl_s=600.0)
    assert not reg.peers and all(j.ended is not None for j in reg.jobs.values())
    reg.make_room_for_a_job(100, "alice", tenant_cap=2)  # the crashed launches made room
    assert "launch-0" not in reg.jobs and "launch-1" in reg.jobs
    job(reg, dataset, "launch-2", "alice", attached=True)
    reg.forget_peer(b"launch-2", gone=True)  # a clean end: bye
    reg.make_room_for_a_job(100, "alice", tenant_cap=2)
    assert set(reg.jobs) == {"launch-2"}  # the longest idle launch went first
