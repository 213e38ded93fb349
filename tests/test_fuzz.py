"""Hostile input: thousands of malformed messages, random TCP bytes, half-open connections,
all while a well-behaved trainer reads. The server must stay up, keep its memory bounded,
and give the trainer every batch right. Bounded in count and time; loopback only."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import psutil
import pytest
import zmq

from live_server import LiveServer
from shard_data import BYTE
from tokenfeed import TokenFeedDataset, protocol
from tokenfeed.errors import ProtocolError
from tokenfeed.plan import Plan
from tokenfeed_server.store import open_dataset, write_dataset

pytestmark = [pytest.mark.network, pytest.mark.slow]

SEQ, BATCH, STEPS = 128, 8, 400


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    rng = np.random.default_rng(5)
    docs = [
        rng.integers(0, 256, size=int(n), dtype=np.uint16)
        for n in rng.integers(100, 3000, size=500)
    ]
    write_dataset(
        root,
        "alpha",
        docs,
        shuffle_seed=0,
        shard_tokens=50_000,
        tokenizer=BYTE,
    )
    return root


@pytest.fixture
def server(store: Path, tmp_path: Path) -> Iterator[LiveServer]:
    with LiveServer(store, log_path=tmp_path / "server.log") as srv:
        yield srv


def valid_headers() -> list[dict[str, Any]]:
    return [
        {
            "v": protocol.VERSION,
            "t": "hello",
            "dataset": "alpha",
            "seq_len": SEQ,
            "batch_size": BATCH,
            "seed": 0,
            "world_size": 1,
            "rank": 0,
            "worker": 0,
            "window": 4,
            "client": "fuzz",
        },
        {
            "v": protocol.VERSION,
            "t": "get",
            "req": 1,
            "job": "0123456789abcdef",
            "rank": 0,
            "pos": 0,
            "count": 1,
            "stride": 1,
        },
        {"v": protocol.VERSION, "t": "ping"},
    ]


WEIRD: list[Any] = [
    None,
    True,
    -1,
    -(2**63),
    2**64 - 1,
    2**62,
    0,
    1.5,
    "",
    "x" * 600,
    b"\x00" * 10,
    [],
    {},
    [1, 2],
    {"a": 1},
    "alpha/../x",
    "nope",
    10**18,
    ["x"] * 2000,  # over the list bound
    {str(i): i for i in range(2000)},  # over the map bound
    [[[[[["deep"]]]]]],
    {"a": [1, {"b": 2}]},
    ("window", "epoch"),
]


def mutate(rng: random.Random) -> list[bytes]:
    header = rng.choice(valid_headers())
    kind = rng.randrange(10)
    if kind == 0:  # a field gets a value of the wrong type or absurd size
        key = rng.choice(list(header))
        header[key] = rng.choice(WEIRD)
    elif kind == 1:  # a field goes missing
        header.pop(rng.choice(list(header)))
    elif kind == 2:  # an unexpected field
        header[rng.choice(["extra", "payload", "zz"])] = rng.choice(WEIRD)
    elif kind == 3:  # the header is not a map
        return [msgpack.packb(rng.choice([[1, 2, 3], "hello", 7, None]))]
    elif kind == 4:  # random bytes
        return [rng.randbytes(rng.randrange(0, 300))]
    elif kind == 5:  # truncated msgpack
        raw = msgpack.packb(header)
        return [raw[: rng.randrange(0, len(raw))]]
    elif kind == 6:  # extra frames, some big
        return [msgpack.packb(header), rng.randbytes(rng.randrange(0, 30_000))]
    elif kind == 7:  # a string over the string bound
        header["client"] = "y" * 5000
    elif kind == 8:  # another protocol version (a v1 peer, a future one)
        header["v"] = rng.choice([1, 3, "2", None])
    else:  # an optional field with a wrong or absurd value
        header["fingerprint"] = rng.choice(WEIRD)
    try:
        return [msgpack.packb(header)]
    except (TypeError, ValueError):
        return [rng.randbytes(20)]


def test_decoder_raises_only_protocol_errors() -> None:
    """Every mutation either decodes to a message or raises ProtocolError: never another
    exception type, whatever the bytes (the server maps ProtocolError to bad_request)."""
    rng = random.Random(7)
    outcomes: dict[str, int] = {}
    for _ in range(20_000):
        frames = mutate(rng)
        try:
            msg = protocol.decode_header(frames[0])
        except ProtocolError:
            outcomes["refused"] = outcomes.get("refused", 0) + 1
        else:
            assert protocol.decode_header(msg.header()) == msg  # what decodes re-encodes
            outcomes["decoded"] = outcomes.get("decoded", 0) + 1
    assert outcomes["refused"] > 10_000 and outcomes.get("decoded", 0) > 100, outcomes


def trainer(endpoint: str, result: dict[str, Any]) -> None:
    try:
        ds = TokenFeedDataset(
            endpoint,
            "alpha",
            seq_len=SEQ,
            batch_size=BATCH,
            seed=9,
            rank=0,
            world_size=1,
            samples=STEPS * BATCH,
            deadline=60.0,
            chunk_bytes=16 * 1024,
        )
        result["windows"] = [w for b in ds for w in b["window_ids"].tolist()]
    except BaseException as exc:
        result["error"] = exc


def test_server_survives_hostile_clients(server: LiveServer, store: Path, tmp_path: Path) -> None:
    proc = psutil.Process(server.proc.pid)  # type: ignore[union-attr]
    rss_before = proc.memory_info().rss
    rng = random.Random(20261202)
    outcome: dict[str, Any] = {}
    good = threading.Thread(target=trainer, args=(server.zmq, outcome))
    good.start()

    # Half-open connections that start a ZMTP greeting and then stall.
    stalled = []
    for _ in range(40):
        s = socket.create_connection(("127.0.0.1", server.zmq_port), timeout=5)
        s.sendall(b"\xff\x00\x00\x00")
        stalled.append(s)

    # Random bytes over raw TCP.
    for _ in range(200):
        with socket.create_connection(("127.0.0.1", server.zmq_port), timeout=5) as s:
            s.sendall(rng.randbytes(rng.randrange(1, 2000)))

    # Thousands of malformed ZeroMQ messages from a few DEALERs; replies are drained.
    ctx = zmq.Context()
    answers: dict[str, int] = {}
    deadline = time.monotonic() + 60
    try:
        for round_ in range(4):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 2000)
            sock.connect(server.zmq)
            for _ in range(750):
                sock.send_multipart(mutate(rng))
                while sock.poll(0):
                    reply = protocol.decode_header(sock.recv_multipart()[0])
                    answers[reply.TYPE] = answers.get(reply.TYPE, 0) + 1
            if round_ == 3:  # one message over max_message_bytes: libzmq drops the peer
                sock.send(b"\x00" * (1 << 17))
            while sock.poll(500):
                reply = protocol.decode_header(sock.recv_multipart()[0])
                answers[reply.TYPE] = answers.get(reply.TYPE, 0) + 1
            sock.close()
            assert time.monotonic() < deadline
    finally:
        ctx.term()
        for s in stalled:
            s.close()

    good.join(90)
    assert not good.is_alive()
    assert "error" not in outcome, outcome.get("error")
    with open_dataset(store, "alpha") as ds:
        plan = Plan(ds.n_tokens, SEQ, BATCH, 1, 9)
    expected = plan.windows(np.arange(STEPS * BATCH))[0].tolist()
    assert outcome["windows"] == expected  # every batch, in order, none twice

    assert server.proc is not None and server.proc.poll() is None
    assert server.get("/readyz").status_code == 200
    # bad input got answers, not silence or a crash (a client that does not read its
    # replies loses those past the send high-water mark, so count on the server too)
    assert answers.get("err", 0) > 100
    counters = server.get("/v1/status").json()["counters"]
    assert counters.get("err_bad_request", 0) > 1000
    assert "Traceback" not in (tmp_path / "server.log").read_text()  # no internal error
    rss_after = proc.memory_info().rss
    assert rss_after - rss_before < 200 * 2**20, (rss_before, rss_after)
