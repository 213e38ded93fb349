"""Health you can see, repair that repairs: a real server serving a real S3 protocol server
(moto, its own process) while objects go missing or bad in the bucket.

* A deleted object: the job that needs it fails naming it; ``/v1/datasets`` says the
  dataset is ``unavailable`` naming the object within 30 s, ``/readyz`` stays ready and
  names it, ``/metrics`` counts it; the other dataset keeps serving. Put back, the dataset
  returns to ``ok`` by itself (the server's re-check), and a job reads it whole.
* A damaged object (bytes overwritten, same size) and a deleted one: the job refuses naming
  the shard, ``inspect --verify`` lists both, ``--repair --source`` makes the dataset whole,
  and the next job on the same server reads the whole epoch exactly.
* A dataset whose object went missing before the server started does not open: it is
  listed ``unavailable`` with the object named; put back, it opens without a restart.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from live_server import LiveServer
from s3_server import S3Server, s3_server_module  # noqa: F401  (fixture)
from shard_data import BYTE
from tokenfeed import TokenFeedDataset
from tokenfeed.errors import TokenFeedError
from tokenfeed_server.cli import main
from tokenfeed_server.store import open_dataset, write_dataset
from tokenfeed_server.store.objects import ObjectStore, S3Location
from tokenfeed_server.store.publish import publish_dataset
from waiting import wait_until

pytestmark = pytest.mark.network

BUCKET = "health-e2e"
PIECE = 4096
STORE = f"s3://{BUCKET}/store"
SEQ = 64


def _docs(seed: int, n: int = 300) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(100, 800))) for _ in range(n)]


class Bucket:
    """The bucket, the local store its datasets were published from, and boto3 on both."""

    def __init__(self, s3: S3Server, local: Path) -> None:
        self.s3 = s3
        self.local = local
        self.objects = ObjectStore(S3Location(BUCKET, "store"))

    def publish(self, name: str, seed: int) -> list[str]:
        """Dataset ``name`` written locally and published; its shard keys, in order."""
        write_dataset(
            self.local, name, _docs(seed), tokenizer=BYTE, shuffle_seed=0,
            shard_tokens=40_000, piece_bytes=PIECE,
        )  # fmt: skip
        manifest = publish_dataset(self.local / name, self.objects, name)
        return [f"store/{name}/{s.name}" for s in manifest.shards]

    def get(self, key: str) -> bytes:
        return bytes(self.s3.client.get_object(Bucket=BUCKET, Key=key)["Body"].read())

    def put(self, key: str, data: bytes) -> None:
        self.s3.client.put_object(Bucket=BUCKET, Key=key, Body=data)

    def delete(self, key: str) -> None:
        self.s3.client.delete_object(Bucket=BUCKET, Key=key)


@pytest.fixture(scope="module")
def bucket(
    s3_server_module: S3Server,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Bucket]:
    s3_server_module.make_bucket(BUCKET)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3_server_module.env({}).items():
            mp.setenv(key, value)
        yield Bucket(s3_server_module, tmp_path_factory.mktemp("local"))


def _server(bucket: Bucket, tmp_path: Path) -> LiveServer:
    command = [
        sys.executable, "-m", "tokenfeed_server.cli", "serve", "--store", STORE,
        "--host", "127.0.0.1", "--zmq-port", "0", "--http-port", "0",
        "--cache-dir", str(tmp_path / "cache"), "--cache-size", str(8 << 20),
        "--cache-failure-ttl-s", "1",
    ]  # fmt: skip
    return LiveServer(command=command, env=bucket.s3.env(), log_path=tmp_path / "server.log")


def _batches(srv: LiveServer, name: str, samples: int) -> list[tuple[np.ndarray, np.ndarray]]:
    loader = TokenFeedDataset(
        srv.zmq, name, seq_len=SEQ, batch_size=4, rank=0, world_size=1, samples=samples,
        request_timeout=5.0, deadline=60.0,
    )  # fmt: skip
    return [(b["input_ids"].numpy(), b["window_ids"].numpy()) for b in loader]


def _datasets(srv: LiveServer) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in srv.get("/v1/datasets").json()}


def _epoch(bucket: Bucket, name: str) -> int:
    """Samples of a bit more than one epoch of ``name``: every window is read."""
    with open_dataset(bucket.local, name) as ds:
        return ds.n_tokens // SEQ + 8


def _assert_exact(bucket: Bucket, name: str, got: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Every row is the local dataset's window, and every window of the epoch came."""
    with open_dataset(bucket.local, name) as ds:
        windows = set()
        for tokens, ids in got:
            for row, w in zip(tokens, ids, strict=True):
                np.testing.assert_array_equal(row, ds.read(int(w) * SEQ, int(w) * SEQ + SEQ))
                windows.add(int(w))
        assert windows == set(range(max(windows) + 1))
        assert (max(windows) + 2) * SEQ > ds.n_tokens  # the last whole window of the epoch


def test_a_deleted_object_shows_unavailable_and_comes_back_without_a_restart(
    bucket: Bucket, tmp_path: Path
) -> None:
    keys = bucket.publish("web", seed=1)
    bucket.publish("code", seed=2)
    gone = keys[1]
    url = f"s3://{BUCKET}/{gone}"
    data = bucket.get(gone)
    with _server(bucket, tmp_path) as srv:
        assert _datasets(srv)["web"]["status"] == "ok"
        bucket.delete(gone)
        with pytest.raises(TokenFeedError) as refused:
            _batches(srv, "web", _epoch(bucket, "web"))
        # the trainer learns which object, never where the store is (the operator's view
        # below, /v1/datasets for the admin, names the bucket)
        assert f"<store>/{gone.split('/', 1)[1]}" in str(refused.value)
        assert f"s3://{BUCKET}" not in str(refused.value)
        web = wait_until(
            lambda: (d := _datasets(srv)["web"])["status"] == "unavailable" and d,
            30, "web unavailable in /v1/datasets",
        )  # fmt: skip
        assert web["ok"] is False and url in web["error"] and web["since"] is not None
        assert {"url": url, "kind": "missing"} in web["objects"]
        assert web["fix"].startswith(
            f"repair it with tokenfeed-server inspect web --store {STORE} --verify --repair "
            "--source DIR"
        )
        # the other dataset keeps serving; the server stays ready, naming the one down
        assert len(_batches(srv, "code", 40)) == 10
        assert _datasets(srv)["code"]["status"] == "ok"
        ready = srv.get("/readyz")
        assert ready.status_code == 200 and ready.json()["not_serving"] == ["web"]
        metrics = {f.name: f for f in text_string_to_metric_families(srv.get("/metrics").text)}
        errors = {s.labels["kind"]: s.value for s in metrics["tokenfeed_storage_errors"].samples}
        assert errors["missing"] >= 1
        status = {
            (s.labels["dataset"], s.labels["status"]): s.value
            for s in metrics["tokenfeed_dataset_status"].samples
        }
        assert status[("web", "unavailable")] == 1 and status[("code", "ok")] == 1
        # put back: ok again by itself (the re-check HEADs it every 10 s), no restart
        bucket.put(gone, data)
        wait_until(lambda: _datasets(srv)["web"]["status"] == "ok", 30, "web ok again")
        assert srv.get("/readyz").json()["not_serving"] == []
        _assert_exact(bucket, "web", _batches(srv, "web", _epoch(bucket, "web")))


def test_damaged_and_deleted_objects_are_listed_repaired_and_read_exactly(
    bucket: Bucket, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = bucket.publish("fix", seed=3)
    assert len(keys) >= 3
    with _server(bucket, tmp_path) as srv:
        data = bytearray(bucket.get(keys[0]))
        data[PIECE + 5] ^= 0x5A  # the same size: only a piece checksum tells
        bucket.put(keys[0], bytes(data))
        bucket.delete(keys[2])
        with pytest.raises(TokenFeedError) as refused:
            _batches(srv, "fix", _epoch(bucket, "fix"))
        assert "<store>/fix/shard-" in str(refused.value) and STORE not in str(refused.value)
        capsys.readouterr()
        assert main(["inspect", "fix", "--store", STORE, "--verify", "--no-progress"]) == 1
        out = capsys.readouterr().out
        assert f"damaged  s3://{BUCKET}/{keys[0]}: piece 1 " in out
        assert f"missing  s3://{BUCKET}/{keys[2]}: not in the bucket" in out
        repair = ["inspect", "fix", "--store", STORE, "--verify", "--repair", "--no-progress"]
        assert main([*repair, "--source", str(bucket.local)]) == 0
        assert "repaired     2 object(s)" in capsys.readouterr().out
        wait_until(lambda: _datasets(srv)["fix"]["status"] == "ok", 30, "fix ok again")
        _assert_exact(bucket, "fix", _batches(srv, "fix", _epoch(bucket, "fix")))


def test_a_dataset_that_fails_to_open_names_its_missing_object(
    bucket: Bucket, tmp_path: Path
) -> None:
    keys = bucket.publish("lost", seed=4)
    data = bucket.get(keys[0])
    bucket.delete(keys[0])
    with _server(bucket, tmp_path) as srv:
        lost = _datasets(srv)["lost"]
        assert lost["ok"] is False and lost["status"] == "unavailable"
        assert lost["objects"] == [{"url": f"s3://{BUCKET}/{keys[0]}", "kind": "missing"}]
        assert lost["since"] is not None and "shard object is missing" in lost["error"]
        assert f"inspect lost --store {STORE} --verify --repair" in lost["fix"]
        # put back: the server opens it again by itself (every 10 s), no restart
        bucket.put(keys[0], data)
        wait_until(lambda: _datasets(srv)["lost"]["status"] == "ok", 30, "lost opens")
        _assert_exact(bucket, "lost", _batches(srv, "lost", _epoch(bucket, "lost")))
