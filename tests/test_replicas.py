"""Replicas: several servers over one store behind one job, with nothing lost or repeated.

Real ``tokenfeed-server serve`` processes on loopback, a trainer of 2 ranks x 2
DataLoader workers naming all of them, and the batches compared with a run against a
single server: with one replica SIGKILLed mid-run, with all of them killed and one
restarted, with a host name that resolves to two loopback addresses, and with two
replicas over different builds of the same dataset (refused, never mixed); and with a
replica paused (SIGSTOP) and resumed, whose workers fail over and come back. No test
asserts a duration: the failover pause is measured in ``benchmarks/bench_replicas.py``.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from live_server import LiveServer
from shard_data import BYTE
from tokenfeed import TokenFeedDataset, TokenFeedLoader
from tokenfeed.errors import ConfigError, DatasetChanged, ServerUnavailable
from tokenfeed.protocol import JobSpec
from tokenfeed.transport import replicas
from tokenfeed.transport.client import ClientOptions, FeedClient
from tokenfeed.transport.replicas import Replicas, parse_endpoints
from tokenfeed_server.store import write_dataset
from waiting import wait_until

pytestmark = pytest.mark.network

WORLD, WORKERS, STEPS = 2, 2, 48
KILL_AT = 8  # the step after which servers die: well inside the run, requests in flight
Run = list[list[tuple[torch.Tensor, torch.Tensor]]]  # per rank, per step: (input_ids, window_ids)


def make_store(root: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 256, size=500, dtype=np.uint16) for _ in range(40)]
    write_dataset(root, "alpha", docs, shuffle_seed=0, tokenizer=BYTE)
    return root


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_store(tmp_path_factory.mktemp("store"), 5)


def loader(endpoints: str | Sequence[str], rank: int, *, world: int = WORLD) -> TokenFeedLoader:
    ds = TokenFeedDataset(
        endpoints,
        "alpha",
        seq_len=16,
        batch_size=2,
        rank=rank,
        world_size=world,
        samples=STEPS * 2 * world,
        batches_per_item=1,  # one batch per request and item: many requests in flight
        chunk_bytes=1,
        request_timeout=1.0,
        deadline=60.0,
    )
    return TokenFeedLoader(ds, num_workers=WORKERS, pin_memory=False, prefetch=2)


def run(endpoints: str | Sequence[str], after_step: Callable[[int], None] | None = None) -> Run:
    """Every rank's batches, the ranks stepping together as in a synchronous training
    loop; ``after_step(i)`` runs after step ``i`` (with requests of every worker in flight).
    """
    out: Run = [[] for _ in range(WORLD)]
    loaders = [loader(endpoints, rank) for rank in range(WORLD)]
    for step, batches in enumerate(zip(*loaders, strict=True)):
        for rank, batch in enumerate(batches):
            out[rank].append((batch["input_ids"], batch["window_ids"]))
        if after_step is not None:
            after_step(step)
    return out


def assert_same(got: Run, want: Run) -> None:
    assert [len(r) for r in got] == [STEPS] * WORLD
    for rank, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        for step, ((ids, wids), (ref_ids, ref_wids)) in enumerate(zip(mine, theirs, strict=True)):
            assert torch.equal(wids, ref_wids), (rank, step)
            assert torch.equal(ids, ref_ids), (rank, step)


@pytest.fixture(scope="module")
def reference(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    with LiveServer(store, log_path=tmp_path_factory.mktemp("ref") / "log") as srv:
        return run(srv.zmq)


@pytest.fixture
def three(store: Path, tmp_path: Path) -> Iterator[list[LiveServer]]:
    servers = [LiveServer(store, log_path=tmp_path / f"replica-{i}.log") for i in range(3)]
    try:
        for srv in servers:
            srv.start()
        yield servers
    finally:
        for srv in servers:
            srv.stop()


def batches_served(srv: LiveServer, at_least: int = 1) -> int:
    """The batches this replica served its job, once its status snapshot (refreshed a
    few times a second) shows at least ``at_least``; bounded."""
    served = 0
    for _ in range(200):
        jobs = srv.get("/v1/jobs").json()
        served = sum(j["batches_served"] for j in jobs)
        if served >= at_least:
            return served
        threading.Event().wait(0.05)
    return served


# -- the endpoints --------------------------------------------------------------------------


def test_a_list_and_a_comma_separated_string_name_the_same_replicas() -> None:
    listed = parse_endpoints(["tcp://127.0.0.1:7400", "tcp://10.0.0.2:7400"])
    assert parse_endpoints("tcp://127.0.0.1:7400, tcp://10.0.0.2:7400") == listed
    assert parse_endpoints("tcp://127.0.0.1:7400") == ("tcp://127.0.0.1:7400",)


@pytest.mark.parametrize(
    ("endpoints", "message"),
    [
        ([], "no endpoint given"),
        ("tcp://a:1,tcp://a:1", "given twice"),
        (["tcp://a:1", "b:2"], "'b:2' is not of the form"),
        ("tcp://a:1,", "'' is not of the form"),
        (7400, "got int"),
    ],
)
def test_bad_endpoint_lists_are_refused_naming_the_culprit(endpoints: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_endpoints(endpoints)  # Any: what a user may pass, not what the hint says


def test_a_name_is_resolved_to_every_address_in_a_fixed_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers = {"data": ["127.0.0.3", "127.0.0.2"]}
    monkeypatch.setattr(replicas, "resolve_host", lambda host, port: list(answers[host]))
    spread = [Replicas("tcp://data:7400", slot=s).pick(advance=False) for s in range(3)]
    assert spread == ["tcp://127.0.0.2:7400", "tcp://127.0.0.3:7400", "tcp://127.0.0.2:7400"]
    # a literal address is used as written; a name's addresses are not repeated
    both = Replicas(["tcp://127.0.0.2:7400", "tcp://data:7400"])
    assert both.resolve().addresses == ("tcp://127.0.0.2:7400", "tcp://127.0.0.3:7400")
    # resolved again on each failover: a restarted replica's new address is found
    client = Replicas("tcp://data:7400")
    assert client.pick(advance=False) == "tcp://127.0.0.2:7400"
    answers["data"] = ["127.0.0.2", "127.0.0.9"]
    assert client.pick(advance=True) == "tcp://127.0.0.9:7400"
    assert client.pick(advance=True) == "tcp://127.0.0.2:7400"


def test_localhost_is_one_replica_not_two() -> None:
    # getaddrinfo gives 127.0.0.1 and ::1; a server on one of them is not a dead twin
    assert Replicas("tcp://localhost:7400").resolve().addresses == ("tcp://127.0.0.1:7400",)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_when_every_replica_is_gone_the_error_names_them_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def resolve(host: str, port: int) -> list[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(replicas, "resolve_host", resolve)
    dead = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    options = ClientOptions(deadline=2.0, request_timeout=0.5)
    job = JobSpec("alpha", 16, 2, 0, 1)
    with (
        FeedClient([*dead, "tcp://gone.test:7400"], job, rank=0, worker=0, options=options) as c,
        pytest.raises(ServerUnavailable, match="any tokenfeed replica") as info,
    ):
        c.hello()
    message = str(info.value)
    assert all(endpoint in message for endpoint in dead)
    assert "tcp://gone.test:7400 (can not resolve: Name or service not known)" in message


# -- failover -------------------------------------------------------------------------------


def test_spread_over_three_one_killed_mid_run_gives_the_same_batches(
    three: list[LiveServer], reference: Run
) -> None:
    victim = three[0]  # the first replica of rank 0 worker 0 and rank 1 worker 1

    def kill(step: int) -> None:
        if step == KILL_AT:
            # every replica has served: the workers started spread over all three
            assert all(batches_served(srv) > 0 for srv in three)
            victim.kill()

    got = run([srv.zmq for srv in three], kill)
    assert_same(got, reference)
    assert victim.proc is not None and victim.proc.returncode is not None  # it stayed dead
    # The survivors counted the workers that failed over to them: clients whose first
    # request came from a training loop already past position 0.
    survivors = three[1:]
    moved = sum(srv.settled_counter("clients_resumed") for srv in survivors)
    assert moved >= 1
    per_job = sum(j["resumed_clients"] for srv in survivors for j in srv.get("/v1/jobs").json())
    assert per_job == moved


def test_a_client_counts_its_failovers_and_one_replica_counts_none() -> None:
    replicas = Replicas(["tcp://127.0.0.1:7400", "tcp://127.0.0.2:7400"], slot=0)
    assert replicas.pick(advance=False) == "tcp://127.0.0.1:7400" and replicas.failovers == 0
    assert replicas.pick(advance=True) == "tcp://127.0.0.2:7400" and replicas.failovers == 1
    assert replicas.pick(advance=True) == "tcp://127.0.0.1:7400" and replicas.failovers == 2
    alone = Replicas("tcp://127.0.0.1:7400")
    alone.pick(advance=True)  # the same server again: a reconnect, not a failover
    assert alone.failovers == 0


def test_a_client_away_from_its_own_replica_knows_the_way_back() -> None:
    replicas = Replicas(["tcp://127.0.0.1:7400", "tcp://127.0.0.2:7400"], slot=1)
    assert replicas.pick(advance=False) == "tcp://127.0.0.2:7400" and not replicas.away
    assert replicas.pick(advance=True) == "tcp://127.0.0.1:7400" and replicas.away
    assert replicas.home() == "tcp://127.0.0.2:7400"
    replicas.went_home()
    assert not replicas.away and replicas.returns == 1 and replicas.failovers == 1
    assert replicas.pick(advance=False) == "tcp://127.0.0.2:7400"  # failover goes on from home
    assert replicas.pick(advance=True) == "tcp://127.0.0.1:7400"


def test_all_killed_and_one_restarted_continues_exactly(
    three: list[LiveServer], reference: Run, store: Path, tmp_path: Path
) -> None:
    endpoints = [srv.zmq for srv in three]
    restarted: list[LiveServer] = []

    def kill_all(step: int) -> None:
        if step == KILL_AT:
            for srv in three:
                srv.kill()
            # the same address comes back: clients rotating through the dead ones find it
            again = LiveServer(store, zmq_port=three[1].zmq_port, log_path=tmp_path / "again")
            restarted.append(again.start())

    try:
        got = run(endpoints, kill_all)
        assert batches_served(restarted[0]) > 0
    finally:
        for srv in restarted:
            srv.stop()
    assert_same(got, reference)


def test_a_name_with_two_addresses_spreads_the_workers(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # /etc/hosts is not ours to edit: the resolver hook makes the name; the workers are
    # forked, so they resolve through it too.
    real = replicas.resolve_host

    def resolve(host: str, port: int) -> list[str]:
        return ["127.0.0.3", "127.0.0.2"] if host == "data.replicas.test" else real(host, port)

    monkeypatch.setattr(replicas, "resolve_host", resolve)
    with (
        LiveServer(store, host="127.0.0.2", log_path=tmp_path / "a") as a,
        LiveServer(store, host="127.0.0.3", zmq_port=a.zmq_port, log_path=tmp_path / "b") as b,
    ):
        ld = loader(f"tcp://data.replicas.test:{a.zmq_port}", 0, world=1)
        ld.multiprocessing_context = "fork"
        got = [batch["window_ids"] for batch in ld]
        with LiveServer(store, log_path=tmp_path / "ref") as single:
            want = [batch["window_ids"] for batch in loader(single.zmq, 0, world=1)]
        assert len(got) == len(want) == STEPS
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
        # worker 0 started on 127.0.0.2, worker 1 on 127.0.0.3: both served
        on_a, on_b = batches_served(a), batches_served(b)
        assert on_a > 0 and on_b > 0 and on_a + on_b >= len(got)


# -- builds are never mixed -----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["loader", "own_dataloader", "rank_1_in_a_thread"])
def test_replicas_over_different_builds_are_refused_never_mixed(
    store: Path, tmp_path: Path, mode: str
) -> None:
    other = make_store(tmp_path / "other", 6)  # the same name, another build
    rank, world = (1, 2) if mode == "rank_1_in_a_thread" else (0, 1)
    with (
        LiveServer(store, log_path=tmp_path / "a") as a,
        LiveServer(other, log_path=tmp_path / "b") as b,
    ):
        with LiveServer(store, log_path=tmp_path / "ref") as single:
            want = [batch["window_ids"] for batch in loader(single.zmq, rank, world=world)]
        # rank 0: worker 0 starts on a, worker 1 on b; rank 1 in one thread starts on b,
        # where rank 0 would start on a: every rank must pin the same build
        ld = loader([a.zmq, b.zmq], rank, world=world)
        batches: Iterator[dict[str, torch.Tensor]]
        if mode == "own_dataloader":  # no TokenFeedLoader pins the build before the workers
            batches = iter(
                torch.utils.data.DataLoader(ld.dataset, batch_size=None, num_workers=WORKERS)
            )
        else:
            ld.num_workers = 0 if mode == "rank_1_in_a_thread" else WORKERS
            batches = iter(ld)
        got: list[torch.Tensor] = []
        with pytest.raises(DatasetChanged, match="replicas serve different builds"):
            for batch in batches:
                got.append(batch["window_ids"])
        # whatever arrived before the refusal is the first build's, in order: with worker
        # processes, worker 0 (on a) delivers the first batch before worker 1's refusal
        if mode != "rank_1_in_a_thread":  # there the only client starts on b: refused first
            assert got
        assert len(got) < len(want)
        assert all(torch.equal(x, y) for x, y in zip(got, want[: len(got)], strict=True))
        assert b.settled_counter("chunks") == 0


# -- a replica that comes back gets its workers back ------------------------------------------


def job_workers(srv: LiveServer) -> int:
    """Connections attached to this replica's jobs, as its own snapshot shows them."""
    return sum(j["workers"] for j in srv.get("/v1/jobs").json() if j["ended"] is None)


def epoch_loader(endpoints: str | Sequence[str]) -> TokenFeedLoader:
    """One rank, two workers (worker 0's own replica is the first, worker 1's the
    second), one batch per request, one epoch; asking its own replica again every
    0.2 s once it failed over."""
    ds = TokenFeedDataset(
        endpoints, "alpha", seq_len=16, batch_size=2, rank=0, world_size=1, epochs=1,
        batches_per_item=1, chunk_bytes=1, request_timeout=1.0, deadline=60.0,
    )  # fmt: skip
    ds.options = dataclasses.replace(ds.options, return_after=0.2)
    return TokenFeedLoader(ds, num_workers=WORKERS, pin_memory=False, prefetch=2)


def test_a_paused_replica_that_resumes_gets_its_workers_back(store: Path, tmp_path: Path) -> None:
    with LiveServer(store, log_path=tmp_path / "ref") as single:
        want = [batch["window_ids"] for batch in epoch_loader(single.zmq)]
    a = LiveServer(store, log_path=tmp_path / "a").start()
    b = LiveServer(store, log_path=tmp_path / "b").start()
    assert a.proc is not None and b.proc is not None
    ld = epoch_loader([a.zmq, b.zmq])
    got: list[torch.Tensor] = []
    phase, moved_to_a, served_back = "spread", False, 0
    try:
        for step, batch in enumerate(ld):
            got.append(batch["window_ids"])
            if phase == "spread" and step == KILL_AT:
                both = lambda: job_workers(a) == 1 and job_workers(b) == 1  # noqa: E731
                wait_until(both, 10.0, "one worker on each replica")
                b.proc.send_signal(signal.SIGSTOP)  # worker 1's replica stops answering
                phase = "paused"
            elif phase == "paused" and ld.failovers >= 1:
                # worker 1 failed over: both on a (its snapshot is refreshed every 0.5 s)
                moved_to_a = wait_until(lambda: job_workers(a) == 2, 10.0, "both on a")
                b.proc.send_signal(signal.SIGCONT)
                phase = "resumed"
            elif phase == "resumed":
                # worker 1 asks b again, goes back at a request boundary and says bye to a
                if job_workers(a) == 1 and job_workers(b) >= 1:
                    served_back = batches_served(b)
                    phase = "back"
                threading.Event().wait(0.01)  # a training step: the run outlasts the return
    finally:
        b.proc.send_signal(signal.SIGCONT)
        try:
            assert phase == "back", f"the workers never came back (phase {phase})"
            assert moved_to_a
            # b serves worker 1 again: its counter moved on after the return
            assert batches_served(b, at_least=served_back + 1) > served_back
        finally:
            a.stop()
            b.stop()
    # the epoch, exactly: nothing lost or repeated over the failover and the return
    assert len(got) == len(want)
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    assert ld.failovers >= 1  # the workers' own counts, totalled in the loader
