"""prepare into and from S3, inspect, gc: against a real S3 server (moto, its own process).

Every check reads the bucket back through a plain boto3 client, not through the code
under test: the keys listed, the bytes of each object, what is left after gc.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s3_server import S3Server, s3_server, s3_server_module  # noqa: F401  (fixtures)
from tokenfeed.errors import ConfigError, DatasetNotFound
from tokenfeed_server.cli import main
from tokenfeed_server.store import open_dataset
from tokenfeed_server.store.format import MANIFEST_NAME, shard_content_id
from tokenfeed_server.store.gc import gc_objects
from tokenfeed_server.store.manifest import Manifest
from tokenfeed_server.store.objects import (
    ObjectStore,
    ObjectStoreError,
    S3Location,
    parse_store,
)
from tokenfeed_server.store.publish import publish_dataset, read_published

pytestmark = pytest.mark.network

BUCKET = "tkf-test"
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "data",
    "token",
    "feed",
    "shard",
    "piece",
    "bucket",
    "object",
    "server",
    "train",
]


@pytest.fixture
def s3(s3_server_module: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:  # noqa: F811
    """The shared moto server, emptied, with one bucket, and this process's AWS env on it."""
    s3_server_module.reset()
    s3_server_module.make_bucket(BUCKET)
    _point_env_at(s3_server_module, monkeypatch)
    yield s3_server_module


def _point_env_at(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in server.env({}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # a dead endpoint fails in a second or two


def _corpus(root: Path, n_files: int = 12, seed: int = 0) -> Path:
    """Nested .txt and .jsonl files of random words, plus files a walk skips."""
    rng = np.random.default_rng(seed)
    (root / "sub" / "deeper").mkdir(parents=True)
    for i in range(n_files):
        words = [_WORDS[j] for j in rng.integers(0, len(_WORDS), int(rng.integers(50, 900)))]
        where = root / ("sub" if i % 3 else "") / ("deeper" if i % 4 == 1 else "")
        where.mkdir(parents=True, exist_ok=True)
        if i % 2:
            lines = [json.dumps({"text": " ".join(words[k::3])}) for k in range(3)]
            (where / f"f{i}.jsonl").write_text("\n".join(lines) + "\n")
        else:
            (where / f"f{i}.txt").write_text(" ".join(words))
    (root / ".hidden.txt").write_text("never read")
    (root / "sub" / "blob.bin").write_bytes(b"\0\1\2")
    return root


def _run(*args: str) -> int:
    return main(list(args))


def _keys(server: S3Server, prefix: str = "") -> list[str]:
    return server.keys(BUCKET, prefix)


def _get(server: S3Server, key: str) -> bytes:
    return bytes(server.client.get_object(Bucket=BUCKET, Key=key)["Body"].read())


def _digests(data: bytes, piece: int) -> list[str]:
    return [
        hashlib.blake2b(data[i : i + piece], digest_size=16).hexdigest()
        for i in range(0, len(data), piece)
    ]


def _published(server: S3Server, prefix: str, name: str) -> Manifest:
    return Manifest.from_json(_get(server, f"{prefix}/{name}/{MANIFEST_NAME}"))


# --------------------------------------------------------------------------- publish


def test_prepare_into_s3_equals_a_local_prepare(s3: S3Server, tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "corpus")
    common = ["--dataset", "d", "--shard-tokens", "3000", "--no-progress", "--seed", "7"]
    assert _run("prepare", str(corpus), "--store", str(tmp_path / "local"), *common) == 0
    assert _run("prepare", str(corpus), "--store", f"s3://{BUCKET}/team/v1", *common) == 0

    local = Manifest.from_json((tmp_path / "local" / "d" / MANIFEST_NAME).read_text())
    remote = _published(s3, "team/v1", "d")
    assert len(local.shards) > 3
    # layout: the manifest, its version object, the store's catalog, the sidecar of piece
    # digests (content-addressed) and one content-addressed object per distinct shard,
    # nothing else
    assert remote.format_version == 3 and local.format_version == 3
    assert re.fullmatch(r"pieces-[0-9a-f]{32}\.bin", remote.pieces_file)
    names = {s.name for s in remote.shards}
    assert set(_keys(s3)) == {
        "team/v1/d/manifest.json",
        f"team/v1/d/versions/{remote.fingerprint}.json",
        "team/v1/_tokenfeed/catalog.json",
        f"team/v1/d/{remote.pieces_file}",
    } | {f"team/v1/d/{n}" for n in names}
    # the digests of both, read back by hand (boto3 and the local file)
    sidecar = _get(s3, f"team/v1/d/{remote.pieces_file}")
    assert sidecar == (tmp_path / "local" / "d" / local.pieces_file).read_bytes()
    remote.attach_pieces(lambda: sidecar, "the published sidecar")
    local_sidecar = (tmp_path / "local" / "d" / local.pieces_file).read_bytes()
    local.attach_pieces(lambda: local_sidecar, "the local sidecar")
    for k, shard in enumerate(remote.shards):
        assert re.fullmatch(r"shard-[0-9a-f]{32}\.bin", shard.name)
        pieces = remote.shard_pieces(k)
        assert shard.name == f"shard-{shard_content_id(remote.piece_bytes, pieces)}.bin"
    # the same dataset: same fingerprint, counts, checksums, and byte-identical shards
    assert remote.fingerprint == local.fingerprint
    assert (remote.total_tokens, remote.documents) == (local.total_tokens, local.documents)
    pairs = zip(remote.shards, local.shards, strict=True)
    for k, (mine, theirs) in enumerate(pairs):
        assert (mine.tokens, mine.documents, mine.checksum, remote.shard_pieces(k)) == (
            theirs.tokens,
            theirs.documents,
            theirs.checksum,
            local.shard_pieces(k),
        )
        data = _get(s3, f"team/v1/d/{mine.name}")
        assert data == (tmp_path / "local" / "d" / theirs.name).read_bytes()
        assert _digests(data, remote.piece_bytes) == list(remote.shard_pieces(k))


def test_extra_files_are_content_addressed(s3: S3Server, tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "corpus", n_files=4)
    args = ["--dataset", "t", "--tokenizer", "bpe:300", "--no-progress"]
    assert _run("prepare", str(corpus), "--store", str(tmp_path / "local"), *args) == 0
    assert _run("prepare", str(corpus), "--store", f"s3://{BUCKET}/p", *args) == 0
    local_json = (tmp_path / "local" / "t" / "tokenizer.json").read_bytes()
    remote = _published(s3, "p", "t")
    digest = hashlib.blake2b(local_json, digest_size=16).hexdigest()
    assert remote.extra_files == (f"tokenizer-{digest}.json",)
    assert remote.tokenizer.file == f"tokenizer-{digest}.json"
    assert _get(s3, f"p/t/tokenizer-{digest}.json") == local_json
    local = Manifest.from_json((tmp_path / "local" / "t" / MANIFEST_NAME).read_text())
    assert remote.fingerprint == local.fingerprint


def test_inputs_read_from_s3_give_the_local_dataset(s3: S3Server, tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "corpus")
    for path in sorted(corpus.rglob("*")):
        if path.is_file():
            key = "raw/web/" + path.relative_to(corpus).as_posix()
            s3.client.put_object(Bucket=BUCKET, Key=key, Body=path.read_bytes())
    common = ["--dataset", "d", "--shard-tokens", "4000", "--no-progress"]
    assert _run("prepare", str(corpus), "--store", str(tmp_path / "a"), *common) == 0
    scratch = tmp_path / "scratch"
    assert (
        _run(
            "prepare", f"s3://{BUCKET}/raw/web", "--store", str(tmp_path / "b"), *common,
            "--scratch-dir", str(scratch),
        )
        == 0
    )  # fmt: skip
    with open_dataset(tmp_path / "a", "d") as a, open_dataset(tmp_path / "b", "d") as b:
        assert a.fingerprint == b.fingerprint  # same documents, same identities, same order
        assert np.array_equal(a.read(0, a.n_tokens), b.read(0, b.n_tokens))
    assert list(scratch.iterdir()) == []  # the downloads are gone
    # one object as an input is one file
    assert _run("prepare", f"s3://{BUCKET}/raw/web/f0.txt", "--store", str(tmp_path / "c"),
                "--dataset", "one", "--no-progress") == 0  # fmt: skip
    assert open_dataset(tmp_path / "c", "one").n_documents == 1


def test_overwrite_keeps_old_shards_until_gc(
    s3: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = _corpus(tmp_path / "corpus")
    store = f"s3://{BUCKET}/p"
    assert _run("prepare", str(corpus), "--store", store, "--dataset", "d",
                "--shard-tokens", "3000", "--no-progress") == 0  # fmt: skip
    first = set(_keys(s3))
    old = _published(s3, "p", "d")
    # without --overwrite: refused, nothing changed
    assert _run("prepare", str(corpus), "--store", store, "--dataset", "d", "--no-progress") == 2
    assert "already exists" in capsys.readouterr().err
    assert set(_keys(s3)) == first
    assert _run("prepare", str(corpus), "--store", store, "--dataset", "d",
                "--shard-tokens", "5000", "--no-progress", "--overwrite") == 0  # fmt: skip
    new = _published(s3, "p", "d")
    assert new.fingerprint != old.fingerprint
    referenced = {f"p/d/{s.name}" for s in new.shards} | {"p/d/manifest.json"}
    referenced |= {f"p/d/versions/{new.fingerprint}.json", "p/_tokenfeed/catalog.json"}
    referenced |= {f"p/d/{new.pieces_file}"}  # its sidecar of piece digests
    assert set(_keys(s3)) == first | referenced  # every old shard is still there
    assert f"p/d/versions/{old.fingerprint}.json" in first  # and the old version
    unreferenced = set(_keys(s3)) - referenced
    assert unreferenced

    capsys.readouterr()
    # the old version is one of the newest 3 (the default): nothing goes
    assert _run("gc", "--store", store, "--grace", "0") == 0
    assert "deleted 0 object(s)" in capsys.readouterr().out
    keep_one = ("--keep-versions", "1")
    assert _run("gc", "--store", store, "--grace", "0", "--dry-run", *keep_one) == 0
    out = capsys.readouterr().out
    assert f"would delete {len(unreferenced)} object(s)" in out
    assert set(_keys(s3)) == first | referenced  # a dry run deletes nothing
    assert _run("gc", "--store", store, *keep_one) == 0  # default grace: the old is too young
    assert "deleted 0 object(s)" in capsys.readouterr().out
    assert set(_keys(s3)) == first | referenced
    assert _run("gc", "--store", store, "--grace", "0", "--dataset", "d", *keep_one) == 0
    assert f"deleted {len(unreferenced)} object(s)" in capsys.readouterr().out
    assert set(_keys(s3)) == referenced  # exactly the unreferenced ones went
    assert _run("inspect", f"{store}/d", "--verify") == 0


def test_gc_rules(s3: S3Server, tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "corpus", n_files=4)
    assert _run("prepare", str(corpus), "--store", f"s3://{BUCKET}/p", "--dataset", "d",
                "--no-progress") == 0  # fmt: skip
    put = s3.client.put_object
    stale, half = "shard-" + "a" * 32 + ".bin", "shard-" + "b" * 32 + ".bin"
    put(Bucket=BUCKET, Key=f"p/d/{stale}", Body=b"an old build's shard")
    put(Bucket=BUCKET, Key=f"p/half/{half}", Body=b"an unfinished first publish")
    put(Bucket=BUCKET, Key=f"p/half/tokenizer-{'c' * 32}.json", Body=b"its tokenizer")
    # never tokenfeed's: other names, a nested key, a prefix that is no dataset name
    put(Bucket=BUCKET, Key="p/README", Body=b"not in any dataset")
    put(Bucket=BUCKET, Key="p/d/notes.txt", Body=b"someone's notes")
    put(Bucket=BUCKET, Key=f"p/d/sub/{stale}", Body=b"nested")
    put(Bucket=BUCKET, Key=f"p/.cache/{stale}", Body=b"a hidden prefix")
    put(Bucket=BUCKET, Key="p/broken/manifest.json", Body=b"{not json")
    put(Bucket=BUCKET, Key=f"p/broken/{half}", Body=b"kept: its manifest is unreadable")
    put(Bucket=BUCKET, Key=f"other/d/{stale}", Body=b"outside the store")
    before = set(_keys(s3))
    store = ObjectStore(S3Location(BUCKET, "p"))
    # within the grace period (counted from the object and from its manifest): nothing
    assert all(not r.deleted for r in gc_objects(store, grace_s=3600).datasets)
    later = datetime.now(timezone.utc) + timedelta(hours=2)
    report = gc_objects(store, grace_s=3600, now=later, dry_run=True)
    results = {r.dataset: r for r in report.datasets}
    assert set(_keys(s3)) == before
    assert [o.key for o in results["d"].deleted] == [f"d/{stale}"]
    assert sorted(o.key for o in results["d"].foreign) == ["d/notes.txt", f"d/sub/{stale}"]
    assert sorted(o.key for o in results["half"].deleted) == [
        f"half/{half}",
        f"half/tokenizer-{'c' * 32}.json",
    ]
    assert not results["half"].has_manifest
    assert not results[".cache"].deleted and results[".cache"].foreign
    assert results["broken"].error and not results["broken"].deleted
    gc_objects(store, grace_s=3600, now=later)
    assert before - set(_keys(s3)) == {
        f"p/d/{stale}",
        f"p/half/{half}",
        f"p/half/tokenizer-{'c' * 32}.json",
    }
    assert _run("inspect", f"s3://{BUCKET}/p/d", "--verify") == 0
    # the CLI says so when a manifest stops gc
    assert _run("gc", "--store", f"s3://{BUCKET}/p", "--grace", "0") == 2


def test_gc_grace_counts_from_the_manifest(s3: S3Server, tmp_path: Path) -> None:
    # Shards uploaded long ago but dropped by a manifest published a moment ago stay for
    # the grace period: a server may still read them. The clock is moved with `now`; the
    # sleep only makes the first build's objects older than the second manifest (S3 times
    # have one-second resolution).
    corpus = _corpus(tmp_path / "corpus", n_files=4)
    store = ObjectStore(S3Location(BUCKET, "p"))
    assert _run("prepare", str(corpus), "--store", str(tmp_path / "l"), "--dataset", "d",
                "--no-progress", "--shard-tokens", "2000") == 0  # fmt: skip
    publish_dataset(tmp_path / "l" / "d", store, "d")
    time.sleep(2.5)
    assert _run("prepare", str(corpus), "--store", str(tmp_path / "l"), "--dataset", "d",
                "--no-progress", "--shard-tokens", "2500", "--overwrite") == 0  # fmt: skip
    new = publish_dataset(tmp_path / "l" / "d", store, "d", overwrite=True)
    manifest = store.head(f"d/{MANIFEST_NAME}")
    assert manifest is not None
    dropped = [o for o in store.list("d/") if o.modified < manifest.modified]
    assert dropped  # the first build's shards, older than the manifest
    # every dropped object is older than the grace period, the manifest is not: kept
    # (the old version is kept by age alone: --keep-versions 1 keeps only the current)
    soon = manifest.modified + timedelta(seconds=1)
    assert not gc_objects(store, grace_s=1.5, keep_versions=1, now=soon).datasets[0].deleted
    later = manifest.modified + timedelta(seconds=2)
    gone = gc_objects(store, grace_s=1.5, keep_versions=1, now=later).datasets[0].deleted
    assert sorted(o.key for o in gone) == sorted(o.key for o in dropped)
    assert set(_keys(s3)) == {f"p/d/{s.name}" for s in new.shards} | {
        "p/d/manifest.json",
        f"p/d/versions/{new.fingerprint}.json",
        "p/_tokenfeed/catalog.json",
        f"p/d/{new.pieces_file}",
    }


# --------------------------------------------------------------------------- failures


def test_interrupted_publish_leaves_no_dataset(s3: S3Server, tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "corpus")
    assert _run("prepare", str(corpus), "--store", str(tmp_path / "l"), "--dataset", "d",
                "--no-progress", "--shard-tokens", "2000") == 0  # fmt: skip
    store = ObjectStore(S3Location(BUCKET, "p"))
    uploads: list[str] = []

    def interrupt_after_two(key: str, size: int) -> None:
        uploads.append(key)
        if len(uploads) == 2:
            raise KeyboardInterrupt

    local_shards = len(list((tmp_path / "l" / "d").glob("shard-*.bin")))
    with pytest.raises(KeyboardInterrupt):
        publish_dataset(tmp_path / "l" / "d", store, "d", on_upload=interrupt_after_two)
    left = _keys(s3, "p/d/")
    assert 2 <= len(left) < local_shards  # some files went up, not all
    assert "p/d/manifest.json" not in left
    with pytest.raises(DatasetNotFound, match="no dataset 'd'"):
        read_published(store, "d")
    assert _run("inspect", f"s3://{BUCKET}/p/d") == 2
    # the leftovers have no manifest: gc takes them once past the grace period
    assert _run("gc", "--store", f"s3://{BUCKET}/p", "--grace", "0") == 0
    assert _keys(s3) == []
    # and a retry publishes the whole dataset
    published = publish_dataset(tmp_path / "l" / "d", store, "d")
    # its shards, its sidecar of piece digests, its manifest and its version object
    assert len(_keys(s3, "p/d/")) == len({s.name for s in published.shards}) + 3


def test_endpoint_dying_mid_publish(
    s3_server: S3Server,  # noqa: F811 - its own server: this test kills it
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s3_server.make_bucket(BUCKET)
    _point_env_at(s3_server, monkeypatch)
    corpus = _corpus(tmp_path / "corpus")
    assert _run("prepare", str(corpus), "--store", str(tmp_path / "l"), "--dataset", "d",
                "--no-progress", "--shard-tokens", "2000") == 0  # fmt: skip
    store = ObjectStore(S3Location(BUCKET, "p"))
    endpoint = s3_server.endpoint
    with pytest.raises(ObjectStoreError, match=f"endpoint {endpoint} unreachable") as caught:
        publish_dataset(
            tmp_path / "l" / "d", store, "d", on_upload=lambda key, size: s3_server.kill()
        )
    assert f"s3://{BUCKET}/p/d/shard-" in str(caught.value)  # names the object
    assert "AWS_ENDPOINT_URL" in str(caught.value)  # and what to check


def _cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenfeed_server.cli", *args],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("store", "message"),
    [
        ("s3://", "names no bucket"),
        ("s3:///x", "names no bucket"),
        ("gs://bucket/x", "gs:// scheme is not supported"),
        ("s3://b/x", "not a valid bucket name"),
        ("s3://bucket/a//b", "empty, '.' or '..' segment"),
    ],
)
def test_bad_store_urls_exit_2(store: str, message: str, tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("some text")
    r = _cli("prepare", "in.txt", "--store", store, "--dataset", "d", env=dict(os.environ),
             cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]  # no "s3:" directory
    with pytest.raises(ConfigError):
        parse_store(store)


def test_missing_bucket_and_missing_credentials_exit_2(s3: S3Server, tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("some text")
    env = s3.env()
    r = _cli("prepare", "in.txt", "--store", "s3://no-such-bucket/p", "--dataset", "d",
             env=env, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2
    assert "bucket 'no-such-bucket' does not exist" in r.stderr and s3.endpoint in r.stderr
    r = _cli("inspect", "s3://no-such-bucket/p/d", env=env, cwd=tmp_path)
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = _cli("inspect", f"s3://{BUCKET}", env=env, cwd=tmp_path)
    assert r.returncode == 2 and "names a bucket, not a dataset" in r.stderr
    r = _cli("gc", "--store", "s3://no-such-bucket/p", env=env, cwd=tmp_path)
    assert r.returncode == 2 and "does not exist" in r.stderr
    bare = {k: v for k, v in env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    bare["AWS_EC2_METADATA_DISABLED"] = "true"  # no instance role lookup either
    r = _cli("prepare", "in.txt", "--store", f"s3://{BUCKET}/p", "--dataset", "d",
             env=bare, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2
    assert "no AWS credentials found" in r.stderr and "AWS_ACCESS_KEY_ID" in r.stderr
    assert "Traceback" not in r.stderr


def test_inspect_verify_finds_a_bad_piece(
    s3: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = _corpus(tmp_path / "corpus")
    url = f"s3://{BUCKET}/p/d"
    assert _run("prepare", str(corpus), "--store", f"s3://{BUCKET}/p", "--dataset", "d",
                "--no-progress") == 0  # fmt: skip
    capsys.readouterr()
    assert _run("inspect", url, "--verify") == 0
    assert "checksums    ok" in capsys.readouterr().out
    shard = _published(s3, "p", "d").shards[0]
    key = f"p/d/{shard.name}"
    data = bytearray(_get(s3, key))
    data[len(data) // 2] ^= 1  # same size: only the piece checksum can tell
    s3.client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    assert _run("inspect", url) == 0  # sizes only
    capsys.readouterr()
    assert _run("inspect", url, "--verify") == 1  # a finding, listed: exit 1
    out = capsys.readouterr().out
    assert f"damaged  {url}/{shard.name}: piece" in out and "--repair --source DIR" in out
    s3.client.delete_object(Bucket=BUCKET, Key=key)
    assert _run("inspect", url) == 1
    assert f"missing  {url}/{shard.name}: not in the bucket" in capsys.readouterr().out


def test_object_store_keys_are_relative_to_the_prefix(s3: S3Server) -> None:
    store = ObjectStore(S3Location(BUCKET, "a/b"))
    store.put_bytes("x/1", b"0123456789")
    s3.client.put_object(Bucket=BUCKET, Key="a/bc/2", Body=b"a sibling prefix")
    assert [o.key for o in store.list()] == ["x/1"]
    assert store.get_range("x/1", 2, 5) == b"234"
    info = store.head("x/1")
    assert info is not None and info.size == 10
    assert store.head("x/none") is None
    assert store.touch("x/1") and not store.touch("x/none")
    with pytest.raises(ObjectStoreError, match="shorter than its manifest says"):
        store.get_range("x/1", 5, 20)
    store.delete(["x/1", "x/none"])
    assert _keys(s3) == ["a/bc/2"]


def test_gc_of_a_local_store_removes_dead_writers_temp_dirs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "store"
    corpus = _corpus(tmp_path / "corpus", n_files=2)
    assert _run("prepare", str(corpus), "--store", str(store), "--dataset", "d",
                "--no-progress") == 0  # fmt: skip
    dead = store / ".tmp-d-999999-dead"  # a writer that died: its lock file is not held
    dead.mkdir()
    (dead / ".lock").write_text("")
    (dead / "shard-000000.bin").write_bytes(b"half written")
    capsys.readouterr()
    assert _run("gc", "--store", str(store), "--dry-run") == 0
    assert ".tmp-d-999999-dead" in capsys.readouterr().out and dead.exists()
    assert _run("gc", "--store", str(store)) == 0
    assert "deleted 1 temp directories" in capsys.readouterr().out
    assert not dead.exists()
    assert open_dataset(store, "d").n_documents > 0  # the dataset itself is untouched
    # --dataset: only that dataset's older builds (the temp directories are store-wide)
    assert _run("gc", "--store", str(store), "--dataset", "d") == 0
    out = capsys.readouterr().out
    assert "d: deleted 0 older build(s)" in out and "temp directories" not in out


def test_refused_credentials_exit_2(tmp_path: Path) -> None:
    # moto checks credentials once INITIAL_NO_AUTH_ACTION_COUNT is 0: "testing" is unknown
    (tmp_path / "in.txt").write_text("some text")
    with S3Server(tmp_path / "moto.log", env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as strict:
        env = {**strict.env(), "AWS_MAX_ATTEMPTS": "1"}
        r = _cli("prepare", "in.txt", "--store", f"s3://{BUCKET}/p", "--dataset", "d",
                 env=env, cwd=tmp_path)  # fmt: skip
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert f"s3://{BUCKET}: access denied" in r.stderr
        assert "s3:GetObject, s3:PutObject" in r.stderr  # what the policy must allow
        r = _cli("inspect", f"s3://{BUCKET}/p/d", env=env, cwd=tmp_path)
        assert r.returncode == 2
        assert f"s3://{BUCKET}/p/d/manifest.json: the credentials were refused" in r.stderr


_SEGMENT = st.from_regex(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,10}", fullmatch=True).filter(
    lambda s: s not in (".", "..")
)


@settings(max_examples=200, deadline=None)
@given(
    bucket=st.from_regex(r"[a-z0-9][a-z0-9.-]{2,20}", fullmatch=True),
    parts=st.lists(_SEGMENT, max_size=4),
    trailing=st.booleans(),
)
def test_store_urls_round_trip(bucket: str, parts: list[str], trailing: bool) -> None:
    prefix = "/".join(parts)
    text = f"s3://{bucket}/{prefix}" + ("/" if trailing and prefix else "")
    location = parse_store(text)
    assert location == S3Location(bucket, prefix)
    assert parse_store(location.url()) == location
    assert location.key("k") == (f"{prefix}/k" if prefix else "k")
    if parts:
        parent, name = location.split()
        assert (parent.child(name), name) == (location, parts[-1])
    # a path is a path, including one that merely contains "s3"
    assert parse_store(f"data/s3/{bucket}") == Path(f"data/s3/{bucket}")
