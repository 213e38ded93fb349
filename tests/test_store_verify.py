"""``inspect --verify`` lists every missing or damaged object, ``--repair --source`` makes a
published dataset whole again: against a real S3 protocol server (moto, its own process).

Damage is done in the bucket through a plain boto3 client, never through the code under
test: bytes overwritten keeping the size (only a piece checksum can tell), an object
deleted, an object truncated, an extra file rewritten.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from s3_server import S3Server, s3_server_module  # noqa: F401  (fixture)
from shard_data import BYTE
from tokenfeed_server.cli import main
from tokenfeed_server.inspect_cli import EXIT_FINDINGS
from tokenfeed_server.store import write_dataset
from tokenfeed_server.store.objects import ObjectStore, S3Location
from tokenfeed_server.store.publish import publish_dataset
from tokenfeed_server.store.verify import repair_hint

pytestmark = pytest.mark.network

BUCKET = "verify-tests"
PIECE = 4096
STORE = f"s3://{BUCKET}/p"


@pytest.fixture
def s3(s3_server_module: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:  # noqa: F811
    """The shared moto server, emptied, with one bucket, and this process's AWS env on it."""
    s3_server_module.reset()
    s3_server_module.make_bucket(BUCKET)
    for name, value in s3_server_module.env({}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    yield s3_server_module


def _docs(seed: int, n: int = 120) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(100, 900))) for _ in range(n)]


def _publish(tmp_path: Path, name: str = "d", seed: int = 1) -> tuple[Path, list[str]]:
    """A local store with dataset ``name`` (four shards and an extra file), published to
    ``STORE``; returns the local store and the published keys of its shards, in order."""
    local = tmp_path / "local"
    notes = tmp_path / "notes.txt"
    notes.write_text("how this dataset was made\n")
    write_dataset(
        local, name, _docs(seed), tokenizer=BYTE, shuffle_seed=0, shard_tokens=16_000,
        piece_bytes=PIECE, extra_files={"notes.txt": notes},
    )  # fmt: skip
    published = publish_dataset(local / name, ObjectStore(S3Location(BUCKET, "p")), name)
    assert len(published.shards) >= 4
    return local, [f"p/{name}/{s.name}" for s in published.shards]


def _get(s3: S3Server, key: str) -> bytes:
    return bytes(s3.client.get_object(Bucket=BUCKET, Key=key)["Body"].read())


def _put(s3: S3Server, key: str, data: bytes) -> None:
    s3.client.put_object(Bucket=BUCKET, Key=key, Body=data)


def _flip(s3: S3Server, key: str, *offsets: int) -> None:
    data = bytearray(_get(s3, key))
    for offset in offsets:
        data[offset] ^= 0x5A
    _put(s3, key, bytes(data))


def _inspect(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["inspect", *args, "--no-progress"])
    out, err = capsys.readouterr()
    return code, out, err


def _problems(out: str) -> dict[str, str]:
    """``{url: "kind: detail"}`` of the objects an inspect listed as bad."""
    found = {}
    for line in out.splitlines():
        kind, _, rest = line.strip().partition(" ")
        if line.startswith("  ") and kind in ("missing", "damaged"):
            url, _, detail = rest.strip().partition(": ")
            found[url] = f"{kind}: {detail}"
    return found


def test_verify_lists_every_bad_object_not_just_the_first(
    s3: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, keys = _publish(tmp_path)
    assert _inspect(capsys, "d", "--store", STORE, "--verify")[0] == 0
    count = -(-len(_get(s3, keys[0])) // PIECE)
    _flip(s3, keys[0], PIECE + 10, 3 * PIECE + 1)  # same size: only checksums tell
    s3.client.delete_object(Bucket=BUCKET, Key=keys[1])
    _put(s3, keys[2], _get(s3, keys[2])[:-100])  # truncated
    [notes] = [k for k in s3.keys(BUCKET, "p/d/") if "notes-" in k]
    _put(s3, notes, b"someone else's notes\n")  # its name is the hash of its bytes

    code, out, err = _inspect(capsys, "d", "--store", STORE)  # sizes only
    assert code == EXIT_FINDINGS, err
    assert set(_problems(out)) == {f"s3://{BUCKET}/{k}" for k in keys[1:3]}
    assert "2 file(s) missing or damaged" in err

    code, out, err = _inspect(capsys, f"{STORE}/d", "--verify")  # the URL form works too
    assert code == EXIT_FINDINGS, err
    problems = _problems(out)
    assert problems == {
        f"s3://{BUCKET}/{keys[0]}": f"damaged: pieces 1, 3 (of {count}) do not match the "
        "manifest's checksums",
        f"s3://{BUCKET}/{keys[1]}": "missing: not in the bucket",
        f"s3://{BUCKET}/{keys[2]}": problems[f"s3://{BUCKET}/{keys[2]}"],
        f"s3://{BUCKET}/{notes}": "damaged: its bytes do not match the hash in its name",
    }
    assert problems[f"s3://{BUCKET}/{keys[2]}"].startswith("damaged: ")
    assert "the manifest says" in problems[f"s3://{BUCKET}/{keys[2]}"]
    assert f"tokenfeed-server inspect d --store {STORE} --verify --repair --source DIR" in out
    assert "Traceback" not in err


def test_repair_uploads_what_does_not_verify_and_checks_it_again(
    s3: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local, keys = _publish(tmp_path)
    good = {key: _get(s3, key) for key in keys}
    untouched = {k: s3.client.head_object(Bucket=BUCKET, Key=k)["ETag"] for k in keys[2:]}
    _flip(s3, keys[0], 5)
    s3.client.delete_object(Bucket=BUCKET, Key=keys[1])

    # DIR may be the local store holding the dataset, or the dataset's own directory.
    code, out, err = _inspect(capsys, "d", "--store", STORE, "--repair", "--source", str(local))
    assert code == 0, out + err
    assert f"found        damaged s3://{BUCKET}/{keys[0]}" in out
    assert f"found        missing s3://{BUCKET}/{keys[1]}" in out
    assert "repaired     2 object(s)" in out
    assert {k: _get(s3, k) for k in keys} == good
    # only what did not verify was uploaded again
    assert {k: s3.client.head_object(Bucket=BUCKET, Key=k)["ETag"] for k in keys[2:]} == untouched
    assert _inspect(capsys, "d", "--store", STORE, "--verify")[0] == 0
    # nothing to repair: a no-op that says all is well
    code, out, _ = _inspect(capsys, "d", "--store", STORE, "--repair", "--source", str(local / "d"))
    assert code == 0 and "checksums    ok" in out and "uploaded" not in out


def test_repair_refuses_a_source_that_is_not_the_same_build(
    s3: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local, keys = _publish(tmp_path)
    s3.client.delete_object(Bucket=BUCKET, Key=keys[1])
    other = tmp_path / "other"
    write_dataset(other, "d", _docs(7), tokenizer=BYTE, shuffle_seed=0, piece_bytes=PIECE)
    code, _, err = _inspect(capsys, "d", "--store", STORE, "--repair", "--source", str(other))
    assert code == 2 and "a repair needs a local copy of the same build" in err
    code, _, err = _inspect(capsys, "d", "--store", STORE, "--repair", "--source", str(tmp_path))
    assert code == 2 and "--source" in err and "manifest.json" in err
    code, _, err = _inspect(capsys, "d", "--store", STORE, "--repair")
    assert code == 2 and "--repair needs --source DIR" in err
    # A local copy damaged too is never uploaded: it would spread the damage.
    shard = sorted((local / "d").glob("shard-*.bin"))[1]
    data = bytearray(shard.read_bytes())
    data[PIECE + 7] ^= 1
    shard.write_bytes(bytes(data))
    code, _, err = _inspect(capsys, "d", "--store", STORE, "--repair", "--source", str(local))
    assert code == 2 and "the local copy does not match" in err and str(shard) in err
    assert keys[1] not in s3.keys(BUCKET, "p/d/")
    assert err.count("\n") == 1  # one line, no traceback


def test_a_local_dataset_lists_every_bad_shard_and_is_not_repaired(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "store"
    write_dataset(store, "d", _docs(3), tokenizer=BYTE, shuffle_seed=0, shard_tokens=16_000,
                  piece_bytes=PIECE)  # fmt: skip
    shards = sorted((store / "d").glob("shard-*.bin"))
    count = -(-shards[0].stat().st_size // PIECE)
    data = bytearray(shards[0].read_bytes())
    data[2 * PIECE] ^= 1
    shards[0].write_bytes(bytes(data))
    shards[2].unlink()
    code, out, err = _inspect(capsys, "d", "--store", str(store))
    assert code == EXIT_FINDINGS, err
    assert _problems(out) == {
        str(shards[0]): f"damaged: piece 2 (of {count}) does not match the manifest's checksums",
        str(shards[2]): "missing: no such file",
    }
    assert "prepare ... --dataset d --overwrite" in out
    code, out, _ = _inspect(capsys, str(store / "d"), "--no-verify")
    assert code == EXIT_FINDINGS and set(_problems(out)) == {str(shards[2])}
    code, _, err = _inspect(capsys, "d", "--store", str(store), "--repair", "--source", "x")
    assert code == 2 and "--repair is for datasets in object storage" in err


def test_repair_hint_names_the_dataset_and_the_store() -> None:
    hint = repair_hint("s3://b/a/b/web-v1/shard-0123.bin")
    assert hint.startswith("repair it with tokenfeed-server inspect web-v1 --store s3://b/a/b ")
    assert "--verify --repair --source DIR" in hint and "prepare ... --overwrite" in hint
    assert "inspect NAME --store s3://BUCKET/PREFIX" in repair_hint("not a url")
    assert json.dumps(hint)  # one plain line
