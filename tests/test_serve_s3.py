"""A real server process serving a store in object storage (a moto S3 server process),
through a piece cache a third of the dataset's size.

The same corpus is written locally and published to the bucket: the S3 server gives
exactly the batches of the local one (global and block shuffle); the cache never holds
more than its size (its directory watched while serving, and /v1/status polled); an
object whose bucket copy is bad fails only the jobs that read it, with an error naming
the object; a remote store without --cache-size is a configuration error (exit 2).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from live_server import LiveServer
from s3_server import S3Server, s3_server_module  # noqa: F401  (fixture)
from shard_data import BYTE
from tokenfeed import TokenFeedDataset
from tokenfeed.errors import DatasetChanged, TokenFeedError
from tokenfeed_server.store import Dataset, open_dataset, write_dataset
from tokenfeed_server.store.objects import ObjectStore, S3Location
from tokenfeed_server.store.publish import publish_dataset
from waiting import wait_until

BUCKET = "serve-tests"
PIECE = 4096
URL = f"s3://{BUCKET}/store"


def _docs(seed: int, n: int = 700) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(100, 800))) for _ in range(n)]


@pytest.fixture(scope="module")
def stores(
    s3_server_module: S3Server,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, S3Server, int]]:
    """The local store (datasets ``d``, ``d2`` and ``bad``), all published to the bucket;
    and the bytes of ``d``'s shard files."""
    s3 = s3_server_module
    s3.make_bucket(BUCKET)
    local = tmp_path_factory.mktemp("local")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3.env({}).items():
            mp.setenv(key, value)
        objects = ObjectStore(S3Location(BUCKET, "store"))
        sizes = {}
        for name, seed in (("d", 1), ("bad", 2), ("d2", 3)):
            manifest = write_dataset(
                local,
                name,
                _docs(seed),
                tokenizer=BYTE,
                shuffle_seed=0,
                shard_tokens=90_000,
                piece_bytes=PIECE,
            )
            sizes[name] = sum(s.file_size(manifest.itemsize) for s in manifest.shards)
            publish_dataset(local / name, objects, name)
        # Dataset "bad": one piece of its first shard damaged in the bucket (same size).
        shard = json.loads(objects.get("bad/manifest.json"))["shards"][0]["name"]
        data = bytearray(objects.get(f"bad/{shard}"))
        data[PIECE + 100] ^= 0x5A
        objects.put_bytes(f"bad/{shard}", bytes(data))
    yield local, s3, sizes["d"]


class _DirWatch:
    """The peak bytes of the files under a directory, sampled while a test works."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _bytes(self) -> int:
        total = 0
        for path in self.root.rglob("*"):
            with contextlib.suppress(OSError):  # renamed or evicted meanwhile
                if path.is_file() and path.name != "lock":
                    total += path.stat().st_size
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._bytes())
            self._stop.wait(0.005)

    def __enter__(self) -> _DirWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._bytes())


def _s3_server(
    s3: S3Server, cache: Path, size: int, *extra: str, zmq_port: int = 0, http_port: int = 0
) -> LiveServer:
    command = [
        sys.executable, "-m", "tokenfeed_server.cli", "serve", "--store", URL,
        "--host", "127.0.0.1", "--zmq-port", str(zmq_port), "--http-port", str(http_port),
        "--cache-dir", str(cache), "--cache-size", str(size),
        "--remote-scan-interval-s", "0.2",
        # small chunks: one request's pieces must fit in the small cache together
        "--chunk-bytes", "2048",
        *extra,
    ]  # fmt: skip
    return LiveServer(command=command, env=s3.env(), log_path=cache.parent / "server.log")


def _batches(srv: LiveServer, name: str, **kw: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    args: dict[str, Any] = {
        "seq_len": 64,
        "batch_size": 4,
        "rank": 0,
        "world_size": 1,
        "samples": 800,
        "request_timeout": 5.0,
        "deadline": 60.0,
    }
    args.update(kw)
    loader = TokenFeedDataset(srv.zmq, name, **args)
    return [(b["input_ids"].numpy(), b["window_ids"].numpy()) for b in loader]


@pytest.mark.parametrize("shuffle", ["global", "block"])
def test_s3_gives_the_local_batches_within_the_cache_bound(
    stores: tuple[Path, S3Server, int], tmp_path: Path, shuffle: str
) -> None:
    local, s3, d_size = stores
    capacity = d_size // 3
    cache = tmp_path / "cache"
    kw: dict[str, Any] = {"shuffle": shuffle}
    if shuffle == "global":  # a cache a third of the dataset: asked for explicitly
        kw["allow_read_amplification"] = True
    if shuffle == "block":
        kw.update(region_windows=200, block_regions=2)
    with LiveServer(local) as plain:
        expected = _batches(plain, "d", **kw)
    statuses: list[dict[str, Any]] = []
    with _s3_server(s3, cache, capacity) as srv, _DirWatch(cache) as watch:
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                statuses.append(srv.get("/v1/status").json()["cache"])
                stop.wait(0.05)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            got = _batches(srv, "d", **kw)
        finally:
            stop.set()
            poller.join()
        parked = srv.settled_counter("parked")
        if shuffle == "block":
            # The served position's next block is wanted: fetched ahead even once the
            # trainer is done (housekeeping runs twice a second; bounded wait).
            for _ in range(200):
                if srv.get("/v1/status").json()["cache"]["prefetches"] > 0:
                    break
                time.sleep(0.05)
        final = srv.get("/v1/status").json()
        metrics = srv.get("/metrics").text
    assert len(got) == len(expected) == 200
    for (tokens, windows), (want_tokens, want_windows) in zip(got, expected, strict=True):
        np.testing.assert_array_equal(windows, want_windows)
        np.testing.assert_array_equal(tokens, want_tokens)
    assert watch.peak <= capacity, (watch.peak, capacity)
    assert statuses and all(s["reserved_bytes"] <= capacity for s in statuses)
    stats = final["cache"]
    assert stats["capacity_bytes"] == capacity
    assert stats["size_bytes"] <= capacity
    assert stats["fetches"] > 0 and stats["bytes_fetched"] > 0
    assert parked > 0  # requests waited for pieces, off the loop
    if shuffle == "global":
        assert stats["evictions"] > 0  # a third of the dataset: pieces had to go
    assert final["config"]["cache_size"] == capacity
    assert "tokenfeed_cache_bytes_fetched_total" in metrics
    assert "tokenfeed_cache_fetch_seconds_bucket" in metrics
    if shuffle == "block":
        assert stats["prefetches"] > 0  # the next block was fetched ahead


def test_a_mixture_of_remote_sources_each_fitting_the_cache_but_not_together(
    stores: tuple[Path, S3Server, int], tmp_path: Path
) -> None:
    """A request of a mixture reads from every source: its size is bounded by what all
    remote sources take together, so big chunks of two sources that each fit in the
    cache (but not both) are served, and exactly, not parked forever."""
    local, s3, d_size = stores
    capacity = d_size * 3 // 2
    cache = tmp_path / "cache"
    with _s3_server(s3, cache, capacity, "--chunk-bytes", str(1 << 20)) as srv:
        loader = TokenFeedDataset(
            srv.zmq, {"d": 1, "d2": 1}, seq_len=64, batch_size=4, rank=0, world_size=1,
            samples=2000, request_timeout=5.0, deadline=60.0, allow_read_amplification=True,
        )  # fmt: skip
        batches = list(loader)
        assert srv.get("/v1/status").json()["cache"]["reserved_bytes"] <= capacity
    assert len(batches) == 500
    opened = {name: open_dataset(local, name) for name in ("d", "d2")}
    try:
        for batch in batches[::25]:
            for row, w, src in zip(
                batch["input_ids"].numpy(), batch["window_ids"].numpy(),
                batch["source"].numpy(), strict=True,
            ):  # fmt: skip
                ds = opened[("d", "d2")[int(src)]]
                np.testing.assert_array_equal(row, ds.read(int(w) * 64, int(w) * 64 + 64))
    finally:
        for ds in opened.values():
            ds.close()


def test_an_unreadable_object_fails_its_jobs_only_naming_the_object(
    stores: tuple[Path, S3Server, int], tmp_path: Path
) -> None:
    _, s3, d_size = stores
    with _s3_server(s3, tmp_path / "cache", d_size) as srv:
        with pytest.raises(TokenFeedError) as info:
            # the global order reads every piece of "bad" early, the damaged one too
            _batches(srv, "bad", samples=4000, deadline=60.0)
        message = str(info.value)
        assert "<store>/bad/shard-" in message and URL not in message  # redacted on the wire
        assert "the bucket copy itself is bad" in message
        assert len(_batches(srv, "d", samples=40)) == 10  # the other dataset still serves
        status = srv.get("/v1/status").json()
        assert status["cache"]["unreadable"] >= 1
        assert status["cache"]["checksum_mismatches"] >= 3


def test_a_remote_store_needs_cache_dir_and_size(
    stores: tuple[Path, S3Server, int], tmp_path: Path
) -> None:
    _, s3, _ = stores

    def serve(*extra: str) -> subprocess.CompletedProcess[str]:
        command = [
            sys.executable, "-m", "tokenfeed_server.cli", "serve", "--store", URL,
            "--zmq-port", "0", "--http-port", "0", *extra,
        ]  # fmt: skip
        return subprocess.run(
            command, env=s3.env(), capture_output=True, text=True, timeout=60, check=False
        )

    missing = serve("--cache-dir", str(tmp_path / "c"))
    assert missing.returncode == 2, missing.stderr
    assert "needs --cache-size (" in missing.stderr
    neither = serve()
    assert neither.returncode == 2
    assert "--cache-dir and --cache-size" in neither.stderr
    bad = serve("--cache-dir", str(tmp_path / "c"), "--cache-size", "12XB")
    assert bad.returncode == 2
    assert "--cache-size" in bad.stderr and "TOKENFEED_CACHE_SIZE" in bad.stderr


def test_a_job_keeps_its_version_when_the_dataset_is_replaced_in_the_bucket(
    stores: tuple[Path, S3Server, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local, s3, _ = stores
    for key, value in s3.env({}).items():
        monkeypatch.setenv(key, value)
    objects = ObjectStore(S3Location(BUCKET, "store"))
    builds = {}
    for seed, overwrite in ((3, False), (4, True)):
        write_dataset(
            local, "r", _docs(seed, 200), tokenizer=BYTE, shuffle_seed=0,
            shard_tokens=30_000, piece_bytes=PIECE, overwrite=overwrite,
        )  # fmt: skip
        builds[seed] = open_dataset(local, "r")
        if seed == 3:
            publish_dataset(local / "r", objects, "r")
            old_keys = set(s3.keys(BUCKET, "store/r/"))
    old, new = builds[3].fingerprint, builds[4].fingerprint

    def rows_are(build: Dataset, batch: tuple[np.ndarray, np.ndarray]) -> None:
        for row, w in zip(*batch, strict=True):
            np.testing.assert_array_equal(row, build.read(int(w) * 64, int(w) * 64 + 64))

    def arrays(batch: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        return batch["input_ids"].numpy(), batch["window_ids"].numpy()

    def loader(server: LiveServer, **kw: Any) -> TokenFeedDataset:
        return TokenFeedDataset(
            server.zmq, "r", seq_len=64, batch_size=4, rank=0, world_size=1, samples=4 * 60,
            chunk_bytes=1, window=1, request_timeout=5.0, deadline=60.0, **kw,
        )  # fmt: skip

    cache = tmp_path / "cache"
    srv = _s3_server(s3, cache, 1 << 20).start()
    try:
        job = loader(srv)
        it = iter(job)
        for _ in range(5):
            rows_are(builds[3], arrays(next(it)))
        publish_dataset(local / "r", objects, "r", overwrite=True)
        view = wait_until(
            lambda: (v := srv.get("/v1/datasets/r").json())["fingerprint"] == new and v,
            20.0, "the new version served",
        )  # fmt: skip
        assert view["version"] == new
        listed = {d["name"]: d for d in srv.get("/v1/datasets").json()}
        assert listed["r"]["versions_in_use"] == [old]  # the running job holds it
        for _ in range(5):  # the running job keeps reading the build it started on
            rows_are(builds[3], arrays(next(it)))
        assert old_keys <= set(s3.keys(BUCKET, "store/r/"))  # old objects stay until gc
        state = job.state_dict()
        # A restarted server opens the job's version on demand: its epoch ends on it.
        zmq_port, http_port = srv.zmq_port, srv.http_port
        srv.kill()
        srv = _s3_server(s3, cache, 1 << 20, zmq_port=zmq_port, http_port=http_port).start()
        rest = [arrays(b) for b in it]
        assert len(rest) == 50
        for batch in rest:
            rows_are(builds[3], batch)
        # the saved state resumes on that version too, with the same batches
        resumed = loader(srv)
        resumed.load_state_dict(state)
        again = [arrays(b) for b in resumed]
        for (tokens, windows), (want, want_windows) in zip(again, rest, strict=True):
            np.testing.assert_array_equal(windows, want_windows)
            np.testing.assert_array_equal(tokens, want)
        fresh = _batches(srv, "r", samples=16)  # a new job gets the new build
        assert len(fresh) == 4
        for batch in fresh:
            rows_are(builds[4], batch)
        # Once its version is gone from the bucket, the job is refused, never mixed.
        s3.client.delete_object(Bucket=BUCKET, Key=f"store/r/versions/{old}.json")
        srv.kill()
        srv = _s3_server(s3, cache, 1 << 20, zmq_port=zmq_port, http_port=http_port).start()
        late = loader(srv)
        late.load_state_dict(state)
        with pytest.raises(DatasetChanged, match=f"version {old} of dataset 'r' is no longer"):
            next(iter(late))
    finally:
        srv.stop()
