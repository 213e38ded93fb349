"""Object storage outages are a delay, never a lost job (issue 22), end to end.

Everything real: the moto S3 server in its own process (``tests/s3_server.py``), a
loopback front between it and the tokenfeed server that refuses connections or answers
``503 SlowDown`` on demand (``tests/s3_front.py``; the S3 server keeps its state in
memory, so the front is what fails), ``serve`` processes reading the bucket through a
piece cache smaller than the dataset, trainers reading batches mid-epoch:

* refused for 10 s, then for 60 s (past the client's ``request_timeout`` and its
  ``deadline``), then ``503 SlowDown`` for a while: the job finishes with exactly the
  batches of an undisturbed run (the local store's), and the trainer's log says what it
  waited for;
* with ``--storage-retry-s 5`` the job fails with a final ``StorageUnavailable`` naming
  the bucket's object and the last error;
* the previous release's client (``git archive b7c3137``, in a trainer subprocess) rides
  out an outage shorter than its own deadline against the new server;
* a cache barely larger than one request's pieces, with an outage: no refetch loop, the
  pieces fetched at most twice the distinct pieces served.

The server's botocore makes 2 attempts (``AWS_MAX_ATTEMPTS``) so that an outage's end is
seen within a few seconds; set ``TOKENFEED_OUTAGE_REPORT`` to a file to get the measured
stalls as JSON lines.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from live_server import LiveServer
from s3_front import S3Front
from s3_server import S3Server, s3_server_module  # noqa: F401  (a fixture)
from shard_data import BYTE
from tokenfeed import TokenFeedDataset
from tokenfeed.errors import StorageUnavailable
from tokenfeed_server.store import open_dataset, write_dataset
from tokenfeed_server.store.format import HEADER_SIZE
from tokenfeed_server.store.manifest import Manifest
from tokenfeed_server.store.objects import ObjectStore, S3Location
from tokenfeed_server.store.publish import publish_dataset
from waiting import wait_until

pytestmark = [pytest.mark.network, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "outage"
PREFIX = "store"
NAME = "d"
SEQ, SEED = 64, 3
PIECE = 4096
#: The previous release: its client is run against the server of this tree.
PREVIOUS_RELEASE = "b7c3137"
#: The global-order job of the outage tests: 4 rows a batch, 240 batches.
JOB: dict[str, Any] = {"seq_len": SEQ, "batch_size": 4, "seed": SEED, "samples": 960}


@dataclass(frozen=True)
class Built:
    local: Path
    manifest: Manifest
    shard_bytes: int


@pytest.fixture(scope="module")
def s3(s3_server_module: S3Server) -> S3Server:  # noqa: F811
    s3_server_module.make_bucket(BUCKET)
    return s3_server_module


@pytest.fixture(scope="module")
def built(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Built:
    """About 200k tokens in 10 shards of 4 KiB pieces, local and in the bucket."""
    root = tmp_path_factory.mktemp("built")
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 256, size=int(n), dtype=np.uint16) for n in rng.integers(5, 2000, 200)]
    write_dataset(
        root, NAME, docs, tokenizer=BYTE, shuffle_seed=0, shard_tokens=20_000, piece_bytes=PIECE
    )
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3.env().items():
            mp.setenv(key, value)
        publish_dataset(root / NAME, ObjectStore(S3Location(BUCKET, PREFIX)), NAME)
    with open_dataset(root, NAME) as ds:
        manifest = ds.manifest
        manifest.piece_digests()  # read the sidecar now, while the dataset is open
        shard_bytes = sum((ds.path / s.name).stat().st_size for s in manifest.shards)
    return Built(root, manifest, shard_bytes)


@pytest.fixture(scope="module")
def local(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with LiveServer(built.local, log_path=tmp_path_factory.mktemp("logs") / "local.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(local: LiveServer) -> list[np.ndarray]:
    """The job's batches, undisturbed, from the local store."""
    return [b["input_ids"].numpy().copy() for b in TokenFeedDataset(local.zmq, NAME, **JOB)]


@pytest.fixture
def front(s3: S3Server) -> Iterator[S3Front]:
    with S3Front(s3.endpoint) as running:
        yield running


def serve(s3: S3Server, front: S3Front, tmp_path: Path, cache_size: int, *extra: str) -> LiveServer:
    """A ``serve`` of the bucket through ``front`` (started: use it in a ``with``)."""
    env = {**s3.env(), "AWS_ENDPOINT_URL": front.endpoint, "AWS_MAX_ATTEMPTS": "2"}
    command = [
        sys.executable, "-m", "tokenfeed_server.cli", "serve",
        "--store", f"s3://{BUCKET}/{PREFIX}", "--host", "127.0.0.1",
        "--zmq-port", "0", "--http-port", "0",
        "--cache-dir", str(tmp_path / "cache"), "--cache-size", str(cache_size),
        "--chunk-bytes", "2048", *extra,
    ]  # fmt: skip
    return LiveServer(command=command, env=env, log_path=tmp_path / "server.log")


@dataclass
class Trainer:
    """A trainer in a thread: its batches and when each came. At each of ``gates`` (a
    number of batches) it waits until the test opens the gate, so that a fault is
    injected mid-epoch whatever the speed of the machine."""

    dataset: TokenFeedDataset
    gates: dict[int, threading.Event] = field(default_factory=dict)
    batches: list[np.ndarray] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            for batch in self.dataset:
                self.batches.append(batch["input_ids"].numpy().copy())
                self.times.append(time.monotonic())
                gate = self.gates.get(len(self.batches))
                if gate is not None and not gate.wait(120):
                    raise TimeoutError(f"gate {len(self.batches)} never opened")
        except BaseException as exc:  # reported by the test
            self.error = exc

    def done(self) -> bool:
        return not self.thread.is_alive()

    def stall(self, began: float) -> float:
        """The longest wait between two batches that ended after ``began``."""
        return stall(self.times, began)


def stall(times: list[float], began: float) -> float:
    """The longest wait between two of ``times`` that ended after ``began``."""
    return max((b - a for a, b in itertools.pairwise(times) if b > began), default=0.0)


def report(line: dict[str, Any]) -> None:
    """One measurement, as a JSON line, to ``$TOKENFEED_OUTAGE_REPORT`` if set."""
    path = os.environ.get("TOKENFEED_OUTAGE_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def fault(
    srv: LiveServer,
    front: S3Front,
    trainer: Trainer,
    gate: int,
    fault_: tuple[str, str, float],
) -> dict[str, Any]:
    """With the trainer held at ``gate``: fail the front (``(name, mode, seconds)``) and
    let the trainer on, looking at the server halfway; then the trainer's stall (measured
    once it has moved on) and what the server showed."""
    name, mode, seconds = fault_
    wait_until(lambda: len(trainer.batches) >= gate or trainer.done(), 60, f"{gate} batches")
    assert trainer.error is None, trainer.error
    notices = srv.settled_counter("storage_notices")
    with front.outage(mode) as began:
        trainer.gates[gate].set()
        time.sleep(seconds / 2)  # the outage itself: the test waits it out
        status = srv.get("/v1/status").json()
        datasets = srv.get("/v1/datasets").json()
        time.sleep(max(0.0, began + seconds - time.monotonic()))
        ended = time.monotonic()
    seen = len(trainer.batches)
    wait_until(lambda: len(trainer.batches) > seen + 8 or trainer.done(), 60, f"after {name}")
    line = {
        "fault": name,
        "seconds": round(ended - began, 1),
        "stall_s": round(trainer.stall(began), 1),
        "notices": srv.settled_counter("storage_notices") - notices,
        "status_cache": {k: status["cache"][k] for k in ("fetch_errors", "fetches", "fetching")},
        "datasets": datasets,
    }
    report(line)
    return line


@pytest.mark.timeout(240)
def test_outages_mid_epoch_delay_the_job_and_every_batch_is_exact(
    s3: S3Server,
    built: Built,
    reference: list[np.ndarray],
    front: S3Front,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="tokenfeed")
    with serve(s3, front, tmp_path, built.shard_bytes // 3) as srv:
        # A deadline shorter than the long outage: waiting on storage must not count.
        ds = TokenFeedDataset(
            srv.zmq, NAME, chunk_bytes=2048, deadline=30.0, allow_read_amplification=True, **JOB
        )  # a global shuffle through a cache a third of the dataset: refetches on purpose
        faults = {
            40: ("refused 10 s", "refuse", 10.0),
            100: ("refused 60 s", "refuse", 60.0),
            160: ("503 SlowDown 8 s", "slowdown", 8.0),
        }
        trainer = Trainer(ds, gates={at: threading.Event() for at in faults})
        trainer.thread.start()
        lines = [fault(srv, front, trainer, at, f) for at, f in faults.items()]
        trainer.thread.join(120)
        assert not trainer.thread.is_alive(), "the trainer did not finish"
    assert trainer.error is None, trainer.error
    assert len(trainer.batches) == len(reference) == 240
    for i, (got, want) in enumerate(zip(trainer.batches, reference, strict=True)):
        assert np.array_equal(got, want), f"batch {i} differs"
    for line in lines:  # each fault was met: the server told the waiting trainer
        assert line["notices"] >= 1, line
    warned = [r.getMessage() for r in caplog.records if "does not answer" in r.getMessage()]
    # the object that failed, its store's location redacted (the operator's business)
    assert warned and f"<store>/{NAME}/shard-" in warned[0]
    assert f"s3://{BUCKET}/{PREFIX}" not in warned[0]
    assert "retrying for up to" in warned[0]
    report({"trainer_log": warned[:3]})


@pytest.mark.timeout(120)
def test_past_the_retry_budget_the_job_fails_naming_the_object(
    s3: S3Server, built: Built, front: S3Front, tmp_path: Path
) -> None:
    with serve(s3, front, tmp_path, built.shard_bytes // 3, "--storage-retry-s", "5") as srv:
        front.refuse()
        began = time.monotonic()
        ds = TokenFeedDataset(
            srv.zmq, NAME, chunk_bytes=2048, deadline=60.0, allow_read_amplification=True, **JOB
        )
        with pytest.raises(StorageUnavailable) as info:
            next(iter(ds))
        failed_after = time.monotonic() - began
        datasets = srv.get("/v1/datasets").json()
    error = info.value
    assert not error.retry
    message = str(error)
    # the object: the first the job needs, the sidecar of piece digests (its bucket
    # redacted)
    assert re.search(f"<store>/{NAME}/pieces-[0-9a-f]{{32}}\\.bin", message), message
    assert f"s3://{BUCKET}/{PREFIX}" not in message
    assert "--storage-retry-s 5" in message and "unreachable" in message  # the last error
    assert 5.0 <= failed_after < 60.0  # the server's budget, not the client's deadline
    report({"fault": "budget 5 s", "failed_after_s": round(failed_after, 1), "error": message,
            "datasets": datasets})  # fmt: skip


_OLD_TRAINER = """
import json, sys, time
import numpy as np
import tokenfeed
from tokenfeed import TokenFeedDataset
assert tokenfeed.__file__.startswith(sys.argv[2]), tokenfeed.__file__
job = json.loads(sys.argv[3])
batches = []
for batch in TokenFeedDataset(sys.argv[1], "d", chunk_bytes=2048, **job):
    batches.append(batch["input_ids"].numpy())
    print(len(batches), time.monotonic(), flush=True)
np.save(sys.argv[4], np.stack(batches))
"""


@pytest.fixture(scope="module")
def previous_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's client package, from git."""
    root = tmp_path_factory.mktemp("previous")
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", PREVIOUS_RELEASE, "client"],
        capture_output=True,
        check=True,
        timeout=60,
    )
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True, timeout=60)
    return root / "client"


@pytest.mark.timeout(150)
def test_the_previous_release_client_rides_out_an_outage_shorter_than_its_deadline(
    s3: S3Server,
    built: Built,
    local: LiveServer,
    front: S3Front,
    previous_client: Path,
    tmp_path: Path,
) -> None:
    # A block shuffle: the previous client cannot ask for a global shuffle's read
    # amplification through a cache a third of the dataset (refused by default since).
    job = {**JOB, "shuffle": "block", "region_windows": 128, "block_regions": 1}
    reference = [b["input_ids"].numpy().copy() for b in TokenFeedDataset(local.zmq, NAME, **job)]
    script = tmp_path / "old_trainer.py"
    script.write_text(_OLD_TRAINER)
    out = tmp_path / "batches.npy"
    err = tmp_path / "old_trainer.err"
    with serve(s3, front, tmp_path, built.shard_bytes // 3) as srv, open(err, "w") as stderr:
        env = {**os.environ, "PYTHONPATH": str(previous_client)}
        args = [sys.executable, str(script), srv.zmq, str(previous_client), json.dumps(job)]
        proc = subprocess.Popen(
            [*args, str(out)], env=env, stdout=subprocess.PIPE, stderr=stderr, text=True
        )
        times: list[float] = []

        def follow() -> None:
            assert proc.stdout is not None
            with proc.stdout:
                for line in proc.stdout:
                    times.append(float(line.split()[1]))

        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        try:
            wait_until(lambda: len(times) >= 40 or proc.poll() is not None, 90, "40 batches")
            with front.outage("refuse") as began:
                time.sleep(15.0)  # the outage: the test waits it out
            proc.wait(90)
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(10)
            reader.join(10)
    assert proc.returncode == 0, err.read_text()[-3000:]
    got = np.load(out)
    assert got.shape[0] == len(reference)
    assert np.array_equal(got, np.stack(reference))
    report({"fault": "refused 15 s, previous client", "stall_s": round(stall(times, began), 1)})


def _pieces_of_windows(manifest: Manifest, windows: np.ndarray) -> set[str]:
    """The digests of the pieces holding the tokens of ``windows`` (of SEQ + 1 tokens)."""
    bounds = np.cumsum([0] + [s.tokens for s in manifest.shards])
    itemsize = np.dtype(manifest.dtype).itemsize
    out: set[str] = set()
    for w in windows.tolist():
        first, last = w * SEQ, w * SEQ + SEQ  # the window's tokens [first, last]
        for k in range(len(manifest.shards)):
            lo, hi = max(first, bounds[k]), min(last, bounds[k + 1] - 1)
            if lo > hi:
                continue
            start = HEADER_SIZE + (lo - bounds[k]) * itemsize
            stop = HEADER_SIZE + (hi - bounds[k]) * itemsize
            out.update(manifest.shard_pieces(k)[start // PIECE : stop // PIECE + 1])
    return out


@pytest.mark.timeout(120)
def test_a_cache_barely_larger_than_a_request_does_not_refetch_in_a_loop(
    s3: S3Server, built: Built, local: LiveServer, front: S3Front, tmp_path: Path
) -> None:
    job: dict[str, Any] = {
        "seq_len": SEQ, "batch_size": 2, "seed": SEED, "samples": 600, "chunk_bytes": 2048,
        "shuffle": "block", "region_windows": 128, "block_regions": 1,
    }  # fmt: skip
    undisturbed = list(TokenFeedDataset(local.zmq, NAME, **job))
    want = [b["input_ids"].numpy().copy() for b in undisturbed]
    windows = np.concatenate([b["window_ids"].numpy() for b in undisturbed])
    # One request: 2 rows, each across at most one piece boundary: 4 pieces at most; a
    # block of the plan: about 5 pieces. No prefetch: in a cache this small the next block
    # fetched ahead is evicted again by the current block's requests (the prefetch wants
    # room for a few blocks); what is tested here is the requests' own pins.
    with serve(s3, front, tmp_path, 6 * PIECE, "--prefetch-share", "0.01") as srv:
        gate = threading.Event()
        trainer = Trainer(TokenFeedDataset(srv.zmq, NAME, deadline=60.0, **job), {100: gate})
        trainer.thread.start()
        wait_until(lambda: len(trainer.batches) >= 100 or trainer.done(), 60, "100 batches")
        with front.outage("refuse"):
            gate.set()
            time.sleep(3.0)  # a small outage while requests compete for the room
        trainer.thread.join(60)
        assert not trainer.thread.is_alive(), "the trainer did not finish"
        stats = srv.get("/v1/status").json()["cache"]
    assert trainer.error is None, trainer.error
    assert len(trainer.batches) == len(want) == 300
    assert all(np.array_equal(g, w) for g, w in zip(trainer.batches, want, strict=True))
    served = _pieces_of_windows(built.manifest, windows)
    assert stats["fetches"] <= 2 * len(served), (stats["fetches"], len(served))
    report({"fault": "cache pressure, refused 3 s", "fetches": stats["fetches"],
            "distinct_pieces_served": len(served), "evictions": stats["evictions"]})  # fmt: skip
