"""Small caches are used, not refused; read amplification is visible and refused by default.

A real server process serves a store in a moto S3 server through piece caches far
smaller than the dataset (about 2.4 pieces of 4 KiB: one batch's rows need more pieces
than that): requests are read in rounds that fit and every batch equals the local
server's; only a cache that cannot hold one row's pieces is refused, naming
``--cache-size``. A global shuffle through a cache smaller than its dataset is refused
with the figures and the fixes unless the trainer passes ``allow_read_amplification``,
and ``/v1/jobs`` and ``/metrics`` show the bytes fetched per byte served. A new client
still talks to a server from before the field (a ROUTER answering in that server's
words stands in for it), and an old client's hello is the bytes it always was.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from live_server import LiveServer
from old_server import OldServer
from s3_server import S3Server, s3_server_module  # noqa: F401  (fixture)
from shard_data import BYTE
from tokenfeed import TokenFeedDataset, protocol
from tokenfeed.errors import TokenFeedError
from tokenfeed.protocol import JobSpec
from tokenfeed.transport.client import ClientOptions, FeedClient
from tokenfeed_server.store import write_dataset
from tokenfeed_server.store.objects import ObjectStore, S3Location
from tokenfeed_server.store.publish import publish_dataset
from waiting import wait_until

pytestmark = pytest.mark.network

BUCKET = "small-cache-tests"
PIECE = 4096
URL = f"s3://{BUCKET}/store"
SEQ = 64


@pytest.fixture(scope="module")
def store(
    s3_server_module: S3Server,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, S3Server, int]]:
    """Dataset ``d`` (about 40 KB: ten pieces) locally and in the bucket; its bytes."""
    s3 = s3_server_module
    s3.make_bucket(BUCKET)
    local = tmp_path_factory.mktemp("local")
    rng = np.random.default_rng(7)
    docs = [rng.integers(0, 256, size=int(rng.integers(100, 400))) for _ in range(160)]
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3.env({}).items():
            mp.setenv(key, value)
        objects = ObjectStore(S3Location(BUCKET, "store"))
        manifest = write_dataset(
            local, "d", docs, tokenizer=BYTE, shuffle_seed=0, shard_tokens=16_000,
            piece_bytes=PIECE,
        )  # fmt: skip
        publish_dataset(local / "d", objects, "d")
    yield local, s3, sum(s.file_size(manifest.itemsize) for s in manifest.shards)


def _server(s3: S3Server, tmp: Path, size: int) -> LiveServer:
    command = [
        sys.executable, "-m", "tokenfeed_server.cli", "serve", "--store", URL,
        "--host", "127.0.0.1", "--zmq-port", "0", "--http-port", "0",
        "--cache-dir", str(tmp / "cache"), "--cache-size", str(size),
        "--remote-scan-interval-s", "0.2",
    ]  # fmt: skip
    return LiveServer(command=command, env=s3.env(), log_path=tmp / "server.log")


def _batches(endpoint: str, **kw: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    args: dict[str, Any] = {
        "seq_len": SEQ, "batch_size": 8, "rank": 0, "world_size": 1, "epochs": 1,
        "request_timeout": 5.0, "deadline": 60.0, **kw,
    }  # fmt: skip
    loader = TokenFeedDataset(endpoint, "d", **args)
    return [(b["input_ids"].numpy(), b["window_ids"].numpy()) for b in loader]


@pytest.mark.parametrize("shuffle", ["global", "block"])
def test_a_request_capped_to_a_small_cache_is_served_exactly(
    store: tuple[Path, S3Server, int], tmp_path: Path, shuffle: str
) -> None:
    """A cache a third of the dataset (about 2.4 pieces), where one batch of eight rows
    needs more pieces than it holds: served in rounds, every window once, the bytes of
    the local server; the bytes fetched per byte served shown per job."""
    local, s3, size = store
    kw: dict[str, Any] = {"shuffle": shuffle, "chunk_bytes": 1 << 20}
    if shuffle == "global":
        kw["allow_read_amplification"] = True
    else:
        kw.update(region_windows=50, block_regions=2)
    with LiveServer(local) as plain:
        expected = _batches(plain.zmq, **kw)
    with _server(s3, tmp_path, size // 3) as srv:
        got = _batches(srv.zmq, **kw)
        status = srv.get("/v1/status").json()
        # charged to the job each second, shown in the next snapshot
        wait_until(
            lambda: _fetched(srv),
            10,
            "bytes fetched charged to the job",
        )
        jobs = srv.get("/v1/jobs").json()
        metrics = srv.get("/metrics").text
    assert len(got) == len(expected) > 0
    for (tokens, windows), (want_tokens, want_windows) in zip(got, expected, strict=True):
        np.testing.assert_array_equal(windows, want_windows)
        np.testing.assert_array_equal(tokens, want_tokens)
    windows = np.concatenate([w for _, w in got])
    n = int(windows.max()) + 1  # the last batch runs into the next epoch: wrapped ids
    assert sorted(windows[:n].tolist()) == list(range(n))  # every window once an epoch
    assert status["cache"]["reserved_bytes"] <= size // 3
    (job,) = jobs
    assert job["bytes_fetched"] > 0 and job["fetched_per_served"] > 0
    assert "tokenfeed_job_bytes_fetched_total{" in metrics
    assert "tokenfeed_job_fetched_per_served{" in metrics


def test_a_cache_that_cannot_hold_one_row_is_refused_naming_the_setting(
    store: tuple[Path, S3Server, int], tmp_path: Path
) -> None:
    _, s3, _ = store
    with (
        _server(s3, tmp_path, PIECE + PIECE // 2) as srv,  # a row may need two pieces
        pytest.raises(TokenFeedError, match="--cache-size") as info,
    ):
        _batches(srv.zmq, shuffle="block", region_windows=50, block_regions=2)
    assert "one row" in str(info.value)


def test_a_global_shuffle_over_a_small_cache_is_refused_unless_asked_for(
    store: tuple[Path, S3Server, int], tmp_path: Path
) -> None:
    _, s3, size = store
    with _server(s3, tmp_path, size // 3) as srv:
        with pytest.raises(TokenFeedError) as info:
            _batches(srv.zmq)
        message = str(info.value)
        for words in (str(size), "--cache-size", "shuffle='block'", "allow_read_amplification"):
            assert words in message, message
        assert "bytes from storage per byte served" in message
        assert len(_batches(srv.zmq, allow_read_amplification=True)) > 0
        assert len(_batches(srv.zmq, shuffle="block")) > 0  # the first fix


def test_a_cache_that_holds_the_dataset_serves_a_global_shuffle_without_asking(
    store: tuple[Path, S3Server, int], tmp_path: Path
) -> None:
    _, s3, size = store
    with _server(s3, tmp_path, size) as srv:
        assert len(_batches(srv.zmq)) > 0
        wait_until(
            lambda: _fetched(srv),
            10,
            "bytes fetched charged to the job",
        )
        (job,) = srv.get("/v1/jobs").json()
    assert 0 < job["fetched_per_served"] <= 2.0  # each piece fetched about once


def _fetched(srv: LiveServer) -> bool:
    """True once the job is listed with bytes fetched (the list is a snapshot)."""
    jobs = srv.get("/v1/jobs").json()
    return bool(jobs) and jobs[0]["bytes_fetched"] > 0


# -- mixed versions -------------------------------------------------------------------


def test_a_new_client_asking_for_amplification_talks_to_an_old_server() -> None:
    old = OldServer({"allow_read_amplification"})
    options = ClientOptions(request_timeout=2.0, deadline=10.0, allow_read_amplification=True)
    try:
        with FeedClient(old.endpoint, JobSpec("d", 16, 4, 5, 1), rank=0, worker=0,
                        options=options) as client:  # fmt: skip
            assert client.hello().job == "0123456789abcdef"
    finally:
        old.close()
    assert [f.get("allow_read_amplification") for f in old.hellos] == [True, None]
    # refused, the client asks again with exactly the hello of a client without it
    assert old.hellos[1] == {
        k: v for k, v in old.hellos[0].items() if k != "allow_read_amplification"
    }


def test_an_old_clients_hello_is_unchanged_and_a_new_server_answers_it(
    store: tuple[Path, S3Server, int], tmp_path: Path
) -> None:
    """Without the field the hello's bytes are those of before it; a new server answers
    such a hello (here: refuses the amplification, as it refuses any client that did not
    ask for it), and welcomes a block shuffle."""
    _, s3, size = store
    fields = {"dataset": "d", "seq_len": SEQ, "batch_size": 8, "seed": 0, "world_size": 1,
              "rank": 0, "worker": 0, "window": 4, "client": "old"}  # fmt: skip
    header = protocol.Hello(**fields).header()
    assert "allow_read_amplification" not in msgpack.unpackb(header)
    with _server(s3, tmp_path, size // 3) as srv:
        refused = _ask(srv.zmq, header)
        block = _ask(srv.zmq, protocol.Hello(**fields, shuffle="block").header())
    assert isinstance(refused, protocol.Err) and "shuffle='block'" in refused.message
    assert not refused.retry
    assert isinstance(block, protocol.Welcome)


def _ask(endpoint: str, header: bytes) -> protocol.Message:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(header)
        assert sock.poll(20_000), "no answer to hello"
        return protocol.decode_header(sock.recv())
    finally:
        sock.close(linger=0)
