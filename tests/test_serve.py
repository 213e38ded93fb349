"""End to end: a real server process, real loopback sockets, real DataLoader workers."""

from __future__ import annotations

import collections
import dataclasses
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq
from prometheus_client.parser import text_string_to_metric_families

from live_server import LiveServer
from shard_data import BYTE
from tokenfeed import TokenFeedDataset, TokenFeedLoader, protocol
from tokenfeed.errors import ProtocolError, RequestRejected, ServerUnavailable, UnknownDataset
from tokenfeed.plan import Plan
from tokenfeed.protocol import JobSpec
from tokenfeed.transport.client import FeedClient
from tokenfeed_server.store import TokenizerInfo, open_dataset, write_dataset

pytestmark = pytest.mark.network

SEQ, BATCH = 64, 4


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    rng = np.random.default_rng(7)
    docs = [
        rng.integers(0, 256, size=int(n), dtype=np.uint16) for n in rng.integers(5, 400, size=300)
    ]
    # small shards so that windows cross shard boundaries
    write_dataset(root, "alpha", docs, tokenizer=BYTE, shuffle_seed=0, shard_tokens=10_000)
    wide = [
        rng.integers(0, 70_000, size=int(n), dtype=np.uint32)
        for n in rng.integers(5, 300, size=100)
    ]
    big = TokenizerInfo(kind="hf", vocab_size=70_001, eos_id=70_000)
    write_dataset(root, "beta", wide, tokenizer=big, shuffle_seed=0, shard_tokens=7_000)
    write_dataset(root, "tiny", [np.arange(10, dtype=np.uint16)], tokenizer=BYTE, shuffle_seed=0)
    return root


@pytest.fixture(scope="module")
def server(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with LiveServer(store, log_path=log) as srv:
        yield srv


def make(server: LiveServer, name: str = "alpha", **kw: object) -> TokenFeedDataset:
    args: dict[str, object] = {
        "seq_len": SEQ,
        "batch_size": BATCH,
        "seed": 3,
        "rank": 0,
        "world_size": 1,
        "request_timeout": 2.0,
        "deadline": 20.0,
    }
    args.update(kw)
    return TokenFeedDataset(server.zmq, name, **args)  # type: ignore[arg-type]


def check_rows(store: Path, name: str, batch: dict[str, torch.Tensor], seq_len: int) -> None:
    ds = open_dataset(store, name)
    for row, label, w in zip(
        batch["input_ids"].numpy(),
        batch["labels"].numpy(),
        batch["window_ids"].numpy(),
        strict=True,
    ):
        ref = ds.read(int(w) * seq_len, int(w) * seq_len + seq_len + 1).astype(np.int64)
        np.testing.assert_array_equal(row, ref[:-1])
        np.testing.assert_array_equal(label, ref[1:])
    ds.close()


def windows_in(store: Path, name: str, seq_len: int) -> int:
    with open_dataset(store, name) as ds:
        return (ds.n_tokens - 1) // seq_len


def expected_windows(
    store: Path, name: str, *, rank: int, world: int, steps: int, start: int = 0, seed: int = 3
) -> list[int]:
    ds = open_dataset(store, name)
    plan = Plan(ds.n_tokens, SEQ, BATCH, world, seed)
    ds.close()
    G = plan.global_batch
    return [int(w) for t in range(steps) for w in plan.rank_batches(rank, start + t * G)[0].ravel()]


@pytest.mark.parametrize(
    ("workers", "context"), [(0, None), (2, "fork"), (2, "spawn"), (2, "forkserver")]
)
def test_two_ranks_two_epochs_every_window_once(
    server: LiveServer, store: Path, workers: int, context: str | None
) -> None:
    per_epoch: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    steps = []
    for rank in range(2):
        ds = make(server, rank=rank, world_size=2, epochs=2)
        loader = TokenFeedLoader(
            ds, num_workers=workers, pin_memory=False, multiprocessing_context=context
        )
        n = 0
        for batch in loader:
            assert batch["input_ids"].shape == (BATCH, SEQ)
            assert batch["input_ids"].dtype == torch.int64
            if n % 25 == 0:
                check_rows(store, "alpha", batch, SEQ)
            for w, e in zip(batch["window_ids"].tolist(), batch["epoch"].tolist(), strict=True):
                per_epoch[e][w] += 1
            n += 1
        steps.append(n)
        assert loader.position == n * 2 * BATCH
    assert steps[0] == steps[1]  # every rank the same number of steps
    n_windows = windows_in(store, "alpha", SEQ)
    for epoch in (0, 1):
        assert sorted(per_epoch[epoch]) == list(range(n_windows)), f"epoch {epoch}"
        assert set(per_epoch[epoch].values()) == {1}
    # the last global batch may run into epoch 2 rather than drop anything
    assert sum(per_epoch[2].values()) < 2 * BATCH


def test_order_matches_plan_and_tokens_match_store(server: LiveServer, store: Path) -> None:
    loader = TokenFeedLoader(
        make(server, "beta", samples=60 * BATCH), num_workers=2, pin_memory=False
    )
    got = []
    for batch in loader:
        check_rows(store, "beta", batch, SEQ)
        got += batch["window_ids"].tolist()
    assert got == expected_windows(store, "beta", rank=0, world=1, steps=60)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_resume_with_other_worker_count(server: LiveServer, store: Path) -> None:
    reference = expected_windows(store, "alpha", rank=0, world=1, steps=90)
    first = TokenFeedLoader(make(server, samples=90 * BATCH), num_workers=2, pin_memory=False)
    got = []
    for i, batch in enumerate(first):
        got += batch["window_ids"].tolist()
        if i == 36:
            break
    state = first.state_dict()
    assert state["position"] == 37 * BATCH
    for workers in (3, 0):
        second = TokenFeedLoader(
            make(server, samples=90 * BATCH), num_workers=workers, pin_memory=False
        )
        second.load_state_dict(pickle.loads(pickle.dumps(state)))
        rest = [w for b in second for w in b["window_ids"].tolist()]
        assert got + rest == reference, f"num_workers={workers}"


def test_resume_with_other_world_size(server: LiveServer, store: Path) -> None:
    # 2 ranks x 10 steps, then 3 ranks: the global stream continues without gap or repeat.
    seen: list[int] = []
    for rank in range(2):
        loader = TokenFeedLoader(
            make(server, rank=rank, world_size=2), num_workers=0, pin_memory=False
        )
        for i, batch in enumerate(loader):
            seen += batch["window_ids"].tolist()
            if i == 9:
                break
        state = loader.state_dict()
    assert state["position"] == 10 * 2 * BATCH
    for rank in range(3):
        ds = make(server, rank=rank, world_size=3, samples=state["position"] + 3 * 3 * BATCH)
        loader = TokenFeedLoader(ds, num_workers=0, pin_memory=False)
        loader.load_state_dict(state)
        seen += [w for b in loader for w in b["window_ids"].tolist()]
    plan = Plan(open_dataset(store, "alpha").n_tokens, SEQ, BATCH, 1, 3)
    stream = plan.windows(np.arange(len(seen)))[0].tolist()
    assert sorted(seen) == sorted(stream)


def test_concurrent_jobs(server: LiveServer, store: Path) -> None:
    results: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def run(name: str, seq_len: int, batch_size: int, seed: int) -> None:
        try:
            ds = make(server, name, seq_len=seq_len, batch_size=batch_size, seed=seed, epochs=1)
            results[f"{name}-{seq_len}"] = [
                w
                for b in TokenFeedLoader(ds, num_workers=0, pin_memory=False)
                for w in b["window_ids"].tolist()
            ]
            results[f"{name}-{seq_len}-n"] = [ds.n_windows or 0]
        except BaseException as exc:
            errors.append(exc)

    jobs = [("alpha", 64, 4, 1), ("alpha", 32, 8, 2), ("beta", 48, 2, 5)]
    threads = [threading.Thread(target=run, args=j) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for name, seq_len, _, _ in jobs:
        got = results[f"{name}-{seq_len}"]
        n_windows = results[f"{name}-{seq_len}-n"][0]
        assert set(got) == set(range(n_windows))  # every window of the epoch
        first_epoch = got[:n_windows]
        assert len(set(first_epoch)) == n_windows  # none twice within the epoch


def test_restart_mid_epoch_changes_nothing(store: Path, tmp_path: Path) -> None:
    steps = 120
    reference = expected_windows(store, "alpha", rank=0, world=1, steps=steps)
    log = tmp_path / "server.log"
    srv = LiveServer(store, log_path=log).start()
    ports = ["--zmq-port", str(srv.zmq_port), "--http-port", str(srv.http_port)]
    # one batch per request and per item, two in flight: the kill lands with most of the
    # epoch unsent
    ds = make(
        srv,
        samples=steps * BATCH,
        request_timeout=0.5,
        deadline=30.0,
        window=2,
        chunk_bytes=1,
        batches_per_item=1,
    )
    got: list[int] = []
    try:
        for i, batch in enumerate(TokenFeedLoader(ds, num_workers=2, pin_memory=False, prefetch=1)):
            got += batch["window_ids"].tolist()
            if i == 30:
                srv.kill()
                srv = LiveServer(
                    store, log_path=log, zmq_port=int(ports[1]), http_port=int(ports[3])
                ).start()
        served = 0
        deadline = time.monotonic() + 5
        while served < steps - 40 and time.monotonic() < deadline:  # snapshot: 2 Hz
            served = sum(j["batches_served"] for j in srv.get("/v1/jobs").json())
            time.sleep(0.1)
    finally:
        srv.stop()
    assert got == reference
    assert served >= steps - 40  # the restarted server really served the rest


def test_restart_with_smaller_limits_changes_nothing(store: Path, tmp_path: Path) -> None:
    """The operator restarts the server with a smaller chunk size and window: requests
    already made are cut to the new limits and the stream carries on exactly."""
    steps = 120
    reference = expected_windows(store, "alpha", rank=0, world=1, steps=steps)
    log = tmp_path / "server.log"
    srv = LiveServer(store, log_path=log).start()
    batch_bytes = BATCH * (SEQ + 1) * 2
    ds = make(
        srv,
        samples=steps * BATCH,
        request_timeout=0.5,
        deadline=30.0,
        window=4,
        chunk_bytes=10 * batch_bytes,
    )
    got: list[int] = []
    try:
        for i, batch in enumerate(TokenFeedLoader(ds, num_workers=0, pin_memory=False)):
            got += batch["window_ids"].tolist()
            if i in (5, 40):  # twice: pieces cut for the first restart are cut again
                per_chunk, window = (3, 2) if i == 5 else (1, 1)
                ports = {"zmq_port": srv.zmq_port, "http_port": srv.http_port}
                srv.kill()
                srv = LiveServer(
                    store,
                    log_path=log,
                    **ports,
                    extra=[
                        "--chunk-bytes",
                        str(per_chunk * batch_bytes),
                        "--max-window",
                        str(window),
                    ],
                ).start()
    finally:
        srv.stop()
    assert got == reference


def test_unknown_dataset_is_a_clear_error(server: LiveServer) -> None:
    with pytest.raises(UnknownDataset, match="nope"):
        next(iter(make(server, "nope")))


def test_window_longer_than_dataset(server: LiveServer) -> None:
    with pytest.raises(RequestRejected, match="window"):
        next(iter(make(server, "tiny", seq_len=64)))


def test_oversized_batch_refused(server: LiveServer) -> None:
    with pytest.raises(RequestRejected, match="max_batch_tokens"):
        next(iter(make(server, batch_size=1 << 20, seq_len=64)))


def test_no_server_fails_by_deadline() -> None:
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as probe:
        port = probe.bind_to_random_port("tcp://127.0.0.1")
    ds = TokenFeedDataset(
        f"tcp://127.0.0.1:{port}",
        "alpha",
        seq_len=SEQ,
        batch_size=BATCH,
        rank=0,
        world_size=1,
        request_timeout=0.5,
        deadline=2.0,
    )
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable, match=f"127.0.0.1:{port}"):
        next(iter(ds))
    assert time.monotonic() - t0 < 10


def test_garbage_frames_get_err_and_server_keeps_serving(server: LiveServer) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.zmq)
    garbage: list[list[bytes]] = [
        [b"\xff\x00garbage"],
        [b""],
        [b"\x93\x01\x02\x03"],  # msgpack array, not a map
        [protocol.Ping().header(), b"extra"],
        [b"\x82\xa1v\x09\xa1t\xa5hello"],  # version 9
        [b"\x82\xa1v\x01\xa1t\xa3get"],  # get without fields
    ]
    for frames in garbage:
        sock.send_multipart(frames)
        assert sock.poll(5000), f"no answer to {frames!r}"
        reply = protocol.decode_header(sock.recv())
        assert isinstance(reply, protocol.Err) and reply.code == "bad_request", reply
    sock.send(protocol.Ping().header())
    assert sock.poll(5000)
    assert isinstance(protocol.decode_header(sock.recv()), protocol.Pong)
    sock.close()
    ctx.term()
    assert sum(1 for _ in make(server, samples=10 * BATCH)) == 10


def ask(server: LiveServer, *messages: bytes) -> list[protocol.Message]:
    """Send raw header frames on one fresh connection; the decoded answer to each."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.zmq)
    replies = []
    try:
        for frame in messages:
            sock.send(frame)
            assert sock.poll(5000), f"no answer to {frame!r}"
            replies.append(protocol.decode_header(sock.recv_multipart()[0]))
        sock.send(protocol.Bye().header())
    finally:
        sock.close(linger=500)
        ctx.term()
    return replies


HELLO = protocol.Hello("alpha", SEQ, BATCH, 3, 1, 0, 0, window=2, client="raw")


def test_v1_client_is_told_to_install_matching_versions(server: LiveServer) -> None:
    v1 = msgpack.unpackb(HELLO.header())
    v1["v"] = 1
    (reply,) = ask(server, msgpack.packb(v1))
    assert isinstance(reply, protocol.Err) and reply.code == "bad_request"
    assert "version 1" in reply.message and "install matching versions" in reply.message


def test_client_refuses_a_v1_server() -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    welcome = protocol.Welcome("s", "j", "f", 100, 10, "uint16", 2, 4, 0)
    v1 = {**msgpack.unpackb(welcome.header()), "v": 1}

    def old_server() -> None:
        if router.poll(10_000):
            ident, _ = router.recv_multipart()
            router.send_multipart([ident, msgpack.packb(v1)])

    thread = threading.Thread(target=old_server)
    thread.start()
    try:
        job = JobSpec("alpha", SEQ, BATCH, 3, 1)
        client = FeedClient(f"tcp://127.0.0.1:{port}", job, rank=0, worker=0)
        with client, pytest.raises(ProtocolError, match="install matching versions"):
            client.hello()
    finally:
        thread.join(15)
        router.close()
        ctx.term()


def test_an_invalid_dataset_name_is_a_decodable_bad_request(server: LiveServer) -> None:
    (reply,) = ask(server, dataclasses.replace(HELLO, dataset="x" * 500).header())
    assert isinstance(reply, protocol.Err) and reply.code == "bad_request", reply
    assert "invalid dataset name" in reply.message  # not "damaged on the server"


def test_hello_with_another_builds_fingerprint_is_refused(server: LiveServer) -> None:
    (welcome,) = ask(server, HELLO.header())
    assert isinstance(welcome, protocol.Welcome)
    served = welcome.fingerprint
    same = dataclasses.replace(HELLO, fingerprint=served)
    other = dataclasses.replace(HELLO, fingerprint="0123456789abcdef")
    ok, refused = ask(server, same.header(), other.header())
    assert isinstance(ok, protocol.Welcome) and ok.job == welcome.job
    assert isinstance(refused, protocol.Err) and refused.code == "dataset_changed", refused
    assert not refused.retry
    assert "0123456789abcdef" in refused.message and served in refused.message


def test_get_without_hello_is_the_quiet_unknown_job_answer(server: LiveServer) -> None:
    """What every worker meets first after a server restart: a documented recovery path,
    answered ``unknown_job`` (retry), counted under its own code, not logged as a fault."""
    get = protocol.Get(req=5, job="0123456789abcdef", rank=0, pos=0, count=1, stride=1)
    (reply,) = ask(server, get.header())
    assert isinstance(reply, protocol.Err) and reply.code == "unknown_job" and reply.retry
    deadline = time.monotonic() + 5
    counters: dict[str, int] = {}
    while not counters.get("err_unknown_job") and time.monotonic() < deadline:
        counters = server.get("/v1/status").json()["counters"]  # refreshed at 2 Hz
        time.sleep(0.05)
    assert counters.get("err_unknown_job", 0) >= 1
    assert "err_internal" not in counters
    assert server.log_path is not None
    assert "not attached" not in server.log_path.read_text()  # no WARNING for it


def test_retransmits_count_resends_of_one_client_only(server: LiveServer) -> None:
    """A new client (a new loader iteration, a rerun) asking again from its start is not a
    retransmit; the same client re-sending a request (Lazy Pirate) is."""
    hello = dataclasses.replace(HELLO, seed=77, client="resender")
    (welcome,) = ask(server, hello.header())
    assert isinstance(welcome, protocol.Welcome)
    get = protocol.Get(req=1, job=welcome.job, rank=0, pos=0, count=1, stride=1)
    replies = ask(server, hello.header(), get.header(), get.header())  # same client twice
    assert [r.TYPE for r in replies] == ["welcome", "chunk", "chunk"]
    fresh = dataclasses.replace(hello, client="next-iteration")
    assert [r.TYPE for r in ask(server, fresh.header(), get.header())] == ["welcome", "chunk"]

    def job() -> dict[str, int]:
        jobs = server.get("/v1/jobs").json()
        return next((j for j in jobs if j["id"] == welcome.job), {"requests": 0})

    deadline = time.monotonic() + 5
    while job()["requests"] < 3 and time.monotonic() < deadline:  # snapshot: 2 Hz
        time.sleep(0.05)
    assert job()["requests"] == 3 and job()["retransmits"] == 1


def test_http_endpoints(server: LiveServer) -> None:
    for _ in make(server, samples=5 * BATCH):
        pass
    assert server.get("/healthz").status_code == 200
    ready = server.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    names = {d["name"] for d in server.get("/v1/datasets").json()}
    assert {"alpha", "beta", "tiny"} <= names
    alpha = server.get("/v1/datasets/alpha").json()
    assert alpha["tokens"] == open_dataset(server_store(server), "alpha").n_tokens
    assert server.get("/v1/datasets/missing").status_code == 404
    assert server.get("/v1/datasets/..%2Fetc").status_code in (400, 404)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the snapshot is refreshed twice a second
        jobs = server.get("/v1/jobs").json()
        if any(j["batches_served"] >= 5 for j in jobs):
            break
        time.sleep(0.1)
    job = next(j for j in jobs if j["batches_served"] >= 5)
    for key in (
        "dataset",
        "seq_len",
        "batch_size",
        "seed",
        "world_size",
        "workers",
        "tokens_served",
        "tokens_per_s",
        "position",
        "retransmits",
    ):
        assert key in job
    assert server.get("/v1/limits").json()["max_window"] >= 1
    metrics = server.get("/metrics")
    families = {f.name for f in text_string_to_metric_families(metrics.text)}
    assert {"tokenfeed_tokens_served", "tokenfeed_connections", "tokenfeed_ready"} <= families
    assert server.get("/openapi.json").status_code == 200


def server_store(server: LiveServer) -> Path:
    assert server.store is not None
    return server.store


def test_sigterm_exits_zero(store: Path) -> None:
    srv = LiveServer(store).start()
    assert srv.get("/readyz").status_code == 200
    assert srv.stop() == 0


def test_dataset_pickles_and_holds_no_socket(server: LiveServer) -> None:
    ds = make(server)
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.job == ds.job and clone.position == 0
    assert not any(isinstance(v, zmq.Socket) for v in vars(ds).values())
