"""The background re-check: a dataset marked unavailable for a missing or damaged object
returns to ok once the object is whole again in the bucket, without a restart.

A real Store over a real S3 protocol server (moto, its own process) with its piece cache;
the health record is marked the way the cache's fetchers mark it, and the bucket is
changed through a plain boto3 client.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from s3_server import S3Server, s3_server_module  # noqa: F401  (fixture)
from shard_data import BYTE
from tokenfeed_server.store import Store, write_dataset
from tokenfeed_server.store.cache import PieceCache
from tokenfeed_server.store.health import StorageHealth
from tokenfeed_server.store.health_check import HealthCheck
from tokenfeed_server.store.objects import ObjectStore, S3Location
from tokenfeed_server.store.publish import publish_dataset
from waiting import wait_until

pytestmark = pytest.mark.network

BUCKET = "health-tests"
PIECE = 4096


def _docs(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(100, 900))) for _ in range(60)]


class Setup:
    """A published dataset ``d`` and a Store serving the bucket through a piece cache."""

    def __init__(self, s3: S3Server, tmp_path: Path) -> None:
        self.s3 = s3
        self.local = tmp_path / "local"
        self.objects = ObjectStore(S3Location(BUCKET, "p"))
        self.publish(seed=1)
        self.cache = PieceCache(tmp_path / "cache", 1 << 20, self.objects)
        self.store = Store(S3Location(BUCKET, "p"), objects=self.objects, cache=self.cache)
        self.store.open_all(watch=False)
        self.health: StorageHealth = self.cache.health
        shard = self.store.get("d").manifest.shards[0]
        self.key = f"p/d/{shard.name}"
        self.url = f"s3://{BUCKET}/{self.key}"
        self.good = self.get()

    def publish(self, seed: int) -> None:
        write_dataset(
            self.local, "d", _docs(seed), tokenizer=BYTE, shuffle_seed=0, shard_tokens=16_000,
            piece_bytes=PIECE, overwrite=True,
        )  # fmt: skip
        publish_dataset(self.local / "d", self.objects, "d", overwrite=True)

    def get(self) -> bytes:
        return bytes(self.s3.client.get_object(Bucket=BUCKET, Key=self.key)["Body"].read())

    def put(self, data: bytes) -> None:
        self.s3.client.put_object(Bucket=BUCKET, Key=self.key, Body=data)

    def state(self) -> str:
        return self.health.of("d").state

    def close(self) -> None:
        self.store.close()
        self.cache.close()


@pytest.fixture
def setup(
    s3_server_module: S3Server,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Setup]:
    s3_server_module.reset()
    s3_server_module.make_bucket(BUCKET)
    for name, value in s3_server_module.env({}).items():
        monkeypatch.setenv(name, value)
    made = Setup(s3_server_module, tmp_path)
    try:
        yield made
    finally:
        made.close()


def test_a_missing_object_put_back_clears_the_dataset(setup: Setup) -> None:
    check = HealthCheck(setup.store)
    setup.s3.client.delete_object(Bucket=BUCKET, Key=setup.key)
    setup.health.failed("d", "missing", f"{setup.url} is gone", setup.url)
    check.check_now()
    assert setup.state() == "unavailable"
    assert setup.health.of("d").objects == {setup.url: "missing"}
    setup.put(setup.good[:-10])  # back, but not with the manifest's size
    check.check_now()
    assert setup.state() == "unavailable"
    setup.put(setup.good)
    check.check_now()
    assert setup.state() == "ok"


def test_a_damaged_object_clears_once_uploaded_again_whole(setup: Setup) -> None:
    check = HealthCheck(setup.store)
    bad = bytearray(setup.good)
    bad[PIECE + 3] ^= 1
    setup.put(bytes(bad))
    setup.health.failed("d", "damaged", "fails its checksum", setup.url)
    check.check_now()
    check.check_now()  # the same bytes (same ETag): not downloaded again, still damaged
    assert setup.state() == "unavailable"
    bad[2 * PIECE] ^= 1
    setup.put(bytes(bad))  # uploaded again, still damaged
    check.check_now()
    assert setup.state() == "unavailable"
    setup.put(setup.good)  # repaired
    check.check_now()
    assert setup.state() == "ok"


def test_storage_answering_again_clears_an_exhausted_budget(setup: Setup) -> None:
    setup.health.failed("d", "exhausted", "timed out after 900 s")
    assert setup.state() == "unavailable"
    HealthCheck(setup.store).check_now()
    assert setup.state() == "ok"


def test_a_new_build_forgets_the_old_ones_objects(setup: Setup) -> None:
    check = HealthCheck(setup.store)
    check.forget_replaced()  # remembers the current build
    setup.health.failed("d", "damaged", "fails its checksum", setup.url)
    check.forget_replaced()
    assert setup.state() == "unavailable"  # same build: kept
    setup.publish(seed=2)
    setup.store.scan()
    check.forget_replaced()
    assert setup.state() == "ok"


def test_the_thread_rechecks_by_itself_and_a_local_store_needs_none(
    setup: Setup, tmp_path: Path
) -> None:
    setup.health.failed("d", "missing", "gone", setup.url)  # present in fact
    check = HealthCheck(setup.store, recheck_s=0.05, tick_s=0.01).start()
    assert check.running
    try:
        wait_until(lambda: setup.state() == "ok", 10, "the re-check clearing the object")
    finally:
        check.stop()
    local = Store(tmp_path / "local")
    local.open_all(watch=False)
    try:
        idle = HealthCheck(local).start()
        assert idle.health is None and not idle.running
        idle.stop()
    finally:
        local.close()
