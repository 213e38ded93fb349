"""Mixture jobs at scale on a real server (issue 23): counts, never timings.

- A mixture job opened and closed 500 times leaves the mixture tables' bytes at their
  baseline and at most ``max_jobs`` job records (the server's own figures: ``/v1/status``
  memory and ``/metrics``); a closed job that is attached again reads the same rows.
- Big tables are built once, on the builder thread, while ten hellos for them are answered
  retryably and the loop keeps answering (the counters say on which thread they were
  built; the loop's busiest turn itself is measured in benchmarks/bench_mixture_open.py).
- A mixture is admitted as a whole: a source that cannot be served refuses the whole job,
  named, and leaves no job and no tables behind.
- A new job of a many-source mixture has its first block of order computed on the builder
  thread before it is admitted (the counters say so), its later blocks on the loop; a big
  mixture's tables go with the job that took them over, however soon it closes.

Raw protocol messages on loopback, so these depend on the wire, not the client library.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import zmq

from live_server import LiveServer
from shard_data import BYTE
from tokenfeed import protocol
from tokenfeed.mixture import Mixture
from tokenfeed_server.store import write_dataset
from tokenfeed_server.store.mixing import INLINE_BLOCK_SOURCES
from tokenfeed_server.store.mixture_tables import INLINE_TABLE_ROWS, table_bytes, table_rows
from tokenfeed_server.store.pools import WindowBlocks

pytestmark = pytest.mark.network

MAX_JOBS = 16
SEQ, BATCH = 16, 2
SMALL = Mixture({"web": 500, "code": 300, "math": 1})  # built at once: under the inline rows
# three distinct weightings of the largest period: tables near MAX_TABLE_ROWS
BIG_SCHEDULE = tuple((k * 10, 65535 - 2 * k, 1 + 2 * k) for k in range(3))
# more sources than are computed inline: a new job's first block is the builder's
MANY = tuple(f"many{i:02d}" for i in range(INLINE_BLOCK_SOURCES + 4))
BLOCK = WindowBlocks().block


def docs(lo: int, hi: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(lo, hi, size=int(k), dtype=np.uint16) for k in rng.integers(3, 90, n)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("store")
    for i, name in enumerate(("web", "code", "math")):
        write_dataset(root, name, docs(i * 80, i * 80 + 80, 60, i), tokenizer=BYTE, shuffle_seed=i)
    for i, name in enumerate(MANY):
        write_dataset(root, name, docs(0, 200, 20, 20 + i), tokenizer=BYTE, shuffle_seed=i)
    broken = root / "broken"
    write_dataset(root, "broken", docs(0, 80, 20, 9), tokenizer=BYTE, shuffle_seed=9)
    (broken / "manifest.json").write_text("{ not json")
    tmp = tmp_path_factory.mktemp("scale")
    extra = ["--max-jobs", str(MAX_JOBS), "--max-jobs-per-tenant", str(MAX_JOBS)]
    with LiveServer(root, extra=extra, log_path=tmp / "server.log") as srv:
        yield srv


class Wire:
    """One DEALER connection speaking raw protocol messages."""

    def __init__(self, server: LiveServer) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(server.zmq)
        self.req = 0

    def close(self) -> None:
        self.sock.close(linger=0)

    def send(self, msg: protocol.Message) -> None:
        self.sock.send(msg.header())

    def receive(self) -> tuple[protocol.Message, list[Any]]:
        assert self.sock.poll(10_000), "no answer"
        frames = self.sock.recv_multipart()
        return protocol.decode_header(frames[0]), frames[1:]

    def ask(self, msg: protocol.Message) -> tuple[protocol.Message, list[Any]]:
        self.send(msg)
        return self.receive()

    def welcome(self, hello: protocol.Hello) -> tuple[protocol.Welcome, int]:
        """The welcome for ``hello``, and how many retryable refusals came first."""
        for refused in range(600):  # bounded: a build of big tables takes seconds here
            reply, _ = self.ask(hello)
            if isinstance(reply, protocol.Welcome):
                return reply, refused
            assert isinstance(reply, protocol.Err) and reply.retry, reply
            assert reply.code == "overloaded" and "being built" in reply.message, reply
            time.sleep(0.02)
        raise AssertionError("the tables were never ready")

    def get(self, job: str, pos: int = 0) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        self.req += 1
        header, payload = self.ask(
            protocol.Get(req=self.req, job=job, rank=0, pos=pos, count=1, stride=1)
        )
        assert isinstance(header, protocol.Chunk), header
        tokens, rows = protocol.decode_chunk(header, payload)
        return tokens.copy(), {k: v.copy() for k, v in rows.items()}


def hello(mixture: Mixture | None = None, *, schedule: Any = None, **kw: Any) -> protocol.Hello:
    names = kw.pop("sources", None) or (mixture.names if mixture else ("web", "code"))
    rows = schedule if schedule is not None else mixture.to_wire()  # type: ignore[union-attr]
    args: dict[str, Any] = {
        "dataset": "", "seq_len": SEQ, "batch_size": BATCH, "seed": 3, "world_size": 1,
        "rank": 0, "worker": 0, "window": 4, "client": "scale", "sources": tuple(names),
        "schedule": tuple(tuple(r) for r in rows),
    }  # fmt: skip
    args.update(kw)
    return protocol.Hello(**args)


def status(server: LiveServer) -> dict[str, Any]:
    body: dict[str, Any] = server.get("/v1/status").json()
    return body


def metric(server: LiveServer, name: str) -> float:
    text = httpx.get(server.http + "/metrics", timeout=10.0).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def settled(server: LiveServer) -> dict[str, Any]:
    """/v1/status once everything sent before now is handled and in the snapshot."""
    server.settled_counter("messages")
    time.sleep(0.6)  # one more snapshot: the job table as of now (rebuilt every 0.5 s)
    return status(server)


def test_a_mixture_job_opened_and_closed_500_times_leaves_no_memory_behind(
    server: LiveServer,
) -> None:
    assert table_rows(SMALL) <= INLINE_TABLE_ROWS
    baseline = settled(server)["memory"]["mixture_tables"]
    wire = Wire(server)
    try:
        first_rows = None
        for i in range(500):
            welcome, _ = wire.welcome(hello(SMALL, run=f"run-{i}", client=f"c-{i}"))
            if i % 100 == 0:  # while a job reads it, its tables are held (once)
                held = status(server)["memory"]["mixture_tables"]
                assert held == baseline + table_bytes(SMALL)
            tokens, rows = wire.get(welcome.job)
            if first_rows is None:
                first_rows = (tokens, rows[protocol.ROW_SOURCE])
            wire.send(protocol.Bye(consumed=BATCH))
            if i % 100 == 99:  # closed: its memory went at once, its record stays
                after = settled(server)
                assert after["memory"]["mixture_tables"] == baseline, i
        after = settled(server)
        assert after["memory"]["mixture_tables"] == baseline
        assert after["counters"]["mixtures_held"] == 0
        assert metric(server, "tokenfeed_jobs") <= MAX_JOBS
        jobs = server.get("/v1/jobs", params={"forgotten": "true"}).json()
        assert sum(1 for j in jobs if not j["forgotten"]) <= MAX_JOBS
        assert sum(1 for j in jobs if j["forgotten"]) <= 64  # ended records are bounded
        closed = [j for j in jobs if not j["forgotten"]]
        # a closed job's record still shows its sources and progress (kept, not its tables)
        assert closed and all(j["ended"] is not None and j["sources"] for j in closed)
        assert all(j["source_progress"][0]["rows_served"] >= 0 for j in closed)
        # the last run attached again: it reads again, the same rows as the first run
        welcome, _ = wire.welcome(hello(SMALL, run="run-0", client="again"))
        tokens, rows = wire.get(welcome.job)
        assert first_rows is not None
        assert np.array_equal(tokens, first_rows[0])
        assert rows[protocol.ROW_SOURCE].tolist() == first_rows[1].tolist()
        assert status(server)["memory"]["mixture_tables"] == baseline + table_bytes(SMALL)
        wire.send(protocol.Bye(consumed=BATCH))
        assert settled(server)["memory"]["mixture_tables"] == baseline
    finally:
        wire.close()


def test_big_tables_are_built_once_off_the_loop_while_hellos_are_answered(
    server: LiveServer,
) -> None:
    mixture = Mixture.from_wire(("web", "code"), BIG_SCHEDULE)
    assert table_rows(mixture) > 100 * INLINE_TABLE_ROWS
    start = settled(server)
    before, base = start["counters"], start["memory"]["mixture_tables"]
    wires = [Wire(server) for _ in range(10)]
    try:
        msgs = [hello(mixture, client=f"w{i}", worker=i) for i in range(10)]
        for w, msg in zip(wires, msgs, strict=True):  # ten hellos at once
            w.send(msg)
        first = [w.receive()[0] for w in wires]
        # the loop answered at once instead of building (a ping is answered meanwhile too)
        assert isinstance(first[0], protocol.Err) and first[0].retry, first[0]
        assert first[0].code == "overloaded" and "being built" in first[0].message
        assert isinstance(wires[0].ask(protocol.Ping())[0], protocol.Pong)
        welcomes = [w.welcome(m)[0] for w, m in zip(wires, msgs, strict=True)]
        assert len({w.job for w in welcomes}) == 1  # one job, ten workers
        after = settled(server)
        counters = after["counters"]
        built = counters["mixture_table_builds_off_loop"] - before.get(
            "mixture_table_builds_off_loop", 0
        )
        assert built == 1  # once, however many asked
        assert counters["mixture_table_builds_inline"] == before.get(
            "mixture_table_builds_inline", 0
        )
        assert after["memory"]["mixture_tables"] == base + table_bytes(mixture)
        # the job reads through the tables built off the loop: rows from its sources
        _, rows = wires[0].get(welcomes[0].job, pos=40)
        sources, _ = mixture.locate(np.arange(40, 40 + BATCH))
        assert rows[protocol.ROW_SOURCE].tolist() == sources.tolist()
        for w in wires:
            w.send(protocol.Bye(consumed=0))
        assert settled(server)["memory"]["mixture_tables"] == base
    finally:
        for w in wires:
            w.close()


def test_a_mixture_is_admitted_as_a_whole_or_not_at_all(server: LiveServer) -> None:
    before = settled(server)
    jobs_before = {j["id"] for j in server.get("/v1/jobs").json()}
    wire = Wire(server)
    try:
        for bad in ("broken", "nope"):
            mixture = Mixture({"web": 2, bad: 1, "code": 1})
            reply, _ = wire.ask(hello(mixture))
            assert isinstance(reply, protocol.Err) and not reply.retry, reply
            assert f"mixture source {bad!r}" in reply.message
            assert "not admitted" in reply.message
    finally:
        wire.close()
    after = settled(server)
    assert {j["id"] for j in server.get("/v1/jobs").json()} == jobs_before
    assert after["memory"]["mixture_tables"] == before["memory"]["mixture_tables"]


def counted(before: dict[str, int], after: dict[str, int], name: str) -> int:
    return after.get(name, 0) - before.get(name, 0)


def test_a_new_many_source_job_finds_its_first_block_computed_off_the_loop(
    server: LiveServer,
) -> None:
    mixture = Mixture({name: 1 + i for i, name in enumerate(MANY)})
    assert table_rows(mixture) <= INLINE_TABLE_ROWS  # tables at once: the block is the wait
    start = settled(server)
    before = start["counters"]
    wires = {seed: Wire(server) for seed in (11, 12)}
    try:
        jobs = {}
        for seed, wire in wires.items():  # another seed: tables built, its block not
            welcome, refused = wire.welcome(
                hello(mixture, seed=seed, run=f"s{seed}", client=f"s{seed}")
            )
            assert refused >= 1  # answered "ask again" while the builder computed it
            _, rows = wire.get(welcome.job, pos=0)
            sources, _ = mixture.locate(np.arange(BATCH))
            assert rows[protocol.ROW_SOURCE].tolist() == sources.tolist()
            jobs[seed] = welcome.job
        middle = settled(server)["counters"]
        assert counted(before, middle, "mixture_blocks_off_loop") == 2
        assert counted(before, middle, "mixture_blocks_inline") == 0
        # a later block is the loop's (the job reads on from its first): counted there
        _, rows = wires[12].get(jobs[12], pos=2 * BLOCK)
        sources, _ = mixture.locate(np.arange(2 * BLOCK, 2 * BLOCK + BATCH))
        assert rows[protocol.ROW_SOURCE].tolist() == sources.tolist()
        after = settled(server)["counters"]
        assert counted(middle, after, "mixture_blocks_inline") == 1
        assert counted(middle, after, "mixture_blocks_off_loop") == 0
        for wire in wires.values():
            wire.send(protocol.Bye(consumed=BATCH))
        assert settled(server)["memory"]["mixture_tables"] == start["memory"]["mixture_tables"]
    finally:
        for wire in wires.values():
            wire.close()


def test_big_tables_go_with_a_job_that_closes_at_once(server: LiveServer) -> None:
    mixture = Mixture.from_wire(("web", "code"), BIG_SCHEDULE)
    base = settled(server)["memory"]["mixture_tables"]
    wire = Wire(server)
    try:
        welcome, _ = wire.welcome(hello(mixture, run="at-once"))
        wire.get(welcome.job)
        wire.send(protocol.Bye(consumed=BATCH))  # before any housekeeping saw the job
        # the job took the build's hold over: its close frees them, not a claim timeout
        assert settled(server)["memory"]["mixture_tables"] == base
    finally:
        wire.close()
