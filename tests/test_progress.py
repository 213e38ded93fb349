"""True progress: the server shows what the training loop consumed, not only what it sent.

A real server, real loopback sockets, real DataLoader workers. The trainers count the
batches they take; ``/v1/jobs`` must never show more than that, lag by at most the request
window plus the DataLoader's prefetch while the loop runs, and show it exactly once the
loop pauses (the loader's own report) or ends (the last batches too). The rate is checked
with a clock of the test's making (:class:`tokenfeed_server.dataplane.rates.Rate`), since a rate
measured on a loaded machine is no fact to assert.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from live_server import LiveServer
from shard_data import BYTE
from tokenfeed import TokenFeedDataset, TokenFeedLoader, protocol
from tokenfeed.training.consumed import ConsumedCounter
from tokenfeed_server.dataplane.rates import Rate
from tokenfeed_server.store import write_dataset
from waiting import wait_until

pytestmark = pytest.mark.network

SEQ = 32
WINDOW = 3  # requests in flight per worker
PER_CHUNK = 2  # batches per request: the client asks for chunks of this many batches
PREFETCH = 2  # DataLoader items per worker


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("store")
    rng = np.random.default_rng(11)
    docs = [rng.integers(0, 256, size=int(n), dtype=np.uint16) for n in rng.integers(20, 300, 200)]
    write_dataset(root, "text", docs, tokenizer=BYTE, shuffle_seed=0)
    with LiveServer(root) as srv:
        yield srv


def make(
    server: LiveServer, *, batch_size: int, seed: int, rank: int = 0, world_size: int = 1, **kw: Any
) -> TokenFeedDataset:
    # Small requests, so that the tolerance (window x request + prefetch) is a few batches.
    return TokenFeedDataset(
        server.zmq, "text", seq_len=SEQ, batch_size=batch_size, seed=seed, rank=rank,
        world_size=world_size, window=WINDOW, request_timeout=5.0, deadline=30.0,
        **{"chunk_bytes": PER_CHUNK * batch_size * (SEQ + 1) * 2, **kw},
    )  # fmt: skip


def job_of(server: LiveServer, seed: int) -> dict[str, Any] | None:
    return next((j for j in server.get("/v1/jobs").json() if j["seed"] == seed), None)


def wait_for(
    server: LiveServer, seed: int, done: Callable[[dict[str, Any]], bool], timeout: float = 20.0
) -> dict[str, Any]:
    """The job once ``done`` holds for it (the snapshot is refreshed twice a second)."""

    def ready() -> dict[str, Any] | None:
        job = job_of(server, seed)
        return job if job is not None and done(job) else None

    return wait_until(ready, timeout, f"job of seed {seed} in the state asked for")


def tolerance(num_workers: int, batches_per_item: int, global_batch: int) -> int:
    """Positions the server's view may lag the loop by: the request window of every
    connection plus what the DataLoader (or the receiver thread) holds ready."""
    connections = max(1, num_workers)
    window = connections * WINDOW * PER_CHUNK
    # num_workers=0: one chunk waiting in the receiver's queue, one being taken; else the
    # items prefetched per worker and the item being unpacked
    ready = 2 * PER_CHUNK if not num_workers else (num_workers * PREFETCH + 1) * batches_per_item
    return (window + ready) * global_batch


@pytest.mark.parametrize(
    ("num_workers", "batch_size", "batches_per_item", "seed"),
    [(0, 4, 1, 101), (2, 3, 1, 102), (2, 5, 2, 103)],
)
def test_consumed_position_follows_the_loop(
    server: LiveServer, num_workers: int, batch_size: int, batches_per_item: int, seed: int
) -> None:
    """While the loop runs the server is never ahead of it and lags by at most the
    tolerance (no report of the loader's own: requests carry the position); then, at a
    pause, the loader's report makes it exact; and the last batches are reported."""
    steps = 60
    ds = make(server, batch_size=batch_size, seed=seed, samples=steps * batch_size)
    ds.batches_per_item = batches_per_item
    ds.auto_batches_per_item = False
    loader = TokenFeedLoader(ds, num_workers=num_workers, prefetch=PREFETCH, report_after=None)
    slack = tolerance(num_workers, batches_per_item, batch_size)
    counted = 0
    for step, batch in enumerate(loader):
        counted += batch["input_ids"].shape[0]  # one rank: positions == rows taken
        job = job_of(server, seed)
        reported = None if job is None else job["consumed_position"]
        assert reported is None or reported <= counted, (step, reported, counted)
        if step == 30:
            # Pause here: what the requests carried reaches the server within the tolerance.
            job = wait_for(
                server, seed, lambda j, at=counted: (j["consumed_position"] or 0) >= at - slack
            )
            assert job["consumed_position"] <= counted
            assert job["position"] > job["consumed_position"]  # prefetched ahead of it
    assert counted == steps * batch_size == loader.position
    # The loop is over: its last batches are reported too, exactly.
    job = wait_for(server, seed, lambda j: j["consumed_position"] == counted)
    assert job["consumed_epoch"] == counted // job["epoch_windows"]
    assert job["consumed_tokens_per_s"] > 0  # it was training a moment ago


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_pause_is_reported_exactly(server: LiveServer, num_workers: int) -> None:
    """A loop paused (evaluation, a checkpoint) is shown where it stopped, not where the
    last request left it: the loader reports what no request carried."""
    seed = 200 + num_workers
    # One request holds the whole run: no request is sent after the first, so only the
    # loader's own report can tell the server where the loop stopped.
    ds = make(server, batch_size=4, seed=seed, samples=60 * 4, chunk_bytes=1 << 20)
    loader = TokenFeedLoader(ds, num_workers=num_workers, prefetch=PREFETCH, report_after=0.2)
    counted = 0
    for step, batch in enumerate(loader):
        counted += batch["input_ids"].shape[0]
        if step in (7, 25):
            job = wait_for(server, seed, lambda j, at=counted: j["consumed_position"] == at)
            assert job["consumed_epoch"] == counted // job["epoch_windows"]
            assert job["position"] > counted  # what was sent is further on
        if step == 25:
            break
    assert loader.position == counted


def test_two_ranks_report_the_global_position(server: LiveServer) -> None:
    """Positions count samples of all ranks: two ranks in step, 3 rows each, reach 6 per
    step, and the consumed rate counts every rank's tokens once."""
    seed, steps = 301, 40
    loaders = [
        TokenFeedLoader(
            make(server, batch_size=3, seed=seed, rank=r, world_size=2, samples=steps * 6),
            num_workers=0,
            report_after=None,
        )
        for r in range(2)
    ]
    taken = sum(1 for _ in zip(*loaders, strict=True))
    assert taken == steps and [ld.position for ld in loaders] == [steps * 6] * 2
    job = wait_for(server, seed, lambda j: j["consumed_position"] == steps * 6)
    assert job["world_size"] == 2 and job["consumed_epoch"] == steps * 6 // job["epoch_windows"]


def test_a_dataset_iterated_directly_reports_its_position(server: LiveServer) -> None:
    seed = 401
    ds = make(server, batch_size=2, seed=seed, samples=25 * 2)
    assert sum(1 for _ in ds) == 25
    wait_for(server, seed, lambda j: j["consumed_position"] == 50)
    assert ds.consumed is None  # the counter lives only while the loop runs


def test_metrics_show_both_positions(server: LiveServer) -> None:
    seed = 501
    loader = TokenFeedLoader(make(server, batch_size=2, seed=seed, samples=20), num_workers=0)
    assert sum(1 for _ in loader) == 10
    job = wait_for(server, seed, lambda j: j["consumed_position"] == 20)
    families = {f.name: f for f in text_string_to_metric_families(server.get("/metrics").text)}
    mine = {
        name: [s.value for s in families[name].samples if s.labels["job_id"] == job["id"]]
        for name in ("tokenfeed_consumed_position", "tokenfeed_served_position")
    }
    assert mine["tokenfeed_consumed_position"] == [20]
    assert mine["tokenfeed_served_position"] == [job["position"]]
    assert "tokenfeed_consumed_tokens_per_second" in families


def test_a_job_that_never_reported_shows_null(server: LiveServer) -> None:
    """An older client (no consumed field): the served figures, and null for consumed."""
    hello = protocol.Hello(
        dataset="text", seq_len=SEQ, batch_size=2, seed=601, world_size=1, rank=0, worker=0,
        window=2, client="old-client",
    )  # fmt: skip
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(server.zmq)
        sock.send(hello.header())
        assert sock.poll(10_000), "no welcome"
        welcome = protocol.decode_header(sock.recv())
        assert isinstance(welcome, protocol.Welcome)
        sock.send(protocol.Get(req=0, job=welcome.job, rank=0, pos=0, count=1, stride=1).header())
        assert sock.poll(10_000), "no chunk"
        sock.recv_multipart()
        job = wait_for(server, 601, lambda j: j["batches_served"] == 1)
        assert job["consumed_position"] is None and job["consumed_epoch"] is None
        assert job["consumed_tokens_per_s"] == 0.0 and job["position"] == 2
    finally:
        sock.close()
        ctx.term()


def test_a_restart_starts_the_consumed_position_again(server: LiveServer) -> None:
    """A trainer restarting from an earlier checkpoint joins the same job id: its old
    position is dropped once nobody is attached, and no report passes what was served."""
    hello = protocol.Hello(
        dataset="text", seq_len=SEQ, batch_size=2, seed=602, world_size=1, rank=0, worker=0,
        window=2, client="restarting",
    )  # fmt: skip
    ctx = zmq.Context()

    def session(consumed: int) -> None:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(server.zmq)
            sock.send(hello.header())
            assert sock.poll(10_000), "no welcome"
            welcome = protocol.decode_header(sock.recv())
            assert isinstance(welcome, protocol.Welcome)
            get = protocol.Get(req=0, job=welcome.job, rank=0, pos=0, count=3, stride=1)
            sock.send(get.header())
            assert sock.poll(10_000), "no chunk"
            sock.recv_multipart()
            sock.send(protocol.Bye(consumed=consumed).header())
        finally:
            sock.close(linger=2000)  # bye is one-way: let it leave

    try:
        session(consumed=2**62)  # a wild report: clamped to what was served (3 batches)
        job = wait_for(server, 602, lambda j: j["consumed_position"] is not None)
        assert job["consumed_position"] == job["position"] == 6
        session(consumed=2)  # the restart: its own, lower position is shown
        job = wait_for(server, 602, lambda j: j["consumed_position"] != 6)
        assert job["consumed_position"] == 2
    finally:
        ctx.term()


# -- the parts, without a server ----------------------------------------------------------


def test_rate_over_a_sliding_window() -> None:
    rate = Rate(10.0)
    assert rate.sample(100.0, 0) == 0.0  # one sample: no rate yet
    assert rate.sample(102.0, 4000) == 2000.0
    assert rate.sample(110.0, 20_000) == 2000.0
    # The first sample leaves the window: the rate is over the last ten seconds only.
    assert rate.sample(111.0, 20_000) == pytest.approx((20_000 - 4000) / 9.0)
    assert rate.sample(125.0, 20_000) == 0.0  # stopped
    assert rate.sample(126.0, 10) == 0.0  # a count that went back (a restart) is not negative


def test_counter_says_what_no_message_carried() -> None:
    counter = ConsumedCounter(96)
    assert counter.position == 96 and counter.unreported  # a start position not yet told
    assert counter.take() == 96 and not counter.unreported
    counter.advance(128)
    assert counter.unreported and counter.position == 128
    assert counter.take() == 128 and not counter.unreported


def test_counter_is_shared_with_worker_processes(tmp_path: Path) -> None:
    """What the loop writes in the main process, a worker reads (fork and spawn)."""
    for method in ("fork", "spawn"):
        counter = ConsumedCounter(0)
        ctx = multiprocessing.get_context(method)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_read_twice, args=(counter, child))
        proc.start()
        try:
            assert parent.poll(30) and parent.recv() == 0
            counter.advance(4242)
            parent.send("again")
            assert parent.poll(30) and parent.recv() == 4242
        finally:
            proc.join(30)
        assert proc.exitcode == 0
        assert not counter.unreported  # the worker's take() was seen here


def _read_twice(counter: ConsumedCounter, conn: Any) -> None:
    conn.send(counter.position)
    conn.recv()
    conn.send(counter.take())
