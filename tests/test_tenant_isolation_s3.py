"""Two datasets with the same bytes in object storage (a real moto S3 server process):
deleting one's objects fails only the jobs that read it, with an error naming only that
dataset and neither the bucket, the prefix nor the endpoint; the other dataset is served
exactly, whichever job asked first.

Before, the piece cache remembered failures by content: bob's healthy ``bob-same`` failed
with ``cannot fetch s3://train/store/alice-web/shard-...: no such object``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from live_server import LiveServer
from s3_server import S3Server, s3_server  # noqa: F401  (fixture)
from shard_data import BYTE
from tokenfeed import TokenFeedDataset
from tokenfeed.errors import TokenFeedError
from tokenfeed_server.store import write_dataset
from tokenfeed_server.store.objects import ObjectStore, S3Location
from tokenfeed_server.store.publish import publish_dataset

pytestmark = pytest.mark.network

BUCKET = "train"
PIECE = 4096


def _docs() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, size=int(rng.integers(100, 800))) for _ in range(200)]


@pytest.fixture
def shared(s3_server: S3Server, tmp_path: Path) -> Iterator[tuple[Path, S3Server]]:  # noqa: F811
    """``alice-web`` and ``bob-same``, the same bytes, published; alice's shards deleted."""
    s3_server.make_bucket(BUCKET)
    local = tmp_path / "local"
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3_server.env({}).items():
            mp.setenv(key, value)
        objects = ObjectStore(S3Location(BUCKET, "store"))
        for name in ("alice-web", "bob-same"):
            write_dataset(
                local, name, _docs(), tokenizer=BYTE, shuffle_seed=0,
                shard_tokens=40_000, piece_bytes=PIECE,
            )  # fmt: skip
            publish_dataset(local / name, objects, name)
        shards = [i.key for i in objects.list("alice-web/") if not i.key.endswith(".json")]
        assert shards
        objects.delete(shards)
    yield local, s3_server


def _server(s3: S3Server, tmp_path: Path) -> LiveServer:
    command = [
        sys.executable, "-m", "tokenfeed_server.cli", "serve", "--store",
        f"s3://{BUCKET}/store", "--host", "127.0.0.1", "--zmq-port", "0", "--http-port", "0",
        "--cache-dir", str(tmp_path / "cache"), "--cache-size", "64MB",
        "--storage-retry-s", "2",
    ]  # fmt: skip
    return LiveServer(command=command, env=s3.env(), log_path=tmp_path / "server.log")


def _read(endpoint: str, name: str) -> list[np.ndarray]:
    loader = TokenFeedDataset(
        endpoint, name, seq_len=64, batch_size=4, rank=0, world_size=1, samples=200,
        request_timeout=5.0, deadline=60.0,
    )  # fmt: skip
    return [b["input_ids"].numpy() for b in loader]


def _outcome(endpoint: str, name: str, out: dict[str, Any]) -> None:
    try:
        out[name] = _read(endpoint, name)
    except TokenFeedError as exc:
        out[name] = exc


@pytest.fixture
def reference(shared: tuple[Path, S3Server], tmp_path: Path) -> list[np.ndarray]:
    """bob-same's batches from the local copy of the store."""
    with LiveServer(shared[0], log_path=tmp_path / "local.log") as srv:
        return _read(srv.zmq, "bob-same")


@pytest.mark.parametrize("order", ["alice first", "together"])
def test_a_deleted_object_fails_only_its_own_dataset(
    shared: tuple[Path, S3Server], reference: list[np.ndarray], tmp_path: Path, order: str
) -> None:
    _, s3 = shared
    out: dict[str, Any] = {}
    with _server(s3, tmp_path) as srv:
        if order == "alice first":  # alice's failure is remembered when bob asks
            _outcome(srv.zmq, "alice-web", out)
            _outcome(srv.zmq, "bob-same", out)
        else:  # both wait on the same pieces while alice's object is tried
            threads = [
                threading.Thread(target=_outcome, args=(srv.zmq, name, out))
                for name in ("alice-web", "bob-same")
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
        endpoint = s3.env()["AWS_ENDPOINT_URL"]
    bob = out["bob-same"]
    assert not isinstance(bob, Exception), f"bob's healthy dataset failed: {bob}"
    assert len(bob) == len(reference)
    for got, want in zip(bob, reference, strict=True):
        np.testing.assert_array_equal(got, want)
    alice = out["alice-web"]
    assert isinstance(alice, TokenFeedError), "alice's dataset has no shards: it must fail"
    message = str(alice)
    assert "alice-web" in message  # her own dataset is named
    for secret in ("bob-same", f"s3://{BUCKET}", "/store/", endpoint):
        assert secret not in message, (secret, message)
