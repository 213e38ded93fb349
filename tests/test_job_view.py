"""A job's view in ``/v1/jobs``: its end (``ended``), its final counters kept once the
data plane forgets it (``?forgotten=true``, bounded), and the snapshot's age.

The bound is checked on :class:`~tokenfeed_server.dataplane.job_view.EndedJobs` itself
(real jobs over a real dataset); the rest over a real server process whose jobs are
forgotten two seconds after their trainer leaves.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from live_server import LiveServer
from shard_data import BYTE
from tokenfeed.plan import Plan
from tokenfeed.protocol import JobSpec
from tokenfeed_server.dataplane.job_view import EndedJobs
from tokenfeed_server.dataplane.jobs import Job
from tokenfeed_server.http.routes.jobs import AGE_HEADER
from tokenfeed_server.store import Dataset, open_dataset, write_dataset
from tokenfeed_server.store.mixing import Feed, Source
from waiting import wait_until

DOCS = [np.arange(n, dtype=np.uint16) % 256 for n in range(100, 2100, 100)]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    write_dataset(root, "alpha", DOCS, tokenizer=BYTE, shuffle_seed=0)
    return root


@pytest.fixture
def dataset(store: Path) -> Iterator[Dataset]:
    ds = open_dataset(store, "alpha")
    try:
        yield ds
    finally:
        ds.close()


def a_job(ds: Dataset, seed: int, batches: int) -> Job:
    plan = Plan(ds.n_tokens, 64, 2, 1, seed)
    job = Job(
        f"job-{seed}", JobSpec("alpha", 64, 2, seed, 1), Feed((Source("alpha", ds, plan),)), "t"
    )
    job.batches, job.position = batches, batches * 2
    return job


def test_ended_jobs_keep_the_last_ones_bounded_newest_first(dataset: Dataset) -> None:
    ended = EndedJobs(limit=3)
    for seed in range(5):
        ended.keep(a_job(dataset, seed, batches=10 + seed), now=100.0 + seed)
    views = ended.views(110.0, live=set())
    assert [v["id"] for v in views] == ["job-4", "job-3", "job-2"]  # the oldest dropped
    assert [v["batches_served"] for v in views] == [14, 13, 12]  # final counters
    assert all(v["forgotten"] and v["ended"] is not None for v in views)
    assert all(v["tokens_per_s"] == 0.0 == v["consumed_tokens_per_s"] for v in views)
    size = ended.held_bytes()
    assert size > 3 * 1000  # three views of about 40 keys, counted
    # the same job forgotten again replaces its entry; a live id is not listed twice
    ended.keep(a_job(dataset, 3, batches=99), now=120.0)
    assert len(ended) == 3 and ended.held_bytes() < 2 * size
    assert [v["id"] for v in ended.views(121.0, live={"job-4"})] == ["job-3", "job-2"]
    assert ended.views(121.0, live=set())[0]["batches_served"] == 99


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[LiveServer]:
    with LiveServer(store, extra=["--job-ttl-s", "2"]) as srv:
        yield srv


def jobs(server: LiveServer, **params: Any) -> list[dict[str, Any]]:
    answer = server.get("/v1/jobs", params=params)
    assert answer.status_code == 200
    age = float(answer.headers[AGE_HEADER])
    assert 0.0 <= age < 10.0
    listed: list[dict[str, Any]] = answer.json()
    assert all(j["snapshot_age_s"] == pytest.approx(age, abs=0.01) for j in listed)
    return listed


def test_an_ended_job_keeps_its_final_counters_after_it_is_forgotten(
    server: LiveServer,
) -> None:
    server.run_job("alpha")  # two batches, then bye

    def ended() -> dict[str, Any] | None:
        return next((j for j in jobs(server) if j["ended"] is not None), None)

    job = wait_until(ended, 10, "the job ended (bye) in /v1/jobs", interval=0.1)
    assert job["batches_served"] >= 2 and not job["forgotten"] and job["workers"] == 0
    assert job["kind"] == "dataset" and job["run"]  # today's client sends a run id

    def forgotten() -> dict[str, Any] | None:
        if any(j["id"] == job["id"] for j in jobs(server)):
            return None  # still held (its TTL runs)
        return next((j for j in jobs(server, forgotten="true") if j["id"] == job["id"]), None)

    final = wait_until(forgotten, 15, "the job forgotten, with its final view", interval=0.1)
    assert final["forgotten"] and final["ended"] == job["ended"]
    assert final["batches_served"] == job["batches_served"] >= 2  # never 0
    assert final["tokens_served"] == job["tokens_served"]
    assert final["consumed_position"] == job["consumed_position"]
    memory = server.get("/v1/status").json()["memory"]
    assert memory["ended_jobs"] > 0  # the kept views are counted


def test_a_snapshot_age_header_comes_even_without_jobs(server: LiveServer) -> None:
    answer = server.get("/v1/jobs")
    assert float(answer.headers[AGE_HEADER]) >= 0.0
