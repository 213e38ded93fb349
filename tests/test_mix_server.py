"""Mixtures and the block shuffle on a real server: one process, real loopback sockets,
raw protocol messages (so these tests depend on the wire, not on the client library).

The expected rows are rebuilt from the store with the plan and the mixture math (the
definition of the order), and every row is also checked against the token range its
source was written with, so a row from the wrong source fails even if both sides agreed
on a wrong order.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
import zmq

from live_server import LiveServer, tenants_toml
from shard_data import BYTE
from tokenfeed import protocol
from tokenfeed.mixture import Mixture, source_seed
from tokenfeed.plan import Plan, default_block_sizes
from tokenfeed_server.prepare import PrepareConfig, prepare
from tokenfeed_server.store import Dataset, TokenizerInfo, open_dataset, write_dataset
from tokenfeed_server.store.mixing import MAX_LABEL, Feed, Source

pytestmark = pytest.mark.network

SEQ, BATCH, WORLD, SEED = 16, 4, 2, 11
ALL, PARTIAL = "token-of-all-datasets-0001", "token-of-some-datasets-0002"
# Each source's documents use their own token range, so a row shows where it came from.
RANGES = {"web": (0, 100), "code": (100, 200), "math": (200, 256)}
NAMES = ("web", "code", "math")
SCHEDULE = [(0, {"web": 3, "code": 2, "math": 1}), (240, {"web": 1, "code": 1, "math": 6})]


def docs(lo: int, hi: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(lo, hi, size=int(k), dtype=np.uint16) for k in rng.integers(3, 90, n)]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    # Odd sizes and small shards: windows cross shard boundaries; math is small, so it
    # runs many epochs of its own while web is in its first.
    write_dataset(root, "web", docs(0, 100, 420, 1), tokenizer=BYTE, shuffle_seed=1,
                  shard_tokens=3001)  # fmt: skip
    write_dataset(root, "code", docs(100, 200, 190, 2), tokenizer=BYTE, shuffle_seed=2,
                  shard_tokens=2003)  # fmt: skip
    write_dataset(root, "math", docs(200, 256, 31, 3), tokenizer=BYTE, shuffle_seed=3,
                  shard_tokens=701)  # fmt: skip
    write_dataset(root, "tiny", [np.arange(10, dtype=np.uint16)], tokenizer=BYTE, shuffle_seed=0)
    other = TokenizerInfo(kind="hf", vocab_size=300, eos_id=299)
    write_dataset(root, "odd", docs(0, 299, 40, 4), tokenizer=other, shuffle_seed=4)
    # Text prepared by the real prepare: bpe-web trains a BPE, bpe-code reuses its
    # tokenizer.json (as the refusal advises), bpe-math trains its own.
    rng = random.Random(5)
    words = {
        "bpe-web": ["the", "cat", "sat", "on", "a", "mat", "with", "hats"],
        "bpe-code": ["def", "return", "if", "else", "for", "while", "print"],
        "bpe-math": ["one", "two", "three", "plus", "minus", "equals", "prime"],
    }
    for name, vocabulary in words.items():
        corpus = root.parent / f"{name}-corpus.jsonl"
        lines = (
            json.dumps({"text": " ".join(rng.choices(vocabulary, k=rng.randint(5, 60)))})
            for _ in range(80)
        )
        corpus.write_text("\n".join(lines) + "\n")
        tokenizer = str(root / "bpe-web" / "tokenizer.json") if name == "bpe-code" else "bpe:300"
        config = PrepareConfig(
            inputs=(corpus,), store=root, dataset=name, tokenizer=tokenizer, workers=1,
            progress=False,
        )  # fmt: skip
        prepare(config)
    return root


@pytest.fixture(scope="module")
def server(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("mixserver")
    tenants = tmp / "tenants.toml"
    tenants.write_text(
        tenants_toml(None, {"all": (ALL, ["*"]), "some": (PARTIAL, ["web", "code"])})
    )
    extra = ["--tenants", str(tenants)]
    with LiveServer(store, extra=extra, log_path=tmp / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def opened(store: Path) -> Iterator[dict[str, Dataset]]:
    sets = {name: open_dataset(store, name) for name in (*NAMES, "odd")}
    yield sets
    for ds in sets.values():
        ds.close()


class Wire:
    """One DEALER connection speaking raw protocol messages."""

    def __init__(self, server: LiveServer, token: str = ALL) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.plain_username = b"tokenfeed"
        self.sock.plain_password = token.encode()
        self.sock.connect(server.zmq)
        self.req = 0

    def close(self) -> None:
        self.sock.close(linger=0)

    def ask(self, msg: protocol.Message) -> tuple[protocol.Message, list[Any]]:
        self.sock.send(msg.header())
        assert self.sock.poll(10_000), f"no answer to {msg.TYPE}"
        frames = self.sock.recv_multipart()
        return protocol.decode_header(frames[0]), frames[1:]

    def hello(self, **kw: Any) -> protocol.Message:
        args: dict[str, Any] = {
            "dataset": "",
            "seq_len": SEQ,
            "batch_size": BATCH,
            "seed": SEED,
            "world_size": WORLD,
            "rank": 0,
            "worker": 0,
            "window": 8,
            "client": f"test-{id(self)}",
        }
        args.update(kw)
        reply, _ = self.ask(protocol.Hello(**args))
        for _ in range(400):  # a big mixture's tables are built off the loop: ask again
            if not (isinstance(reply, protocol.Err) and reply.code == "overloaded"):
                break
            time.sleep(0.05)
            reply, _ = self.ask(protocol.Hello(**args))
        return reply

    def welcome(self, **kw: Any) -> protocol.Welcome:
        reply = self.hello(**kw)
        assert isinstance(reply, protocol.Welcome), reply
        return reply

    def refusal(self, **kw: Any) -> protocol.Err:
        reply = self.hello(**kw)
        assert isinstance(reply, protocol.Err), reply
        return reply

    def get(
        self, job: str, rank: int, pos: int, count: int = 1, stride: int = 1, consumed: int = -1
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        self.req += 1
        msg = protocol.Get(
            req=self.req, job=job, rank=rank, pos=pos, count=count, stride=stride, consumed=consumed
        )
        header, payload = self.ask(msg)
        assert isinstance(header, protocol.Chunk), header
        assert header.req == self.req
        tokens, rows = protocol.decode_chunk(header, payload)
        return tokens.copy(), {k: v.copy() for k, v in rows.items()}


@pytest.fixture
def wire(server: LiveServer) -> Iterator[Wire]:
    w = Wire(server)
    yield w
    w.close()


def mixture_hello(mixture: Mixture | None = None, **kw: Any) -> dict[str, Any]:
    mixture = mixture or Mixture(SCHEDULE)
    return {"sources": mixture.names, "schedule": mixture.to_wire(), **kw}


def expected_mixture_rows(
    opened: dict[str, Dataset],
    mixture: Mixture,
    rank: int,
    pos: int,
    count: int,
    stride: int,
    **order: Any,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, windows, epochs and sources of a request, from the store and the math."""
    plans = {
        n: Plan(opened[n].n_tokens, SEQ, BATCH, WORLD, source_seed(SEED, n), **order.get(n, {}))
        for n in mixture.names
    }
    positions = plans[mixture.names[0]].rank_positions(rank, pos, count, stride)
    sources, spos = mixture.locate(positions)
    tokens, windows, epochs = [], [], []
    for s, q in zip(sources.tolist(), spos.tolist(), strict=True):
        name = mixture.names[s]
        ids, eps = plans[name].windows(np.array([q]))
        windows.append(int(ids[0]))
        epochs.append(int(eps[0]))
        tokens.append(opened[name].gather(plans[name].token_starts(ids), SEQ + 1)[0])
    return np.stack(tokens), np.array(windows), np.array(epochs), sources


def assert_rows_from_their_sources(tokens: np.ndarray, sources: np.ndarray) -> None:
    """Independent of any order: every token of a row is in its source's range (or EOS)."""
    for row, s in zip(tokens, sources.tolist(), strict=True):
        lo, hi = RANGES[NAMES[s]]
        body = row[row != BYTE.eos_id]
        assert ((body >= lo) & (body < hi)).all(), (NAMES[s], row)


# -- mixtures ----------------------------------------------------------------------------


def test_welcome_describes_every_source(wire: Wire, opened: dict[str, Dataset]) -> None:
    welcome = wire.welcome(**mixture_hello())
    fps = [opened[n].fingerprint for n in NAMES]
    assert welcome.source_fingerprints == tuple(fps)
    assert welcome.fingerprint == protocol.mixture_fingerprint(fps)
    assert welcome.source_tokens == tuple(opened[n].n_tokens for n in NAMES)
    windows = tuple((opened[n].n_tokens - 1) // SEQ for n in NAMES)
    assert welcome.source_windows == windows
    assert welcome.n_windows == sum(windows)
    assert welcome.n_tokens == sum(opened[n].n_tokens for n in NAMES)
    assert (welcome.dtype, welcome.eos_id) == ("uint16", BYTE.eos_id)
    assert welcome.source_region_windows == welcome.source_block_regions == (0, 0, 0)
    assert welcome.region_windows == welcome.block_regions == 0


@pytest.mark.parametrize(
    ("rank", "pos", "count", "stride"),
    [
        (0, 0, 1, 1),
        (1, 0, 5, 1),
        (0, 200, 12, 1),  # across the schedule change at 240
        (1, 232, 6, 3),  # strided like one of 3 DataLoader workers, across the change
        (0, 4096, 9, 2),  # math deep in its own later epochs
    ],
)
def test_rows_hold_their_sources_tokens(
    wire: Wire, opened: dict[str, Dataset], rank: int, pos: int, count: int, stride: int
) -> None:
    mixture = Mixture(SCHEDULE)
    welcome = wire.welcome(**mixture_hello())
    tokens, rows = wire.get(welcome.job, rank, pos, count, stride)
    want_tokens, want_windows, want_epochs, want_sources = expected_mixture_rows(
        opened, mixture, rank, pos, count, stride
    )
    assert rows[protocol.ROW_SOURCE].tolist() == want_sources.tolist()
    assert rows[protocol.ROW_WINDOW].tolist() == want_windows.tolist()
    assert rows[protocol.ROW_EPOCH].tolist() == want_epochs.tolist()
    assert np.array_equal(tokens, want_tokens)
    assert_rows_from_their_sources(tokens, rows[protocol.ROW_SOURCE])
    if pos >= 4096:  # the small source is many epochs in, the big one still in its first
        epochs = rows[protocol.ROW_EPOCH]
        sources = rows[protocol.ROW_SOURCE]
        assert epochs[sources == 2].min() > 3 and epochs[sources == 0].max() == 0


def test_one_source_request_and_every_position_once_per_source_epoch(
    wire: Wire, opened: dict[str, Dataset]
) -> None:
    """A request all of one source (weight 1 for one name) is served, and over a stretch
    of the stream every source sees each of its windows exactly once per its epoch."""
    only = Mixture({"math": 1})
    welcome = wire.welcome(**mixture_hello(only))
    tokens, rows = wire.get(welcome.job, 0, 0, 2, 1)
    assert set(rows[protocol.ROW_SOURCE].tolist()) == {0}
    want = expected_mixture_rows(opened, only, 0, 0, 2, 1)
    assert np.array_equal(tokens, want[0]) and rows["window"].tolist() == want[1].tolist()

    mixture = Mixture(SCHEDULE)
    welcome = wire.welcome(**mixture_hello())
    g = BATCH * WORLD
    assert welcome.max_count >= 60
    seen: dict[tuple[int, int], list[int]] = {}
    for rank in range(WORLD):
        _, rows = wire.get(welcome.job, rank, 0, count=60, stride=1)
        for s, e, w in zip(rows["source"], rows["epoch"], rows["window"], strict=True):
            seen.setdefault((int(s), int(e)), []).append(int(w))
    counts = mixture.counts(60 * g)
    math_windows = (opened["math"].n_tokens - 1) // SEQ
    full_math_epochs = counts[2] // math_windows
    assert full_math_epochs >= 1
    for epoch in range(full_math_epochs):
        assert sorted(seen[(2, epoch)]) == list(range(math_windows))
    for (s, _), ws in seen.items():
        assert len(ws) == len(set(ws)), NAMES[s]


def test_tenancy_refusal_names_the_source(server: LiveServer) -> None:
    w = Wire(server, PARTIAL)
    try:
        err = w.refusal(**mixture_hello())
        assert err.code == "forbidden"
        assert "mixture source 'math'" in err.message and "'some'" in err.message
        two = Mixture({"web": 1, "code": 1})
        assert isinstance(w.hello(**mixture_hello(two)), protocol.Welcome)
    finally:
        w.close()


def test_sources_of_different_tokenizers_are_refused_naming_two(wire: Wire) -> None:
    err = wire.refusal(**mixture_hello(Mixture({"web": 1, "code": 1, "odd": 1})))
    assert err.code == "bad_request"
    assert "'web' and 'odd'" in err.message
    assert "vocab_size 257 vs 300" in err.message and "--tokenizer" in err.message


def test_sources_prepared_with_one_tokenizer_file_mix(
    wire: Wire, store: Path, opened: dict[str, Dataset]
) -> None:
    """The advice of the refusal, with the real prepare: a source prepared with
    ``--tokenizer`` pointing at another's tokenizer.json mixes with it (their kinds differ:
    trained vs loaded, their file is the same); a BPE trained on its own corpus does not."""
    web, code = open_dataset(store, "bpe-web"), open_dataset(store, "bpe-code")
    try:
        assert web.manifest.tokenizer.kind != code.manifest.tokenizer.kind
        mixture = Mixture({"bpe-web": 2, "bpe-code": 1})
        welcome = wire.welcome(**mixture_hello(mixture, world_size=1))
        assert welcome.eos_id == web.manifest.tokenizer.eos_id
        tokens, rows = wire.get(welcome.job, 0, 0, 3)
        plans = {
            ds.name: Plan(ds.n_tokens, SEQ, BATCH, 1, source_seed(SEED, ds.name))
            for ds in (web, code)
        }
        sources, spos = mixture.locate(np.arange(3 * BATCH))
        for row, s, q in zip(tokens, sources.tolist(), spos.tolist(), strict=True):
            ds = (web, code)[s]
            ids, _ = plans[ds.name].windows(np.array([q]))
            assert np.array_equal(row, ds.gather(plans[ds.name].token_starts(ids), SEQ + 1)[0])
        assert rows["source"].tolist() == sources.tolist()
    finally:
        web.close()
        code.close()
    err = wire.refusal(**mixture_hello(Mixture({"bpe-web": 1, "bpe-code": 1, "bpe-math": 1})))
    assert err.code == "bad_request"
    assert "'bpe-web' and 'bpe-math'" in err.message and "tokenizer file hash" in err.message


def test_a_changed_source_is_refused_naming_it(wire: Wire, opened: dict[str, Dataset]) -> None:
    fps = [opened[n].fingerprint for n in NAMES]
    assert isinstance(wire.hello(**mixture_hello(fingerprints=fps)), protocol.Welcome)
    assert isinstance(wire.hello(**mixture_hello(fingerprints=["", fps[1], ""])), protocol.Welcome)
    stale = [fps[0], "0" * len(fps[1]), fps[2]]
    err = wire.refusal(**mixture_hello(fingerprints=stale))
    assert err.code == "dataset_changed"
    assert "mixture source 'code'" in err.message and fps[1] in err.message
    # the whole build, as a welcome names it (a client reconnecting)
    whole = protocol.mixture_fingerprint(fps)
    assert isinstance(wire.hello(**mixture_hello(fingerprint=whole)), protocol.Welcome)
    err = wire.refusal(**mixture_hello(fingerprint="0" * 32))
    assert err.code == "dataset_changed" and whole in err.message


def test_bad_schedules_and_unknown_sources_are_refused(wire: Wire) -> None:
    err = wire.refusal(sources=("web", "code"), schedule=((5, 1, 1),))
    assert err.code == "bad_request" and "bad mixture schedule" in err.message
    err = wire.refusal(sources=("web", "code"), schedule=((0, 65536, 1),))
    assert err.code == "bad_request" and "65536" in err.message
    # periods of distinct weightings are bounded all together (tables cost the server)
    heavy = tuple((k * 10, 65535 - 2 * k, 1 + 2 * k) for k in range(5))  # none reduces
    err = wire.refusal(sources=("web", "code"), schedule=heavy)
    assert err.code == "bad_request" and "periods summing to 327680 rows" in err.message
    # four largest periods fit; a weighting used again costs nothing more
    light = (*((k * 10, 65535 - 2 * k, 1 + 2 * k) for k in range(4)), (40, 65535, 1))
    assert isinstance(wire.hello(sources=("web", "code"), schedule=light), protocol.Welcome)
    err = wire.refusal(sources=("web", "tiny"), schedule=((0, 1, 1),))
    assert err.code == "bad_request" and "mixture source 'tiny'" in err.message
    err = wire.refusal(sources=("web", "nope"), schedule=((0, 1, 1),))
    assert err.code == "unknown_dataset" and "'nope'" in err.message
    err = wire.refusal(dataset="web", sources=("web", "code"), schedule=((0, 1, 1),))
    assert err.code == "bad_request" and "dataset must be empty" in err.message


def test_job_ids_cover_the_schedule_and_reduce_weights(server: LiveServer) -> None:
    a, b = Wire(server), Wire(server)
    try:
        first = a.welcome(**mixture_hello())
        scaled = Mixture(
            [(0, {"web": 6, "code": 4, "math": 2}), (240, {"web": 2, "code": 2, "math": 12})]
        )
        assert b.welcome(**mixture_hello(scaled)).job == first.job  # the same order
        later = Mixture([*SCHEDULE, (10_000, {"web": 1})])
        assert b.welcome(**mixture_hello(later)).job != first.job
        assert b.welcome(**mixture_hello(seed=SEED + 1)).job != first.job
        single = b.welcome(dataset="web")
        assert single.job != first.job and not single.source_fingerprints
    finally:
        a.close()
        b.close()


def job_view(server: LiveServer, jid: str, position: int) -> dict[str, Any]:
    """Job ``jid`` from /v1/jobs once the snapshot shows it at ``position`` (bounded)."""
    job: dict[str, Any] = {}
    for _ in range(100):  # the snapshot refreshes every 0.5 s
        jobs = httpx.get(
            server.http + "/v1/jobs", headers={"Authorization": f"Bearer {ALL}"}, timeout=10
        ).json()
        job = next((j for j in jobs if j["id"] == jid), {})
        if job.get("position") == position:
            break
        time.sleep(0.1)
    assert job.get("position") == position, job
    return job


CONSUMED = 150  # a position the trainer reports having consumed (after the first get)


def test_jobs_view_shows_schedule_and_per_source_progress(
    server: LiveServer, opened: dict[str, Dataset]
) -> None:
    mixture = Mixture([(0, {"web": 2, "code": 1, "math": 1}), (96, {"web": 1, "math": 3})])
    w = Wire(server)
    try:
        welcome = w.welcome(**mixture_hello(mixture, seed=SEED + 7))
        w.get(welcome.job, 0, 0, count=40)
        w.get(welcome.job, 1, 0, count=40, consumed=CONSUMED)
    finally:
        w.close()
    position = 40 * BATCH * WORLD
    taken = mixture.counts(CONSUMED)
    job = job_view(server, welcome.job, position)
    assert job["dataset"] == "web+code+math" and job["sources"] == list(NAMES)
    assert job["schedule"] == [
        {"start": 0, "weights": {"web": 2, "code": 1, "math": 1}},
        {"start": 96, "weights": {"web": 1, "math": 3}},
    ]
    counts = mixture.counts(position)
    assert sum(counts) == position
    progress = job["source_progress"]
    assert [p["name"] for p in progress] == list(NAMES)
    for p, n, c in zip(progress, NAMES, counts, strict=True):
        windows = (opened[n].n_tokens - 1) // SEQ
        assert p["rows_served"] == c and p["epoch"] == c // windows
        assert p["consumed_rows"] == taken[NAMES.index(n)]
        assert p["consumed_epoch"] == taken[NAMES.index(n)] // windows
        assert p["epoch_windows"] == windows and p["fingerprint"] == opened[n].fingerprint
    assert progress[2]["epoch"] >= 1  # math wrapped around on its own
    assert job["epoch_windows"] == sum(p["epoch_windows"] for p in progress)
    assert job["shuffle"] == "global"
    # its kind, and the weights in effect at the served position (past 96: the second)
    assert job["kind"] == "mixture" and job["run"] is None
    assert job["current_weights"] == {"web": 1, "math": 3}


def test_a_single_dataset_job_says_its_kind(server: LiveServer) -> None:
    w = Wire(server)
    try:
        welcome = w.welcome(dataset="web", seed=SEED + 8)
        w.get(welcome.job, 0, 0, count=1)
    finally:
        w.close()
    job = job_view(server, welcome.job, BATCH * WORLD)
    assert job["kind"] == "dataset" and job["current_weights"] is None
    assert job["sources"] is None and job["dataset"] == "web"


def test_datasets_of_one_tokenizer_file_show_one_tokenizer_hash(server: LiveServer) -> None:
    """Their kinds differ (trained vs loaded from the other's tokenizer.json), their hash
    does not; a BPE trained on another corpus, and the byte datasets, have their own."""
    listed = httpx.get(
        server.http + "/v1/datasets", headers={"Authorization": f"Bearer {ALL}"}, timeout=10
    ).json()
    tok = {d["name"]: d["tokenizer"] for d in listed if "tokenizer" in d}
    assert tok["bpe-web"]["kind"] != tok["bpe-code"]["kind"]
    assert tok["bpe-web"]["hash"] == tok["bpe-code"]["hash"]
    assert tok["bpe-math"]["hash"] != tok["bpe-web"]["hash"]
    assert tok["web"]["hash"] == tok["code"]["hash"] != tok["bpe-web"]["hash"]  # both byte
    assert all(t["hash"].startswith("blake2b-128:") for t in tok.values())


# -- block shuffle -----------------------------------------------------------------------


def shards(ds: Dataset) -> list[int]:
    return [s.tokens for s in ds.manifest.shards]


def test_block_shuffle_job_serves_the_block_order(
    server: LiveServer, wire: Wire, opened: dict[str, Dataset]
) -> None:
    ds = opened["web"]
    welcome = wire.welcome(dataset="web", shuffle="block")
    sizes = default_block_sizes(shards(ds), SEQ)
    assert (welcome.region_windows, welcome.block_regions) == sizes
    plan = Plan(ds.n_tokens, SEQ, BATCH, WORLD, SEED, shuffle="block", region_windows=sizes[0],
                block_regions=sizes[1])  # fmt: skip
    global_plan = Plan(ds.n_tokens, SEQ, BATCH, WORLD, SEED)
    for rank, pos, count, stride in [(0, 0, 30, 1), (1, 1000, 7, 3)]:
        tokens, rows = wire.get(welcome.job, rank, pos, count, stride)
        ids, epochs = plan.windows(plan.rank_positions(rank, pos, count, stride))
        assert rows["window"].tolist() == ids.tolist() and rows["epoch"].tolist() == epochs.tolist()
        assert np.array_equal(tokens, ds.gather(plan.token_starts(ids), SEQ + 1))
        assert protocol.ROW_SOURCE not in rows
        other, _ = global_plan.windows(global_plan.rank_positions(rank, pos, count, stride))
        assert ids.tolist() != other.tolist()  # really another order
    job = job_view(server, welcome.job, 1000 + 6 * 3 * BATCH * WORLD + BATCH * WORLD)
    assert (job["shuffle"], job["region_windows"], job["block_regions"]) == ("block", *sizes)
    assert job["sources"] is job["schedule"] is job["source_progress"] is None
    assert job["dataset"] == "web"

    explicit = wire.welcome(dataset="web", shuffle="block", region_windows=7, block_regions=3)
    assert (explicit.region_windows, explicit.block_regions) == (7, 3)
    assert explicit.job != welcome.job
    plan = Plan(ds.n_tokens, SEQ, BATCH, WORLD, SEED, shuffle="block", region_windows=7,
                block_regions=3)  # fmt: skip
    _, rows = wire.get(explicit.job, 0, 64, 4)
    assert rows["window"].tolist() == plan.windows(plan.rank_positions(0, 64, 4))[0].tolist()
    # naming the derived sizes is the same job as leaving them to the server
    same = wire.welcome(dataset="web", shuffle="block", region_windows=sizes[0])
    assert same.job == welcome.job


def test_block_shuffle_mixture_derives_sizes_per_source(
    wire: Wire, opened: dict[str, Dataset]
) -> None:
    mixture = Mixture(SCHEDULE)
    welcome = wire.welcome(**mixture_hello(shuffle="block"))
    sizes = {n: default_block_sizes(shards(opened[n]), SEQ) for n in NAMES}
    assert welcome.source_region_windows == tuple(sizes[n][0] for n in NAMES)
    assert welcome.source_block_regions == tuple(sizes[n][1] for n in NAMES)
    order = {
        n: {"shuffle": "block", "region_windows": r, "block_regions": b}
        for n, (r, b) in sizes.items()
    }
    tokens, rows = wire.get(welcome.job, 1, 180, 10, 2)
    want = expected_mixture_rows(opened, mixture, 1, 180, 10, 2, **order)
    assert rows["source"].tolist() == want[3].tolist()
    assert rows["window"].tolist() == want[1].tolist()
    assert np.array_equal(tokens, want[0])


def test_random_mixture_hellos_get_an_answer_never_an_internal_error(
    server: LiveServer, wire: Wire
) -> None:
    """Hellos with random sources (known, unknown, forbidden-kind, duplicated), schedules
    and shuffle settings: each gets a welcome or a refusal with a client-side code."""
    rng = random.Random(13)
    pool = [*NAMES, "odd", "tiny", "bpe-web", "nope", "x.y"]
    codes: dict[str, int] = {}
    for _ in range(300):
        names = rng.sample(pool, rng.randint(1, 4))
        if rng.random() < 0.1:
            names.append(names[0])
        rows = []
        start = rng.choice([0, 0, 0, 3])
        for _ in range(rng.randint(1, 4)):
            weights = [rng.choice([0, 1, 2, 7, 1000, 70000]) for _ in names]
            rows.append((start, *weights))
            start += rng.choice([1, 100, 0, -1])
        shuffle = rng.choice(["global", "block"])
        sizes = [rng.choice([0, 0, 1, 5]) for _ in range(2)] if shuffle == "block" else [0, 0]
        raw: dict[str, Any] = {
            "v": protocol.VERSION, "t": "hello", "dataset": "", "seq_len": SEQ,
            "batch_size": BATCH, "seed": rng.randrange(2**64), "world_size": WORLD,
            "rank": 0, "worker": 0, "window": 4, "client": "random", "sources": names,
            "schedule": rows, "shuffle": shuffle, "region_windows": sizes[0],
            "block_regions": sizes[1],
        }  # fmt: skip
        wire.sock.send(msgpack.packb(raw))
        assert wire.sock.poll(10_000)
        reply = protocol.decode_header(wire.sock.recv_multipart()[0])
        code = reply.code if isinstance(reply, protocol.Err) else reply.TYPE
        codes[code] = codes.get(code, 0) + 1
    assert set(codes) <= {"welcome", "bad_request", "unknown_dataset"}, codes
    assert codes.get("welcome", 0) >= 3 and codes.get("bad_request", 0) > 50, codes
    assert server.get("/readyz").status_code == 200


def test_a_long_mixture_label_is_cut_saying_how_many_sources_are_left_out(
    opened: dict[str, Dataset],
) -> None:
    plan = Plan(opened["web"].n_tokens, SEQ, BATCH)
    names = [f"source-{i:03d}-{'x' * 20}" for i in range(30)]
    feed = Feed(tuple(Source(n, opened["web"], plan) for n in names))
    assert len(feed.label) <= MAX_LABEL and feed.label.startswith(names[0] + "+")
    shown = feed.label.split("+...(")[0].split("+")
    assert shown == names[: len(shown)] and feed.label.endswith(f"({30 - len(shown)} more)")
    short = Feed(tuple(Source(n, opened["web"], plan) for n in NAMES))
    assert short.label == "web+code+math"


# -- the data plane's mixture read path, without sockets --------------------------------


def mixed_feed(store: Path, opened: dict[str, Dataset]) -> Feed:
    mixture = Mixture(SCHEDULE)
    sources = tuple(
        Source(n, opened[n], Plan(opened[n].n_tokens, SEQ, BATCH, WORLD, seed=source_seed(SEED, n)))
        for n in mixture.names
    )
    return Feed(sources, mixture)


def expected_rows(feed: Feed, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, tokens) of every position by the definition: locate, then each source's
    own plan and dataset, one row at a time."""
    assert feed.mixture is not None
    which, spos = feed.mixture.locate(positions)
    rows = []
    for s, p in zip(which.tolist(), spos.tolist(), strict=True):
        src = feed.sources[s]
        ids, _ = src.plan.windows(np.array([p]))
        start = int(ids[0]) * SEQ
        rows.append(src.dataset.read(start, start + SEQ + 1))
    return which, np.stack(rows)


@pytest.mark.parametrize("pos", [0, 200, 8192 - 40, 5 * 8192 + 3])
@pytest.mark.parametrize("stride", [1, 3])
def test_a_mixture_request_equals_the_definition_across_blocks_and_strides(
    store: Path, opened: dict[str, Dataset], pos: int, stride: int
) -> None:
    """Cached blocks of the mixture's order (a request inside one block, across two,
    strided) and the one-pass read over every source's shards give exactly the rows the
    mixture math and each source's plan define."""
    feed = mixed_feed(store, opened)
    plan = feed.first.plan
    for rank in range(2):
        positions = plan.rank_positions(rank, pos, 12, stride)
        tokens, rows = feed.assemble(rank, pos, count=12, stride=stride)
        which, want = expected_rows(feed, positions)
        np.testing.assert_array_equal(rows[protocol.ROW_SOURCE], which)
        np.testing.assert_array_equal(tokens, want)


def test_a_mixture_read_of_a_damaged_source_names_it(
    tmp_path: Path, opened: dict[str, Dataset]
) -> None:
    """A source whose shard was cut under the server fails the read naming that source;
    a closed source says closed; the others' rows are unaffected."""
    import os

    from tokenfeed.errors import CorruptShard, StoreError
    from tokenfeed_server.store.format import HEADER_SIZE
    from tokenfeed_server.store.mixed_gather import MixedGather

    root = tmp_path / "store"
    for k, name in enumerate(NAMES):
        lo, hi = RANGES[name]
        write_dataset(root, name, docs(lo, hi, 60, k), tokenizer=BYTE, shuffle_seed=k,
                      shard_tokens=500)  # fmt: skip
    sets = [open_dataset(root, n) for n in NAMES]
    try:
        reader = MixedGather(sets)
        which = np.array([0, 1, 2, 1, 0, 2], dtype=np.int64)
        starts = np.array([0, 499 - 3, 10, 20, 998, 0], dtype=np.int64)  # 2 cross shards
        out = np.zeros((6, 8), dtype=sets[0].dtype)
        reader.gather(which, starts, 8, out=out)
        for i, (s, st) in enumerate(zip(which.tolist(), starts.tolist(), strict=True)):
            np.testing.assert_array_equal(out[i], sets[s].read(st, st + 8))
        with pytest.raises(IndexError, match="outside dataset 'math'"):
            reader.gather(which, np.array([0, 0, 10**6, 0, 0, 0]), 8, out=out)
        code = sets[1]
        os.truncate(root / "code" / code.manifest.shards[0].name, HEADER_SIZE + 10)
        with pytest.raises(CorruptShard, match="dataset 'code'"):
            reader.gather(which, starts, 8, out=out)
        sets[2].close()
        with pytest.raises(StoreError, match="'math' is closed"):
            reader.gather(np.array([0, 2]), np.array([0, 0]), 8, out=out[:2])
    finally:
        for ds in sets:
            ds.close()
