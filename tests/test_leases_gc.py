"""gc by use, not by age: server leases (store/leases.py) and gc keeping what is in use.

The S3 tests run against a real S3 protocol server (moto, its own process) and read the
bucket back through a plain boto3 client: the keys before and after each gc. The end to
end tests run real server processes (``--lease-s 2``) and real trainers' loaders: a job
reading a version that an ``--overwrite`` replaced, while ``gc --grace 0`` runs, ends its
epoch with exactly the batches of an undisturbed run, and gc takes that version's objects
only once the job is gone; a server killed with SIGKILL leaves a lease that expires; a
``--read-only-store`` server writes nothing under ``_tokenfeed/leases/``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from live_server import LiveServer
from s3_server import S3Server, s3_server_module  # noqa: F401  (fixture)
from shard_data import BYTE, random_docs
from tokenfeed import TokenFeedDataset
from tokenfeed_server.cli import main
from tokenfeed_server.store import write_dataset
from tokenfeed_server.store.gc import NO_LEASES, gc_local, gc_objects
from tokenfeed_server.store.leases import (
    LEASES_PREFIX,
    LeaseKeeper,
    encode_lease,
    parse_lease,
    read_leases,
    write_lease,
)
from tokenfeed_server.store.manifest import Manifest
from tokenfeed_server.store.objects import ObjectInfo, ObjectStore, S3Location
from tokenfeed_server.store.publish import publish_dataset
from tokenfeed_server.store.versions import CATALOG_KEY, VERSIONS_DIR, local_version_dir
from waiting import wait_until

BUCKET = "gc-tests"
PREFIX = "p"
URL = f"s3://{BUCKET}/{PREFIX}"
PIECE = 4096


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def s3(s3_server_module: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:  # noqa: F811
    """The shared moto server, emptied, with one bucket, and this process's AWS env on it."""
    s3_server_module.reset()
    s3_server_module.make_bucket(BUCKET)
    for name, value in s3_server_module.env({}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    yield s3_server_module


def _objects() -> ObjectStore:
    return ObjectStore(S3Location(BUCKET, PREFIX))


def _keys(s3: S3Server, under: str = "") -> set[str]:
    return {k[len(PREFIX) + 1 :] for k in s3.keys(BUCKET, f"{PREFIX}/{under}")}


def _build(root: Path, seed: int, name: str = "d", n_docs: int = 300) -> Path:
    """A local build of ``name`` (its own store dir per seed): a distinct fingerprint."""
    store = root / f"build{seed}"
    write_dataset(store, name, random_docs(n_docs, seed=seed), tokenizer=BYTE,
                  shuffle_seed=0, shard_tokens=3000, piece_bytes=PIECE)  # fmt: skip
    return store / name


def _publish(objects: ObjectStore, build: Path, name: str = "d") -> Manifest:
    """Publish ``build`` as the current version, in a second of its own (S3 times have
    one-second resolution, and "the newest K" orders versions by them)."""
    manifest = publish_dataset(build, objects, name, overwrite=True)
    info = objects.head(f"{name}/{VERSIONS_DIR}/{manifest.fingerprint}.json")
    assert info is not None
    wait_until(lambda: datetime.now(timezone.utc) - info.modified > timedelta(seconds=1.05),
               5, "the next second")  # fmt: skip
    return manifest


def _needs(m: Manifest, name: str = "d") -> set[str]:
    """The keys one version needs: its manifest and files."""
    files = {f"{name}/{s.name}" for s in m.shards} | {f"{name}/{f}" for f in m.extra_files}
    if m.pieces_file:  # version 3: its sidecar of piece digests
        files.add(f"{name}/{m.pieces_file}")
    return files | {f"{name}/{VERSIONS_DIR}/{m.fingerprint}.json"}


def _lease(
    store: Path | ObjectStore, server: str, held: dict[str, list[str]], *, valid_s: float
) -> None:
    """A lease as a server would write it, valid ``valid_s`` more seconds (< 0: lapsed)."""
    now = time.time()
    body = json.loads(encode_lease(server, held, lease_s=600, now=now))
    # lapsed: written long ago, lived one second (so the store's clock agrees it lapsed)
    body["written"], body["expires"] = (
        (now, now + valid_s) if valid_s > 0 else (now - 999, now - 998)
    )
    write_lease(store, server, json.dumps(body).encode())
    if isinstance(store, Path) and valid_s <= 0:  # the store's clock too (S3: wait 1 s)
        os.utime(store / LEASES_PREFIX / f"{server}.json", (now - 999, now - 999))


def _gc(*args: str) -> int:
    return main(["gc", "--store", URL, *args])


# --------------------------------------------------------------------------- leases


def test_lease_keeper_follows_the_held_set_and_removes_its_lease(tmp_path: Path) -> None:
    held: dict[str, list[str]] = {"d": ["a" * 32]}
    keeper = LeaseKeeper(tmp_path, lease_s=30).start(lambda: dict(held))
    try:
        leases = wait_until(lambda: read_leases(tmp_path).leases, 5, "the first lease")
        lease = leases[0]
        assert (lease.server, lease.pid) == (keeper.server_id, os.getpid())
        assert lease.held == {"d": frozenset({"a" * 32})}
        assert lease.expires - lease.written == 30
        # a job starting on another version (a mixture of two datasets): written at once
        held.update({"d": ["b" * 32], "m": ["c" * 32, "b" * 32]})
        wait_until(lambda: read_leases(tmp_path).leases[0].held.get("m"), 3, "the new held set")
        assert read_leases(tmp_path).leases[0].holds("d", "b" * 32)
        assert not read_leases(tmp_path).leases[0].holds("d", "a" * 32)
    finally:
        keeper.stop()
    assert read_leases(tmp_path).leases == []
    assert [p.name for p in (tmp_path / LEASES_PREFIX).iterdir()] == []  # no temp file left


def test_a_failing_lease_write_is_logged_and_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "_tokenfeed"
    blocker.write_text("a file where the lease directory goes")  # every write fails
    keeper = LeaseKeeper(tmp_path, lease_s=30).start(lambda: {"d": ["a" * 32]})
    try:
        wait_until(lambda: "write failed, retrying" in caplog.text, 5, "the logged failure")
        blocker.unlink()
        wait_until(lambda: read_leases(tmp_path).leases, 10, "the lease after the fault")
        assert caplog.text.count("write failed") == 1  # logged once, not per retry
    finally:
        keeper.stop()


def test_lease_expiry_is_judged_on_both_clocks() -> None:
    body = encode_lease(
        "s", {"d": ["a" * 32, "nope"], "Bad Name": ["b" * 32]}, lease_s=10, now=100.0
    )
    lease = parse_lease(body, where="k", stamp="e", modified=100.0)
    assert lease is not None and lease.held == {"d": frozenset({"a" * 32})}
    assert not lease.expired(110.9) and lease.expired(111.0)  # S3 times: whole seconds
    # the server's clock ran 50 s slow: the store's time of the write keeps it valid
    skewed = parse_lease(body, where="k", stamp="e", modified=150.0)
    assert skewed is not None and not skewed.expired(160.9) and skewed.expired(161.0)
    assert parse_lease(b"{not json", where="k", stamp="e", modified=0.0) is None


# --------------------------------------------------------------------------- gc (S3)


@pytest.mark.network
def test_gc_keeps_current_newest_and_leased_versions(s3: S3Server, tmp_path: Path) -> None:
    objects = _objects()
    v1, v2, v3 = (_publish(objects, _build(tmp_path, seed)) for seed in (1, 2, 3))
    _lease(objects, "dead", {"d": [v2.fingerprint]}, valid_s=-1)
    _lease(objects, "live", {"d": [v1.fingerprint]}, valid_s=600)
    before = _keys(s3)
    assert _needs(v1) | _needs(v2) | _needs(v3) <= before
    # K = 3 (default): all three are among the newest. (gc's clock 3 s ahead: the store's
    # time of the lapsed lease, whole seconds, would keep it valid 2 s more.)
    soon = datetime.now(timezone.utc) + timedelta(seconds=3)
    report = gc_objects(objects, grace_s=0, now=soon)
    assert not report.datasets[0].deleted and _keys(s3) == before - {f"{LEASES_PREFIX}/dead.json"}
    assert [x.server for x in report.expired] == ["dead"]
    # K = 1: v3 is current, v1 leased (whatever --grace says); v2 goes, shards and all
    report = gc_objects(objects, grace_s=0, keep_versions=1, now=soon)
    result = report.datasets[0]
    kept = {k.fingerprint: k.reasons for k in result.kept}
    assert kept[v3.fingerprint] == ["current", "one of the newest 1"]
    assert kept[v1.fingerprint][0].startswith("leased by server live (")
    assert result.dropped == [v2.fingerprint]
    assert _keys(s3) == before - _needs(v2) - {f"{LEASES_PREFIX}/dead.json"}
    assert _needs(v2) - _needs(v1) - _needs(v3) == _needs(v2)  # nothing shared here
    # the lease goes (its server stopped): v1 goes too
    objects.delete([f"{LEASES_PREFIX}/live.json"])
    gc_objects(objects, grace_s=0, keep_versions=1)
    assert _keys(s3) == _needs(v3) | {"d/manifest.json", CATALOG_KEY}


@pytest.mark.network
def test_without_leases_grace_protects_and_gc_says_so(
    s3: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    objects = _objects()
    v1 = _publish(objects, _build(tmp_path, 1))
    v2 = _publish(objects, _build(tmp_path, 2))
    capsys.readouterr()
    assert _gc("--keep-versions", "1") == 0  # default grace: v1 stopped being current now
    out = capsys.readouterr().out
    assert f"version {v1.fingerprint}  kept: younger than the grace period" in out
    assert f"version {v2.fingerprint}  kept: current; one of the newest 1" in out
    assert f"note: {NO_LEASES}" in out
    assert _needs(v1) <= _keys(s3)
    assert _gc("--keep-versions", "1", "--grace", "0") == 0
    out = capsys.readouterr().out
    assert f"version {v1.fingerprint}  deleted" in out
    assert not _needs(v1) & _keys(s3) and _needs(v2) <= _keys(s3)


class _RacingStore(ObjectStore):
    """A real ObjectStore that runs ``hook`` once, when gc first reads the current
    manifest's time: something another process does between gc's decision and its delete."""

    hook: Callable[[], None] | None = None

    def head(self, key: str) -> ObjectInfo | None:
        info = super().head(key)
        hook, self.hook = self.hook, None
        if hook is not None and key.endswith("/manifest.json"):
            hook()
        return info


@pytest.mark.network
def test_the_recheck_spares_what_became_used_before_the_delete(
    s3: S3Server, tmp_path: Path
) -> None:
    store = _RacingStore(S3Location(BUCKET, PREFIX))
    b1, b2 = _build(tmp_path, 1), _build(tmp_path, 2)
    v1, v2 = _publish(store, b1), _publish(store, b2)
    before = _keys(s3)
    # a server takes a lease on v1 (a job resumed on it) while gc decides
    store.hook = lambda: _lease(store, "late", {"d": [v1.fingerprint]}, valid_s=600)
    result = gc_objects(store, grace_s=0, keep_versions=1).datasets[0]
    assert not result.deleted and {o.key for o in result.raced} == _needs(v1)
    assert _keys(s3) == before | {f"{LEASES_PREFIX}/late.json"}
    store.delete([f"{LEASES_PREFIX}/late.json"])
    # a publish makes v1 current again while gc decides: nothing of it goes
    store.hook = lambda: publish_dataset(b1, store, "d", overwrite=True) and None
    result = gc_objects(store, grace_s=0, keep_versions=1).datasets[0]
    assert not result.deleted and _needs(v1) <= {o.key for o in result.raced}
    assert _needs(v1) | _needs(v2) <= _keys(s3)


@pytest.mark.network
def test_a_store_of_the_previous_release_is_collected_as_before(
    s3: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    objects = _objects()
    old1 = _publish(objects, _build(tmp_path, 1), "old")
    old2 = _publish(objects, _build(tmp_path, 2), "old")
    new1 = _publish(objects, _build(tmp_path, 3), "new")
    new2 = _publish(objects, _build(tmp_path, 4), "new")
    # "old" as the previous release wrote it: no versions/, no catalog (a mixed store)
    objects.delete([k for k in _keys(s3) if k.startswith(f"old/{VERSIONS_DIR}/")] + [CATALOG_KEY])
    files = {f"old/{s.name}" for s in old1.shards} | {f"old/{old1.pieces_file}"}
    # a lease on a version gc cannot read (no manifest of it left): nothing unreferenced goes
    _lease(objects, "srv", {"old": [old1.fingerprint]}, valid_s=600)
    result = gc_objects(objects, name="old", grace_s=0).datasets[0]
    assert not result.deleted and {o.key for o in result.held} == files
    objects.delete([f"{LEASES_PREFIX}/srv.json"])
    before = _keys(s3)
    capsys.readouterr()
    assert _gc("--grace", "0") == 0
    assert "old: deleted" in capsys.readouterr().out
    # exactly what the previous gc deleted: what the current manifest does not name
    assert _keys(s3) == before - files
    assert _needs(new1, "new") | _needs(new2, "new") <= _keys(s3)  # versioned: K = 3 keeps both
    assert {f"old/{s.name}" for s in old2.shards} <= _keys(s3)


# --------------------------------------------------------------------------- gc (local)


def test_local_gc_prunes_older_builds_beyond_k_unless_leased(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "store"
    prints = []
    for seed in (1, 2, 3, 4):
        m = write_dataset(store, "d", random_docs(100, seed=seed), tokenizer=BYTE,
                          shuffle_seed=0, overwrite=True)  # fmt: skip
        prints.append(m.fingerprint)
    f1, f2, f3, _ = prints
    retired = [local_version_dir(store, "d", f) for f in (f1, f2, f3)]
    assert all(p.is_dir() for p in retired)
    _lease(store, "srv", {"d": [f1]}, valid_s=600)
    _lease(store, "gone", {"d": [f2]}, valid_s=-1)
    capsys.readouterr()
    # K = 2: the current build (f4) and the newest older one (f3); f1 leased; f2 goes
    assert main(["gc", "--store", str(store), "--grace", "0", "--keep-versions", "2"]) == 0
    out = capsys.readouterr().out
    assert f"version {f3}  kept: one of the newest 2" in out
    assert f"version {f1}  kept: leased by server srv" in out
    assert [p.is_dir() for p in retired] == [True, False, True]
    assert {x.server for x in read_leases(store).leases} == {"srv"}  # the lapsed one went
    (store / LEASES_PREFIX / "srv.json").unlink()
    report = gc_local(store, name="d", grace_s=0, keep_versions=1)
    assert report.local[0].kept[0].reasons == ["current", "one of the newest 1"]
    assert not any(p.exists() for p in retired)
    assert (store / "d" / "manifest.json").is_file()  # the current build is never touched


# --------------------------------------------------------------------------- end to end

LEASE_S = 5.0  # refreshed every 1.7 s: a loaded test machine does not let it lapse


def _serve(s3: S3Server, where: Path, dataset_bytes: int, *extra: str) -> LiveServer:
    """A server of the bucket's store with a short lease, jobs forgotten a second after
    their trainer leaves, and a cache a third of the dataset (so a job reads the bucket
    all epoch long, not only at its start)."""
    command = [
        sys.executable, "-m", "tokenfeed_server.cli", "serve", "--store", URL,
        "--host", "127.0.0.1", "--zmq-port", "0", "--http-port", "0",
        "--cache-dir", str(where / "cache"), "--cache-size", str(dataset_bytes // 3),
        "--chunk-bytes", "2048", "--remote-scan-interval-s", "0.2",
        "--lease-s", str(LEASE_S), "--job-ttl-s", "1", *extra,
    ]  # fmt: skip
    return LiveServer(command=command, env=s3.env(), log_path=where / "server.log")


def _loader(srv: LiveServer) -> TokenFeedDataset:
    # the cache holds part of the dataset on purpose: a global shuffle must ask for it
    return TokenFeedDataset(srv.zmq, "d", seq_len=64, batch_size=4, rank=0, world_size=1,
                            epochs=1, request_timeout=5.0, deadline=60.0,
                            allow_read_amplification=True)  # fmt: skip


def _rows(batch: dict[str, Any]) -> tuple[bytes, bytes]:
    return batch["input_ids"].numpy().tobytes(), batch["window_ids"].numpy().tobytes()


def _held(objects: ObjectStore, fingerprint: str) -> bool:
    return any(x.holds("d", fingerprint) for x in read_leases(objects).valid(time.time()))


def _big_build(root: Path, seed: int) -> tuple[Path, int]:
    """A build of ``d`` of about 45 pieces, and its bytes."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 256, size=int(rng.integers(100, 800))) for _ in range(200)]
    m = write_dataset(root / f"big{seed}", "d", docs, tokenizer=BYTE, shuffle_seed=0,
                      shard_tokens=30_000, piece_bytes=PIECE)  # fmt: skip
    return root / f"big{seed}" / "d", sum(s.file_size(m.itemsize) for s in m.shards)


@pytest.mark.network
@pytest.mark.slow
def test_gc_grace_0_after_overwrite_spares_the_version_a_job_reads(
    s3: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    objects = _objects()
    build1, size = _big_build(tmp_path, 1)
    v1 = publish_dataset(build1, objects, "d")
    with _serve(s3, tmp_path, size) as srv:
        expected = [_rows(b) for b in _loader(srv)]  # an undisturbed epoch of v1
        it = iter(_loader(srv))
        got = [_rows(next(it)) for _ in range(10)]
        wait_until(lambda: _held(objects, v1.fingerprint), 5, "a lease holding v1")
        v2 = publish_dataset(_big_build(tmp_path, 2)[0], objects, "d", overwrite=True)
        assert _gc("--grace", "0", "--keep-versions", "1") == 0
        assert "kept: leased by server" in capsys.readouterr().out
        assert _needs(v1) | _needs(v2) <= _keys(s3)
        got += [_rows(b) for b in it]  # the rest of the epoch, from the bucket
        assert got == expected  # bit-exact, on v1
        # the job ends; a second later the server forgets it and its lease drops v1
        wait_until(lambda: not _held(objects, v1.fingerprint), 30, "the lease without v1")
        assert _gc("--grace", "0", "--keep-versions", "1") == 0
        assert not _needs(v1) & _keys(s3) and _needs(v2) <= _keys(s3)
        assert len(read_leases(objects).valid(time.time())) == 1  # the server's own
    assert not _keys(s3, LEASES_PREFIX)  # a clean stop deletes the lease


@pytest.mark.network
@pytest.mark.slow
def test_a_killed_servers_lease_expires_then_gc_proceeds(
    s3: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    objects = _objects()
    build1, size = _big_build(tmp_path, 1)
    v1 = publish_dataset(build1, objects, "d")
    srv = _serve(s3, tmp_path, size, "--lease-s", "3").start()
    try:
        it = iter(_loader(srv))
        next(it)
        wait_until(lambda: _held(objects, v1.fingerprint), 5, "a lease holding v1")
        publish_dataset(_big_build(tmp_path, 2)[0], objects, "d", overwrite=True)
    finally:
        srv.kill()  # SIGKILL: no clean stop, the lease stays (valid 2 s more at least)
    assert _keys(s3, LEASES_PREFIX)
    assert _gc("--grace", "0", "--keep-versions", "1") == 0
    assert _needs(v1) <= _keys(s3)  # still leased: kept
    wait_until(lambda: not _held(objects, v1.fingerprint), 10, "the lease to expire")
    capsys.readouterr()
    assert _gc("--grace", "0", "--keep-versions", "1") == 0
    out = capsys.readouterr().out
    assert "deleted 1 expired lease(s)" in out and f"note: {NO_LEASES}" in out
    assert not _needs(v1) & _keys(s3) and not _keys(s3, LEASES_PREFIX)


@pytest.mark.network
def test_a_read_only_server_writes_no_lease(s3: S3Server, tmp_path: Path) -> None:
    objects = _objects()
    build1, size = _big_build(tmp_path, 1)
    publish_dataset(build1, objects, "d")
    before = _keys(s3)
    with _serve(s3, tmp_path, size, "--read-only-store") as srv:
        it = iter(_loader(srv))
        next(it), next(it)  # a job reads (its cache is a third of the dataset: see _serve)
        assert "--read-only-store: this server writes no lease" in srv.log_tail(200)
    assert _keys(s3) == before  # nothing written: no lease, nothing else


@pytest.mark.network
def test_a_server_of_a_local_store_leases_what_its_jobs_read(tmp_path: Path) -> None:
    store = tmp_path / "store"
    m = write_dataset(store, "d", random_docs(400, seed=1), tokenizer=BYTE, shuffle_seed=0)
    with LiveServer(store, extra=["--lease-s", "30"], log_path=tmp_path / "server.log") as srv:
        srv.run_job("d")
        wait_until(lambda: [x for x in read_leases(store).leases if x.holds("d", m.fingerprint)],
                   5, "a lease in the store directory")  # fmt: skip
        assert read_leases(store).leases[0].server == srv.get("/v1/status").json()["server"]
    assert read_leases(store).leases == []  # a clean stop deletes it
