"""Manifest version 3: piece digests in a binary sidecar, read only when needed.

Round trip, laziness (the sidecar is not read to open, list or serve a local dataset),
a missing or damaged sidecar is a clear error, version 2 still served, equal
fingerprints for a v2/v3 pair of the same data, publish to and serve from the moto S3
server, and gc keeping the sidecar with its version.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from s3_server import S3Server, empty_bucket, s3_server_module  # noqa: F401  (fixtures)
from shard_data import BYTE, PINNED, pinned_docs
from tokenfeed.errors import ManifestError
from tokenfeed_server.store import open_dataset
from tokenfeed_server.store.cache import PieceCache
from tokenfeed_server.store.format import MANIFEST_NAME, PIECES_NAME, piece_digest
from tokenfeed_server.store.gc import gc_objects
from tokenfeed_server.store.manifest import Manifest
from tokenfeed_server.store.objects import ObjectStore
from tokenfeed_server.store.publish import publish_dataset, read_published
from tokenfeed_server.store.remote import open_remote_dataset, read_blocking
from tokenfeed_server.store.verify import verify_local, verify_published
from tokenfeed_server.store.writer import write_dataset

PIECE = 4096
BUCKET = "format-v3"


def _docs(seed: int, n: int = 120) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(50, 900))) for _ in range(n)]


def _write(store: Path, name: str = "d", version: int = 3, seed: int = 1) -> Manifest:
    return write_dataset(
        store, name, _docs(seed), tokenizer=BYTE, shuffle_seed=0, shard_tokens=20_000,
        piece_bytes=PIECE, format_version=version,
    )  # fmt: skip


def _file_digests(path: Path) -> list[str]:
    data = path.read_bytes()
    return [piece_digest(data[i : i + PIECE]) for i in range(0, len(data), PIECE)]


def test_round_trip_and_pieces_match_the_files(tmp_path: Path) -> None:
    m = _write(tmp_path)
    assert m.format_version == 3 and m.pieces_file == PIECES_NAME
    text = (tmp_path / "d" / MANIFEST_NAME).read_text()
    assert '"pieces":' not in text  # no digests in the JSON
    assert Manifest.from_json(text) == m
    with open_dataset(tmp_path, "d") as ds:
        for k, shard in enumerate(ds.manifest.shards):
            assert shard.pieces == ()
            want = _file_digests(tmp_path / "d" / shard.name)
            assert list(ds.manifest.shard_pieces(k)) == want
        assert len(ds.manifest.piece_digests()) == ds.manifest.piece_bases()[-1]
        sidecar = (tmp_path / "d" / PIECES_NAME).stat().st_size
        assert sidecar == 16 * len(ds.manifest.piece_digests())


def test_the_sidecar_is_not_read_to_open_or_serve(tmp_path: Path) -> None:
    _write(tmp_path)
    with open_dataset(tmp_path, "d") as ds:
        tokens = ds.read(0, ds.n_tokens).copy()
        ds.gather(np.array([0, 500, 7000]), 64)
        assert ds.manifest.sidecar_reads == 0 and not ds.manifest.pieces_loaded
        ds.manifest.shard_pieces(0)
        ds.manifest.shard_pieces(1)
        assert ds.manifest.sidecar_reads == 1  # read once, then kept
    assert len(tokens) > 0


def test_a_damaged_sidecar_is_an_error_when_needed(tmp_path: Path) -> None:
    _write(tmp_path)
    path = tmp_path / "d" / PIECES_NAME
    raw = bytearray(path.read_bytes())
    raw[5] ^= 0xFF  # same size: only the checksum tells
    path.write_bytes(bytes(raw))
    with open_dataset(tmp_path, "d") as ds:  # opens and serves: local reads need no digest
        ds.read(0, 100)
        with pytest.raises(ManifestError, match="piece sidecar is damaged"):
            ds.manifest.piece_digests()
    m = Manifest.from_json((tmp_path / "d" / MANIFEST_NAME).read_bytes())
    report = verify_local(tmp_path / "d", m)
    assert [f.key for f in report.findings] == [PIECES_NAME]
    assert "checksum mismatch" in report.findings[0].detail


@pytest.mark.parametrize(("cut", "match"), [(None, "sidecar is missing"), (16, "has 16 bytes")])
def test_a_missing_or_short_sidecar_refuses_open(
    tmp_path: Path, cut: int | None, match: str
) -> None:
    _write(tmp_path)
    path = tmp_path / "d" / PIECES_NAME
    if cut is None:
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(ManifestError, match=match):
        open_dataset(tmp_path, "d")


def test_bad_v3_manifests_are_refused(tmp_path: Path) -> None:
    m = _write(tmp_path)
    data = json.loads(m.to_json())
    for edit, match in [
        (lambda d: d.update(pieces_checksum="md5:00"), "pieces_checksum"),
        (lambda d: d.update(pieces_file="../x"), "not a plain name"),
        (lambda d: d["shards"][0].update(pieces=[]), "lists no pieces"),
        (lambda d: d.pop("pieces_file"), "pieces_file"),
    ]:
        bad = json.loads(json.dumps(data))
        edit(bad)
        with pytest.raises(ManifestError, match=match):
            Manifest.from_json(json.dumps(bad))
    v2 = json.loads(json.dumps(data))
    v2["format_version"] = 2
    with pytest.raises(ManifestError, match="no pieces_file"):
        Manifest.from_json(json.dumps(v2))


def test_v2_still_served_and_fingerprints_equal(tmp_path: Path) -> None:
    v2 = _write(tmp_path, "two", version=2)
    v3 = _write(tmp_path, "three", version=3)
    # the dataset name is content: compare the same name in two stores
    other = tmp_path / "other"
    v2_same = _write(other, "three", version=2)
    assert v2_same.fingerprint == v3.fingerprint and v2.fingerprint != v3.fingerprint
    with open_dataset(tmp_path, "two") as a, open_dataset(tmp_path, "three") as b:
        assert a.manifest.format_version == 2 and b.manifest.format_version == 3
        np.testing.assert_array_equal(a.read(0, a.n_tokens), b.read(0, b.n_tokens))
        for k in range(len(a.manifest.shards)):
            assert a.manifest.shard_pieces(k) == b.manifest.shard_pieces(k)
    assert not (tmp_path / "two" / PIECES_NAME).exists()
    pinned = write_dataset(
        tmp_path / "pin", "pin", pinned_docs(), tokenizer=BYTE, shuffle_seed=5, shard_tokens=8000
    )
    assert pinned.format_version == 3 and pinned.fingerprint == PINNED


@pytest.fixture
def objects(
    s3_server_module: S3Server,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[ObjectStore]:
    """An empty bucket on the shared moto server, this process's AWS env pointing at it."""
    yield empty_bucket(s3_server_module, monkeypatch, BUCKET)


def test_publish_and_serve_a_v3_dataset_from_s3(objects: ObjectStore, tmp_path: Path) -> None:
    local = _write(tmp_path)
    published = publish_dataset(tmp_path / "d", objects, "d")
    assert published.fingerprint == local.fingerprint
    assert published.pieces_file.startswith("pieces-") and published.pieces_file.endswith(".bin")
    remote = read_published(objects, "d")
    assert remote.format_version == 3 and not remote.pieces_loaded
    report = verify_published(objects, "d", remote, pieces=True)
    assert report.ok and report.pieces == remote.piece_bases()[-1]
    cache = PieceCache(tmp_path / "cache", 1 << 24, objects, backoff_s=0.01)  # type: ignore[arg-type]
    try:
        ds = open_remote_dataset(objects, cache, "d")
        assert ds.manifest.sidecar_reads == 0  # opened without reading the sidecar
        with open_dataset(tmp_path, "d") as mine:
            want = mine.read(0, mine.n_tokens).copy()
            starts = np.array([0, 333, 19_990, mine.n_tokens - 50])
            rows = mine.gather(starts, 50).copy()
        got = read_blocking(ds, lambda: ds.read(0, ds.n_tokens).copy())
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(read_blocking(ds, lambda: ds.gather(starts, 50).copy()), rows)
        assert ds.manifest.sidecar_reads == 1
    finally:
        cache.close()


def test_a_damaged_remote_sidecar_is_reported(objects: ObjectStore, tmp_path: Path) -> None:
    _write(tmp_path)
    published = publish_dataset(tmp_path / "d", objects, "d")
    key = f"d/{published.pieces_file}"
    raw = bytearray(objects.get(key))
    raw[0] ^= 1
    objects.put_bytes(key, bytes(raw))
    report = verify_published(objects, "d", read_published(objects, "d"), pieces=True)
    assert [f.key for f in report.findings] == [key]
    cache = PieceCache(tmp_path / "cache", 1 << 24, objects, backoff_s=0.01)  # type: ignore[arg-type]
    try:
        ds = open_remote_dataset(objects, cache, "d")
        with pytest.raises(ManifestError, match="piece sidecar is damaged"):
            read_blocking(ds, lambda: ds.read(0, 10).copy())
    finally:
        cache.close()


def test_gc_keeps_the_sidecar_of_kept_versions(objects: ObjectStore, tmp_path: Path) -> None:
    first = _write(tmp_path / "a")
    one = publish_dataset(tmp_path / "a" / "d", objects, "d")
    _write(tmp_path / "b", seed=2)
    two = publish_dataset(tmp_path / "b" / "d", objects, "d", overwrite=True)
    assert one.pieces_file != two.pieces_file
    gc_objects(objects, grace_s=0.0, keep_versions=2)
    keys = {o.key for o in objects.list("d/")}
    assert {f"d/{one.pieces_file}", f"d/{two.pieces_file}"} <= keys
    gc_objects(objects, grace_s=0.0, keep_versions=1)
    keys = {o.key for o in objects.list("d/")}
    assert f"d/{two.pieces_file}" in keys and f"d/{one.pieces_file}" not in keys
    assert first.fingerprint == one.fingerprint
