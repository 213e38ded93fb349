"""The short soak (issue 28): a churn of jobs leaves the server's own memory figures where
they started. Counts, not timings: the server reports the bytes each owner holds (row
buffer pool, window blocks, mixture tables, job records, per-connection state) in
``/v1/status`` and ``/metrics``; after every job has ended and been forgotten, each is
back at (or under) its baseline. ``benchmarks/soak.py`` is the long version with RSS.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from live_server import LiveServer
from shard_data import BYTE
from tokenfeed import Mixture, TokenFeedDataset
from tokenfeed_server.store import write_dataset
from waiting import wait_until

pytestmark = [pytest.mark.network, pytest.mark.slow]

NAMES = ("web", "code")
#: what the server counts per owner; every one of them must be reported
OWNERS = ("row_buffers", "window_blocks", "mixture_tables", "jobs", "connections")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("store")
    rng = np.random.default_rng(5)
    for i, name in enumerate(NAMES):
        docs = [
            rng.integers(0, 256, size=int(n), dtype=np.uint16) for n in rng.integers(20, 900, 300)
        ]
        write_dataset(root, name, docs, tokenizer=BYTE, shuffle_seed=i, shard_tokens=1 << 15)
    # jobs forgotten 1 s after their trainer leaves; pools released after 1 s idle
    extra = ["--job-ttl-s", "1", "--memory-idle-s", "1"]
    with LiveServer(root, extra=extra) as srv:
        yield srv


def memory(server: LiveServer) -> dict[str, int]:
    return {k: int(v) for k, v in server.get("/v1/status").json()["memory"].items()}


def train(server: LiveServer, rng: random.Random, seed: int) -> int:
    """One short job of a random shape; the batches it got."""
    data: Any = rng.choice(NAMES)
    if rng.random() < 0.4:
        data = Mixture(
            [
                (0, {"web": rng.randint(1, 7), "code": rng.randint(1, 5)}),
                (64, {"web": 1, "code": 1}),
            ]
        )
    batch = rng.choice([1, 2, 4, 8])
    ds = TokenFeedDataset(
        server.zmq, data, seq_len=rng.choice([15, 31, 63, 100, 127]), batch_size=batch,
        seed=seed, rank=0, world_size=1, samples=batch * rng.randint(2, 12),
        shuffle=rng.choice(["global", "block"]), deadline=30.0,
    )  # fmt: skip
    return sum(1 for _ in ds)


def test_memory_by_owner_returns_to_baseline_after_churn(server: LiveServer) -> None:
    rng = random.Random(3)
    assert train(server, rng, seed=0) > 0  # warm-up: imports, first pools
    wait_until(lambda: not server.get("/v1/jobs").json(), 30, "end of the warm-up job")
    baseline = wait_until(lambda: memory(server), 10, "memory figures")
    assert set(OWNERS) <= set(baseline), baseline
    peak: dict[str, int] = dict(baseline)
    for seed in range(1, 301):
        assert train(server, rng, seed) > 0
        if seed % 25 == 0:
            for owner, held in memory(server).items():
                peak[owner] = max(peak.get(owner, 0), held)
    assert peak["jobs"] > baseline["jobs"], "the job records were never counted"

    def settled() -> dict[str, int] | None:
        now = memory(server)
        back = all(now[o] <= baseline[o] for o in OWNERS) and not server.get("/v1/jobs").json()
        return now if back else None

    final = wait_until(settled, 30, f"memory back to its baseline {baseline}", interval=0.25)
    assert final["mixture_tables"] <= baseline["mixture_tables"]
    # the same figures reach /metrics, one series per owner
    families = {f.name: f for f in text_string_to_metric_families(server.get("/metrics").text)}
    owners = {s.labels["owner"] for s in families["tokenfeed_memory_bytes"].samples}
    assert set(OWNERS) <= owners, owners
