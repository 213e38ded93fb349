"""End to end from object storage: prepare into S3, serve from S3 through a small cache.

Everything real: a moto S3 server process (``tests/s3_server.py``) on loopback,
``tokenfeed-server prepare`` and ``gc`` as the operator runs them, ``serve`` processes,
trainers with real DataLoader worker processes. The same corpus is prepared into a local
store and into the bucket; a server on each; the S3 one with a cache a third of the
dataset's size, so that it must evict and fetch again while serving one epoch.

* global shuffle: exactly the local server's batches, batch by batch, same build;
* block shuffle, 2 ranks x 2 workers: every window exactly once per epoch, and exactly the
  local server's rows;
* the cache never holds more than its size (``/v1/status`` and the directory's bytes,
  polled while two jobs read at once);
* an object corrupted in the bucket for one read is detected and fetched again (the
  batches stay exact); an object whose bucket copy stays bad fails with an error naming
  it, after only exact batches;
* a server SIGKILLed while fetching, with a cached piece then damaged as a power loss
  could leave it, restarts on the same cache and ports: the trainer continues and every
  batch is exact;
* ``prepare --overwrite`` while a job reads: the job reads on to its end in the version it
  started on (exactly the local batches), never a batch of the new build; the old shards
  stay in the bucket until ``gc --grace 0``.

Small data (about 0.4 M tokens in shards of 20k tokens and pieces of 4 KiB), requests of
a few batches, bounded waits everywhere (client deadlines, pytest timeouts, joins).
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from live_server import LiveServer
from s3_server import S3Server, s3_server_module  # noqa: F401  (a fixture)
from shard_data import BYTE
from tokenfeed import TokenFeedDataset, TokenFeedLoader
from tokenfeed.errors import TokenFeedError
from tokenfeed_server.store import open_dataset, write_dataset
from tokenfeed_server.store.manifest import Manifest
from tokenfeed_server.store.objects import ObjectStore, S3Location
from tokenfeed_server.store.publish import publish_dataset
from waiting import wait_until

pytestmark = [pytest.mark.network, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from latency_proxy import ProxyThread  # noqa: E402

BUCKET = "tokenfeed-e2e"
NAME = "alpha"
SEQ, BATCH, SEED = 64, 4, 3
SHARD_TOKENS = 20_000
PIECE_BYTES = 4096
# Client requests of about 2 KiB of tokens (a few batches). The default (1 MiB) is sized
# for real datasets, where it is a sliver of any cache; here it would be the whole
# dataset, three times the cache. Scaled down with the data, the proportions stay real.
CHUNK_BYTES = 2048
_TEXT = (
    "the of and to in is was for on that with as by at from his her an it were are which "
    "this be or has had not but one their first new after two also its into who more than "
    "time other over when only about most year some can made world city used between such"
)
WORDS = _TEXT.split()  # the corpus's vocabulary

Batch = dict[str, torch.Tensor]


# -- building blocks ------------------------------------------------------------------


def write_corpus(root: Path, seed: int, files: int = 8, words: int = 14_000) -> Path:
    """``files`` text files of random words (about 75 kB each): one document per file."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True)
    for i in range(files):
        picks = rng.integers(0, len(WORDS), size=words)
        (root / f"part-{i}.txt").write_text(" ".join(WORDS[j] for j in picks))
    return root


def prepare(
    store: str, corpus: Path, env: dict[str, str], *, shard_tokens: int, overwrite: bool = False
) -> None:
    """``tokenfeed-server prepare`` as an operator runs it."""
    cmd = [
        sys.executable, "-m", "tokenfeed_server.cli", "prepare", "--store", store,
        "--dataset", NAME, "--shard-tokens", str(shard_tokens), "--no-progress", str(corpus),
    ]  # fmt: skip
    if overwrite:
        cmd.append("--overwrite")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def manifest_in_bucket(s3: S3Server, prefix: str) -> Manifest:
    """The published manifest of NAME under ``prefix``."""
    body = s3.client.get_object(Bucket=BUCKET, Key=f"{prefix}/{NAME}/manifest.json")["Body"]
    return Manifest.from_json(body.read())


def serve_s3(
    s3_env: dict[str, str],
    prefix: str,
    cache_dir: Path,
    cache_size: int,
    log: Path,
    *,
    zmq_port: int = 0,
    http_port: int = 0,
    extra: Iterable[str] = (),
) -> LiveServer:
    """A ``serve`` of ``s3://BUCKET/prefix`` through a cache of ``cache_size`` (not yet
    started: ``with`` it, or call ``start()``)."""
    cmd = [
        sys.executable, "-m", "tokenfeed_server.cli", "serve", "--store", f"s3://{BUCKET}/{prefix}",
        "--host", "127.0.0.1", "--zmq-port", str(zmq_port), "--http-port", str(http_port),
        "--cache-dir", str(cache_dir), "--cache-size", str(cache_size), *extra,
    ]  # fmt: skip
    return LiveServer(command=cmd, env=s3_env, log_path=log)


def make(endpoint: str, **kw: Any) -> TokenFeedDataset:
    """The trainers' dataset: one rank unless told, global order unless told."""
    kw.setdefault("rank", 0)
    kw.setdefault("world_size", 1)
    kw.setdefault("deadline", 60.0)
    kw.setdefault("chunk_bytes", CHUNK_BYTES)
    # the server's cache is a third of the dataset on purpose (the fetch path under
    # pressure): a global shuffle through it must be asked for
    kw.setdefault("allow_read_amplification", True)
    return TokenFeedDataset(endpoint, NAME, seq_len=SEQ, batch_size=BATCH, seed=SEED, **kw)


def read_all(batches: Iterable[Batch]) -> list[Batch]:
    return [{k: v.clone() for k, v in b.items()} for b in batches]


def assert_same(got: list[Batch], want: list[Batch], what: str) -> None:
    """Batch by batch, every tensor equal (the first difference named)."""
    assert len(got) == len(want), f"{what}: {len(got)} batches, the local store gave {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for key in ("input_ids", "labels", "window_ids", "epoch"):
            assert torch.equal(g[key], w[key]), f"{what}: batch {i} differs in {key}"


def lockstep(loaders: list[TokenFeedLoader]) -> list[list[Batch]]:
    """Each rank's batches, the ranks advancing a step at a time as DDP trainers do."""
    iters = [iter(loader) for loader in loaders]
    out: list[list[Batch]] = [[] for _ in loaders]
    while True:
        step = [next(it, None) for it in iters]
        if all(b is None for b in step):
            return out
        assert all(b is not None for b in step), "the ranks ended at different steps"
        for r, b in enumerate(step):
            assert b is not None
            out[r].append({k: v.clone() for k, v in b.items()})


def tree_bytes(root: Path) -> int:
    """Bytes of every piece file under ``root`` now (a file removed during the walk: 0);
    the copies of manifests' piece-digest sidecars (``sidecars/``, metadata of about
    16 MB per TB, kept beside the pieces) are not pieces and not in ``--cache-size``."""
    total = 0
    for dirpath, dirs, files in os.walk(root):
        if "sidecars" in dirs:
            dirs.remove("sidecars")
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(dirpath, name)).st_size
    return total


class CacheWatch:
    """Polls the server's ``/v1/status`` cache object and the cache directory's bytes
    while trainers read; keeps the largest values seen."""

    def __init__(self, server: LiveServer, cache_dir: Path) -> None:
        self.server, self.cache_dir = server, cache_dir
        self.samples = 0
        self.max_size = self.max_reserved = self.max_disk = 0
        self.last: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.wait(0.02):
                self.max_disk = max(self.max_disk, tree_bytes(self.cache_dir))
                cache = self.server.get("/v1/status").json().get("cache")
                if isinstance(cache, dict):
                    self.last = cache
                    self.max_size = max(self.max_size, int(cache["size_bytes"]))
                    self.max_reserved = max(self.max_reserved, int(cache["reserved_bytes"]))
                self.samples += 1
        except BaseException as exc:  # reported by check(), not lost in the thread
            self.error = exc

    def __enter__(self) -> CacheWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def check(self, capacity: int) -> None:
        """Never over ``capacity``, and the cache really was too small for the data."""
        assert self.error is None, f"polling the status failed: {self.error!r}"
        assert self.samples >= 3, "the status was polled too rarely to tell anything"
        assert self.last is not None, "/v1/status has no 'cache' object for an s3:// store"
        assert self.last["capacity_bytes"] == capacity
        assert self.max_size <= capacity, f"cache held {self.max_size} > {capacity} bytes"
        assert self.max_reserved <= capacity, f"reserved {self.max_reserved} > {capacity}"
        assert self.max_disk <= capacity, f"cache directory held {self.max_disk} > {capacity}"
        assert self.max_size > 0 and self.max_disk > 0  # pieces were cached and seen
        assert self.last["evictions"] > 0  # the data did not fit: this tested something


# -- fixtures: one corpus, prepared into a local store and into the bucket -------------


@dataclass(frozen=True)
class Built:
    local: Path  # the local store
    prefix: str  # the bucket prefix of the same dataset
    n_tokens: int
    shard_bytes: int  # the dataset's shard files, in bytes
    fingerprint: str

    @property
    def third(self) -> int:
        """A cache a third of the dataset's size."""
        return self.shard_bytes // 3


@pytest.fixture(scope="module")
def s3(s3_server_module: S3Server) -> S3Server:  # noqa: F811
    s3_server_module.make_bucket(BUCKET)
    return s3_server_module


@pytest.fixture(scope="module")
def built(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The dataset, written once locally and published into the bucket, as ``prepare
    --store s3://...`` does after writing its scratch store (the CLI path itself: the
    overwrite test). Written here for its small pieces (4 KiB: a request then needs a few
    dozen of them, so a cache a third of the dataset's size holds several requests)."""
    root = tmp_path_factory.mktemp("built")
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 256, size=int(n), dtype=np.uint16) for n in rng.integers(5, 2000, 400)]
    write_dataset(
        root, NAME, docs, tokenizer=BYTE, shuffle_seed=0, shard_tokens=SHARD_TOKENS,
        piece_bytes=PIECE_BYTES,
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3.env().items():  # the standard AWS chain reads these
            mp.setenv(key, value)
        publish_dataset(root / NAME, ObjectStore(S3Location(BUCKET, "main")), NAME)
    with open_dataset(root, NAME) as ds:
        shard_bytes = sum((ds.path / s.name).stat().st_size for s in ds.manifest.shards)
        n_tokens, fingerprint = ds.n_tokens, str(ds.fingerprint)
        shards = len(ds.manifest.shards)
    assert shards >= 16  # regions of a shard each: blocks are a small part of the data
    remote = manifest_in_bucket(s3, "main")
    assert remote.fingerprint == fingerprint  # the same build, under content-addressed names
    return Built(root, "main", n_tokens, shard_bytes, fingerprint)


@pytest.fixture(scope="module")
def local(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with LiveServer(built.local, log_path=tmp_path_factory.mktemp("logs") / "local.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def local_epoch(local: LiveServer) -> list[Batch]:
    """One epoch in global order from the local store: the reference."""
    return read_all(make(local.zmq, epochs=1))


# -- (a) global order: the local store's batches ----------------------------------------


@pytest.mark.timeout(300)
def test_global_order_from_s3_equals_the_local_store(
    s3: S3Server, built: Built, local_epoch: list[Batch], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    with serve_s3(s3.env(), built.prefix, cache, built.third, tmp_path / "s3.log") as srv:
        ds = make(srv.zmq, epochs=1)
        with CacheWatch(srv, cache) as watch:
            got = read_all(ds)
        assert ds.state_dict()["fingerprint"] == built.fingerprint
    assert_same(got, local_epoch, "global order from S3")
    watch.check(built.third)


# -- (b) block order: every window once per epoch, 2 ranks x 2 workers ------------------


@pytest.mark.timeout(300)
def test_block_order_over_two_ranks_and_two_workers(
    s3: S3Server, built: Built, local: LiveServer, tmp_path: Path
) -> None:
    def ranks(endpoint: str) -> list[list[Batch]]:
        loaders = [
            TokenFeedLoader(
                make(endpoint, rank=r, world_size=2, epochs=1, shuffle="block"),
                num_workers=2,
                pin_memory=False,
                report_after=None,  # no thread in this process while rank 1 forks
            )
            for r in range(2)
        ]
        return lockstep(loaders)

    want = ranks(local.zmq)
    cache = tmp_path / "cache"
    with (
        serve_s3(s3.env(), built.prefix, cache, built.third, tmp_path / "s3.log") as srv,
        CacheWatch(srv, cache) as watch,
    ):
        got = ranks(srv.zmq)
    n_windows = (built.n_tokens - 1) // SEQ
    windows = torch.cat([b["window_ids"] for rank in got for b in rank]).numpy()
    epochs = torch.cat([b["epoch"] for rank in got for b in rank]).numpy()
    np.testing.assert_array_equal(np.sort(windows[epochs == 0]), np.arange(n_windows))
    assert len(set(windows[epochs == 1])) == int((epochs == 1).sum())  # a spill, no repeats
    for r in range(2):
        assert_same(got[r], want[r], f"block order from S3, rank {r}")
    # the block order reached the server (the global one differs)
    global_w = torch.cat([b["window_ids"] for b in read_all(make(local.zmq, samples=64))])
    assert not torch.equal(global_w, torch.cat([b["window_ids"] for b in got[0]])[:64])
    watch.check(built.third)


# -- (c) the cache never exceeds its size, two jobs at once ------------------------------


@pytest.mark.timeout(300)
def test_the_cache_never_exceeds_its_size_under_two_jobs(
    s3: S3Server, built: Built, local: LiveServer, local_epoch: list[Batch], tmp_path: Path
) -> None:
    want_block = read_all(make(local.zmq, epochs=1, shuffle="block"))
    cache = tmp_path / "cache"
    results: dict[str, list[Batch]] = {}
    errors: list[BaseException] = []

    def trainer(key: str, ds: TokenFeedDataset) -> None:
        try:
            results[key] = read_all(ds)
        except BaseException as exc:
            errors.append(exc)

    with serve_s3(s3.env(), built.prefix, cache, built.third, tmp_path / "s3.log") as srv:
        with CacheWatch(srv, cache) as watch:
            threads = [
                threading.Thread(target=trainer, args=("global", make(srv.zmq, epochs=1))),
                threading.Thread(
                    target=trainer, args=("block", make(srv.zmq, epochs=1, shuffle="block"))
                ),
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(240)
        assert not any(t.is_alive() for t in threads), "a trainer did not finish in 240 s"
    assert not errors, errors
    watch.check(built.third)
    assert_same(results["global"], local_epoch, "global job beside a block job")
    assert_same(results["block"], want_block, "block job beside a global job")


# -- (d) corruption in the bucket -------------------------------------------------------


class FlakyBucket:
    """An HTTP front of the S3 server that, on the first GET of ``key``, overwrites that
    object in the bucket with corrupted bytes of the same length, lets the GET read them,
    and restores the good copy before answering: one read of a bad bucket copy, with no
    timing involved. Everything else is forwarded unchanged."""

    def __init__(self, s3: S3Server, key: str) -> None:
        self.s3, self.key = s3, key
        self.corrupted_reads = 0
        self.lock = threading.Lock()
        host, port = s3.endpoint.removeprefix("http://").split(":")
        front = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                # headers and body go out in two writes: without this, Nagle's algorithm
                # holds the body until the client's delayed ACK (40 ms a response)
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("connection",)
                }
                target = self.path.split("?", 1)[0].lstrip("/")
                corrupt = (
                    self.command == "GET"
                    and target == f"{BUCKET}/{front.key}"
                    and front.overlaps(self.headers.get("Range"))
                )
                with front.lock if corrupt else contextlib.nullcontext():
                    good = front._corrupt() if corrupt else None
                    try:
                        conn = http.client.HTTPConnection(host, int(port), timeout=30)
                        try:
                            conn.request(self.command, self.path, body=body, headers=headers)
                            resp = conn.getresponse()
                            data = resp.read()
                        finally:
                            conn.close()
                    finally:
                        if good is not None:
                            front._restore(good)
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def do_GET(self) -> None:
                self._forward()

            def do_HEAD(self) -> None:
                self._forward()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def overlaps(self, header: str | None) -> bool:
        """Whether a GET with this Range header reads bytes that :func:`flipped` changes
        (the server's first read of a shard may be its header alone)."""
        size = self.s3.client.head_object(Bucket=BUCKET, Key=self.key)["ContentLength"]
        lo, hi = flipped_span(int(size))
        if not header:
            return True
        first, _, last = header.removeprefix("bytes=").partition("-")
        start, stop = int(first), (int(last) + 1 if last else int(size))
        return start < hi and lo < stop

    def _corrupt(self) -> bytes | None:
        """Swap in a bad copy for this read (the first one only); return the good bytes."""
        if self.corrupted_reads:
            return None
        self.corrupted_reads += 1
        good: bytes = self.s3.client.get_object(Bucket=BUCKET, Key=self.key)["Body"].read()
        self.s3.client.put_object(Bucket=BUCKET, Key=self.key, Body=flipped(good))
        return good

    def _restore(self, good: bytes) -> None:
        self.s3.client.put_object(Bucket=BUCKET, Key=self.key, Body=good)

    def __enter__(self) -> FlakyBucket:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def flipped_span(size: int) -> tuple[int, int]:
    """The bytes :func:`flipped` inverts in an object of ``size`` bytes: the middle third
    (inside the tokens; the shard's header is kept)."""
    return size // 3, 2 * size // 3


def flipped(data: bytes) -> bytes:
    """``data`` with every byte of its middle third inverted (same length)."""
    out = bytearray(data)
    lo, hi = flipped_span(len(out))
    out[lo:hi] = bytes(b ^ 0xFF for b in out[lo:hi])
    return bytes(out)


def copy_dataset(s3: S3Server, src: str, dst: str) -> None:
    """Copy every object of NAME from prefix ``src`` to prefix ``dst`` (manifest last)."""
    keys = s3.keys(BUCKET, f"{src}/{NAME}/")
    keys.sort(key=lambda k: k.endswith("manifest.json"))
    for key in keys:
        s3.client.copy_object(
            Bucket=BUCKET, Key=dst + key[len(src) :], CopySource={"Bucket": BUCKET, "Key": key}
        )


@pytest.mark.timeout(300)
def test_a_bucket_copy_bad_for_one_read_is_fetched_again(
    s3: S3Server, built: Built, local_epoch: list[Batch], tmp_path: Path
) -> None:
    shard = manifest_in_bucket(s3, built.prefix).shards[0].name
    with FlakyBucket(s3, f"{built.prefix}/{NAME}/{shard}") as flaky:
        env = {**s3.env(), "AWS_ENDPOINT_URL": flaky.endpoint}
        cache = tmp_path / "cache"
        with serve_s3(env, built.prefix, cache, built.third, tmp_path / "s3.log") as srv:
            got = read_all(make(srv.zmq, epochs=1))
            status = srv.get("/v1/status").json()
    assert flaky.corrupted_reads == 1  # the bad copy really was read
    assert_same(got, local_epoch, "global order after a bad read")
    assert status["cache"]["checksum_mismatches"] >= 1  # detected, not served


@pytest.mark.timeout(300)
def test_a_bucket_copy_that_stays_bad_is_an_error_naming_the_object(
    s3: S3Server, built: Built, local_epoch: list[Batch], tmp_path: Path
) -> None:
    copy_dataset(s3, built.prefix, "bad")
    shards = manifest_in_bucket(s3, "bad").shards
    victim = shards[len(shards) // 2].name
    key = f"bad/{NAME}/{victim}"
    good = s3.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    s3.client.put_object(Bucket=BUCKET, Key=key, Body=flipped(good))
    got: list[Batch] = []
    with serve_s3(s3.env(), "bad", tmp_path / "cache", built.third, tmp_path / "s3.log") as srv:
        ds = make(srv.zmq, epochs=1, deadline=60.0)
        with pytest.raises(TokenFeedError) as info:
            for batch in ds:
                got.append({k: v.clone() for k, v in batch.items()})
    assert victim in str(info.value), f"the error does not name the object: {info.value}"
    assert len(got) < len(local_epoch)
    assert_same(got, local_epoch[: len(got)], "batches before the error")  # none wrong


# -- (e) a server killed mid-fetch, restarted on the same cache ---------------------------


@pytest.mark.timeout(300)
def test_a_server_killed_mid_fetch_restarts_on_its_cache_and_stays_exact(
    s3: S3Server, built: Built, local_epoch: list[Batch], tmp_path: Path
) -> None:
    host, port = s3.endpoint.removeprefix("http://").split(":")
    cache = tmp_path / "cache"
    got: list[Batch] = []
    errors: list[BaseException] = []
    # Every object request takes >= 0.3 s: fetches are in flight most of the time.
    with ProxyThread(host, int(port), delay_s=0.3) as proxy:
        env = {**s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
        first = serve_s3(env, built.prefix, cache, built.third, tmp_path / "s3.log").start()
        zmq_port, http_port = first.zmq_port, first.http_port
        ds = make(first.zmq, epochs=1, deadline=90.0)

        def trainer() -> None:
            try:
                got.extend({k: v.clone() for k, v in b.items()} for b in ds)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=trainer, daemon=True)
        second: LiveServer | None = None
        try:
            thread.start()
            # Kill once batches flowed and a fetch is in flight at the proxy.
            stats = proxy.proxy.stats
            wait_for(lambda: len(got) >= 10 and stats.waiting > 0, 60, "a fetch in flight")
            first.kill()  # SIGKILL
            # A power loss after a rename without fsync could leave a piece short: damage
            # the largest cached file so; the restarted server must not trust it.
            files = [p for p in cache.rglob("*") if p.is_file() and p.stat().st_size > 0]
            assert files, "nothing was cached before the kill"
            victim = max(files, key=lambda p: p.stat().st_size)
            with open(victim, "r+b") as f:
                f.truncate(victim.stat().st_size // 2)
            # Restarted straight on the S3 server: the delay only served to catch a fetch
            # in flight, and would make the rest of the epoch slow.
            second = serve_s3(
                s3.env(), built.prefix, cache, built.third, tmp_path / "s3.log",
                zmq_port=zmq_port, http_port=http_port,
            ).start()  # fmt: skip
            thread.join(240)
            assert not thread.is_alive(), "the trainer did not finish in 240 s"
        finally:
            if second is not None:
                second.stop()
            first.stop()
    assert not errors, errors
    assert_same(got, local_epoch, "an epoch across a SIGKILL and a restart")


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` every 5 ms (bounded)."""
    wait_until(condition, timeout, what, interval=0.005)


# -- (f) prepare --overwrite while a job reads; gc --------------------------------------


@pytest.mark.timeout(420)
def test_overwrite_while_a_job_reads_keeps_its_version_and_gc_keeps_old_shards_till_then(
    s3: S3Server, tmp_path: Path
) -> None:
    """As with a local store: the running job never gets a row of the new build; it reads
    on in the version it started on, from old shards refetched after the overwrite, to
    the end, and its next hello (a new epoch's iterator) is served on that version too."""
    env = s3.env()
    prefix = "overwrite"
    old_corpus = write_corpus(tmp_path / "old", seed=11, files=4)
    new_corpus = write_corpus(tmp_path / "new", seed=12, files=4)
    # CLI pieces are 1 MiB, so a shard is one piece: small shards keep a block small
    prepare(str(tmp_path / "local-old"), old_corpus, env, shard_tokens=10_000)
    prepare(f"s3://{BUCKET}/{prefix}", old_corpus, env, shard_tokens=10_000)
    old = manifest_in_bucket(s3, prefix)
    old_keys = {f"{prefix}/{NAME}/{s.name}" for s in old.shards}
    with open_dataset(tmp_path / "local-old", NAME) as ds:
        # prepare into the bucket built what prepare into a directory builds
        assert old.fingerprint == ds.fingerprint
        shard_bytes = sum((ds.path / s.name).stat().st_size for s in ds.manifest.shards)
        samples = 3 * ((ds.n_tokens - 1) // SEQ) // 2  # an epoch and a half
    with LiveServer(tmp_path / "local-old", log_path=tmp_path / "local.log") as ref:
        want = read_all(make(ref.zmq, samples=samples, shuffle="block"))

    cache = tmp_path / "cache"
    got: list[Batch] = []
    with serve_s3(
        env, prefix, cache, shard_bytes // 3, tmp_path / "s3.log",
        extra=["--remote-scan-interval-s", "0.2"],
    ) as srv:  # fmt: skip
        # one request at a time: the trainer asks the server often
        ds = make(srv.zmq, samples=samples, shuffle="block", window=1)
        it = iter(ds)
        got.extend({k: v.clone() for k, v in next(it).items()} for _ in range(5))
        prepare(f"s3://{BUCKET}/{prefix}", new_corpus, env, overwrite=True, shard_tokens=10_000)
        new = manifest_in_bucket(s3, prefix)
        assert new.fingerprint != old.fingerprint

        def noticed() -> bool:
            views = {d["name"]: d for d in srv.get("/v1/datasets").json()}
            return views.get(NAME, {}).get("fingerprint") == new.fingerprint

        wait_for(noticed, 60, "new build listed in /v1/datasets (the scan is periodic)")
        fetched = srv.get("/v1/status").json()["cache"]["fetches"]
        for batch in it:
            got.append({k: v.clone() for k, v in batch.items()})
        # it read on to the end: the old shards, from the bucket, not a cache
        assert len(got) == len(want)
        assert srv.get("/v1/status").json()["cache"]["fetches"] > fetched
        # its next hello (a new iter(), a restarted worker) is welcomed on its version
        # (nothing is left to read: the hello is all this does)
        assert next(iter(ds), None) is None
        assert ds.state_dict()["fingerprint"] == old.fingerprint
        # a fresh job reads the new build
        fresh = make(srv.zmq, samples=8 * BATCH, shuffle="block")
        assert len(read_all(fresh)) == 8
        assert fresh.state_dict()["fingerprint"] == new.fingerprint
    assert_same(got, want, "the job across an overwrite")  # its version, never a mix

    keys = set(s3.keys(BUCKET, f"{prefix}/{NAME}/"))
    new_keys = {f"{prefix}/{NAME}/{s.name}" for s in new.shards}
    assert old_keys - new_keys, "the corpora share every shard: nothing to collect"
    assert old_keys <= keys  # the overwrite deleted nothing
    gc = [sys.executable, "-m", "tokenfeed_server.cli", "gc", "--store", f"s3://{BUCKET}/{prefix}"]
    done = subprocess.run(gc, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == 0, done.stderr
    assert old_keys <= set(s3.keys(BUCKET, f"{prefix}/{NAME}/"))  # the default grace keeps them
    # the server has stopped (its lease is gone): only the current version is kept
    done = subprocess.run(
        [*gc, "--grace", "0", "--keep-versions", "1"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    after = set(s3.keys(BUCKET, f"{prefix}/{NAME}/"))
    assert not (old_keys - new_keys) & after  # the old build's shards are gone
    assert new_keys | {f"{prefix}/{NAME}/manifest.json"} <= after  # the new one is whole
