"""Dataset versions: the layout (local and in object storage), the catalog servers poll,
conditional publishes, honest re-uploads, and the serving Store's older versions.

The end-to-end paths (a job reading on across an overwrite and a server restart, a
checkpoint resumed on its version, a version gone) are in ``test_store_serving.py``,
``test_resume.py`` (local) and ``test_serve_s3.py`` (object storage); here the parts, and
a state saved before versions existed resuming on its build.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from live_server import LiveServer
from s3_server import S3Server, empty_bucket, s3_server_module  # noqa: F401  (fixture)
from shard_data import BYTE, PINNED, pinned_docs
from tokenfeed_server.store import Store, open_dataset, write_dataset
from tokenfeed_server.store.cache import PieceCache
from tokenfeed_server.store.catalog import read_catalog
from tokenfeed_server.store.format import MANIFEST_NAME
from tokenfeed_server.store.manifest import Manifest
from tokenfeed_server.store.objects import ObjectStore, S3Location, StorageUnreachable
from tokenfeed_server.store.pinned import VersionGone, VersionOpening
from tokenfeed_server.store.publish import PublishConflict, publish_dataset, upload_etags
from tokenfeed_server.store.versions import (
    CATALOG_KEY,
    list_versions,
    local_version_dir,
    version_key,
)
from waiting import wait_until

BUCKET = "versions"


def docs(seed: int, n: int = 150) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(50, 400))) for _ in range(n)]


def write(root: Path, name: str, seed: int, *, overwrite: bool = False, **kw: Any) -> Manifest:
    return write_dataset(
        root, name, docs(seed), tokenizer=BYTE, shuffle_seed=0, overwrite=overwrite, **kw
    )


# -- local layout ----------------------------------------------------------------------


def test_an_overwrite_keeps_the_previous_local_build_as_a_version(tmp_path: Path) -> None:
    root = tmp_path / "store"
    pinned = write_dataset(root, "pin", pinned_docs(), tokenizer=BYTE, shuffle_seed=5,
                           shard_tokens=8000)  # fmt: skip
    assert pinned.fingerprint == PINNED
    second = write(root, "pin", 1, overwrite=True)
    kept = local_version_dir(root, "pin", PINNED)
    assert kept == root / "_tokenfeed" / "versions" / "pin" / PINNED
    with open_dataset(root, "pin", path=kept) as old:
        assert old.fingerprint == PINNED  # the old build, whole, where it was moved
    assert open_dataset(root, "pin").fingerprint == second.fingerprint
    assert [v.fingerprint for v in list_versions(root, "pin")] == [PINNED]
    # the same content again keeps the build it replaces (jobs may read it) as that
    # version (see test_republish_same_content.py)
    write(root, "pin", 1, overwrite=True)
    assert {v.fingerprint for v in list_versions(root, "pin")} == {PINNED, second.fingerprint}
    # the reserved directory is never a dataset
    from tokenfeed_server.store.local import list_datasets

    assert list_datasets(root) == ["pin"]


def test_store_opens_an_older_local_version_on_demand(tmp_path: Path) -> None:
    root = tmp_path / "store"
    first = write(root, "d", 1)
    store = Store(root, scan_interval_s=3600.0)  # woken by wait_for_scan and requests
    store.open_all()
    try:
        held = store.get("d")  # a job holds the first build
        second = write(root, "d", 2, overwrite=True)
        assert store.wait_for_scan(timeout=10.0)
        assert store.version("d", "").fingerprint == second.fingerprint
        assert store.version("d", first.fingerprint) is held  # still open: no I/O
        summary = {s["name"]: s for s in store.summaries()}["d"]
        assert summary["version"] == second.fingerprint
        assert summary["versions_in_use"] == [first.fingerprint]
        assert store.held_versions() == {"d": sorted([first.fingerprint, second.fingerprint])}
        del held  # the job ends: the old build is closed with it
        assert store.wait_for_scan(timeout=10.0)
        assert {s["name"]: s for s in store.summaries()}["d"]["versions_in_use"] == []
        # a checkpoint of the first build: opened off the caller's thread, then served
        with pytest.raises(VersionOpening):
            store.version("d", first.fingerprint)
        reopened = wait_until(lambda: _try_version(store, "d", first.fingerprint), 10.0,
                              "the older version opened")  # fmt: skip
        assert reopened.path == local_version_dir(root, "d", first.fingerprint)
        # a version that is not kept: refused at once (the watcher lists what is kept),
        # clearly
        gone = "0" * 32
        with pytest.raises(VersionGone) as info:
            store.version("d", gone)
        assert f"version {gone} of dataset 'd' is no longer kept" in str(info.value)
        assert second.fingerprint in str(info.value)  # what the store has now
        # one removed since the last scan: looked for off the caller's thread, then refused
        del reopened
        shutil.rmtree(local_version_dir(root, "d", first.fingerprint))
        store.pinned.close()  # as if its last job ended and the pin expired
        with pytest.raises(VersionOpening):
            store.version("d", first.fingerprint)
        error = wait_until(lambda: _version_error(store, "d", first.fingerprint), 10.0,
                           "a refusal")  # fmt: skip
        assert isinstance(error, VersionGone)
    finally:
        store.close()


def _try_version(store: Store, name: str, fingerprint: str) -> Any:
    try:
        return store.version(name, fingerprint)
    except VersionOpening:
        return None


def _version_error(store: Store, name: str, fingerprint: str) -> BaseException | None:
    try:
        store.version(name, fingerprint)
    except VersionOpening:
        return None
    except Exception as exc:
        return exc
    raise AssertionError("served a version that is not kept")


@pytest.mark.network
def test_a_state_saved_before_versions_resumes_on_its_build(tmp_path: Path) -> None:
    """A loader state as the previous release saved it (a fingerprint, no version field)
    resumes bit-exactly on that build after an overwrite and a server restart."""
    from tokenfeed import TokenFeedDataset

    store = tmp_path / "store"
    write_dataset(store, "pin", pinned_docs(), tokenizer=BYTE, shuffle_seed=5, shard_tokens=8000)

    def loader(srv: LiveServer) -> TokenFeedDataset:
        return TokenFeedDataset(srv.zmq, "pin", seq_len=32, batch_size=2, rank=0,
                                world_size=1, deadline=20.0)  # fmt: skip

    with LiveServer(store, log_path=tmp_path / "log") as srv:
        reference = [b["input_ids"] for b in islice(iter(loader(srv)), 8)]
    write(store, "pin", 3, overwrite=True)
    state = {
        "position": 8, "seq_len": 32, "seed": 0, "batch_size": 2, "world_size": 1,
        "shuffle": "global", "block_sizes": {}, "run": "", "dataset": "pin",
        "fingerprint": PINNED,
    }  # fmt: skip
    with LiveServer(store, log_path=tmp_path / "log") as srv:
        resumed = loader(srv)
        resumed.load_state_dict(json.loads(json.dumps(state)))
        tail = [b["input_ids"] for b in islice(iter(resumed), 4)]
        assert resumed.fingerprint == PINNED
    assert all((a == b).all() for a, b in zip(tail, reference[4:], strict=True))


# -- object storage ----------------------------------------------------------------------


@pytest.fixture
def objects(
    s3_server_module: S3Server,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[ObjectStore]:
    """An empty bucket on the shared moto server, this process's AWS env pointing at it."""
    yield empty_bucket(s3_server_module, monkeypatch, BUCKET)


class _Counting(ObjectStore):
    """An ObjectStore that counts its requests by method (what a poll costs)."""

    def __init__(self, location: S3Location) -> None:
        super().__init__(location)
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def get_if_changed(self, key: str, etag: str | None) -> tuple[bytes, str] | None:
        self._count("get_if_changed")
        return super().get_if_changed(key, etag)

    def get(self, key: str) -> bytes:
        self._count("get")
        return super().get(key)

    def list(self, prefix: str = "") -> Iterator[Any]:
        self._count("list")
        return super().list(prefix)


def test_publish_writes_versions_and_the_catalog(objects: ObjectStore, tmp_path: Path) -> None:
    local = tmp_path / "l"
    a = write(local, "a", 1, piece_bytes=4096)
    publish_dataset(local / "a", objects, "a")
    b = write(local, "a", 2, overwrite=True, piece_bytes=4096)
    publish_dataset(local / "a", objects, "a", overwrite=True)
    for build in (a, b):  # every version kept, the same bytes as its manifest then
        kept = Manifest.from_json(objects.get(version_key("a", build.fingerprint)))
        assert kept.fingerprint == build.fingerprint
    current = objects.get(f"a/{MANIFEST_NAME}")
    assert current == objects.get(version_key("a", b.fingerprint))
    # (newest first; S3 times have one-second resolution: both may share theirs here)
    assert {v.fingerprint for v in list_versions(objects, "a")} == {a.fingerprint, b.fingerprint}
    catalog = json.loads(objects.get(CATALOG_KEY))
    assert catalog["format"] == 1
    assert catalog["datasets"]["a"]["fingerprint"] == b.fingerprint
    assert isinstance(catalog["datasets"]["a"]["published"], float)


def test_two_publishes_at_once_keep_both_versions_and_one_wins(
    objects: ObjectStore, tmp_path: Path
) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    base = write(one, "d", 1, piece_bytes=4096)
    publish_dataset(one / "d", objects, "d")
    first = write(one, "d", 2, overwrite=True, piece_bytes=4096)
    second = write(two, "d", 3, piece_bytes=4096)
    raced: list[Manifest] = []
    once = threading.Lock()  # uploads run a few at once: only the first one races

    def the_other_publish(key: str, size: int) -> None:
        # while the first prepare uploads, a second one publishes the same name whole
        with once:
            if not raced:
                raced.append(publish_dataset(two / "d", objects, "d", overwrite=True))

    with pytest.raises(PublishConflict, match="republished meanwhile by another prepare"):
        publish_dataset(one / "d", objects, "d", overwrite=True, on_upload=the_other_publish)
    assert raced and raced[0].fingerprint == second.fingerprint
    current = Manifest.from_json(objects.get(f"d/{MANIFEST_NAME}"))
    assert current.fingerprint == second.fingerprint  # exactly one is current
    kept = {v.fingerprint for v in list_versions(objects, "d")}
    assert kept == {base.fingerprint, first.fingerprint, second.fingerprint}
    catalog = read_catalog(objects)
    assert catalog is not None and catalog.datasets["d"].fingerprint == second.fingerprint
    # re-run, as the message says: it publishes on top
    publish_dataset(one / "d", objects, "d", overwrite=True)
    assert Manifest.from_json(objects.get(f"d/{MANIFEST_NAME}")).fingerprint == first.fingerprint


def test_an_overwrite_with_the_same_inputs_repairs_a_damaged_object(
    objects: ObjectStore,
    tmp_path: Path,
    s3_server_module: S3Server,  # noqa: F811
    caplog: Any,
) -> None:
    local = tmp_path / "l"
    write(local, "d", 1, shard_tokens=20_000, piece_bytes=4096)
    published = publish_dataset(local / "d", objects, "d")
    shard = published.shards[1].name
    key = f"p/d/{shard}"
    good = bytes(s3_server_module.client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    bad = bytearray(good)
    bad[5000] ^= 0xFF  # same size: name and size alone would call it intact
    s3_server_module.client.put_object(Bucket=BUCKET, Key=key, Body=bytes(bad))
    with caplog.at_level(logging.INFO, logger="tokenfeed_server.store.publish"):
        publish_dataset(local / "d", objects, "d", overwrite=True)
    files = len({s.name for s in published.shards}) + bool(published.pieces_file)  # + sidecar
    assert f"1 of {files} files uploaded (1 replaced because they did not match)" in caplog.text
    after = s3_server_module.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    assert after == good


def test_upload_etags_predict_multipart_uploads(objects: ObjectStore, tmp_path: Path) -> None:
    # 5 MiB parts (S3's least): an 11 MiB file goes up in three
    small = ObjectStore(objects.location, multipart_threshold=5 << 20,
                        multipart_chunksize=5 << 20)  # fmt: skip
    path = tmp_path / "big.bin"
    path.write_bytes(np.random.default_rng(0).bytes(11 << 20))
    small.put_file("big.bin", path)
    info = small.head("big.bin")
    assert info is not None and info.etag.endswith("-3")
    assert info.etag in upload_etags(small, path)
    small.put_bytes("whole.bin", path.read_bytes())  # one PUT: the plain MD5
    whole = small.head("whole.bin")
    assert whole is not None and whole.etag in upload_etags(small, path)


def _remote_store(objects: ObjectStore, tmp_path: Path) -> Store:
    cache = PieceCache(tmp_path / "cache", 1 << 24, objects)
    return Store(objects.location, scan_interval_s=3600.0, objects=objects, cache=cache)


def test_catalog_polling_is_one_request_per_poll(objects: ObjectStore, tmp_path: Path) -> None:
    local = tmp_path / "l"
    for i, name in enumerate(("a", "b", "c")):
        write(local, name, i, piece_bytes=4096)
        publish_dataset(local / name, objects, name)
    counting = _Counting(objects.location)
    store = _remote_store(counting, tmp_path)
    store.open_all()
    try:
        assert store.names() == ["a", "b", "c"]
        counting.calls.clear()
        for _ in range(5):
            assert store.wait_for_scan(timeout=10.0)
        assert counting.calls == {"get_if_changed": 5}  # nothing changed: 5 polls, no body
        new = write(local, "b", 9, overwrite=True, piece_bytes=4096)
        publish_dataset(local / "b", objects, "b", overwrite=True)
        counting.calls.clear()
        assert store.wait_for_scan(timeout=10.0)
        assert store.get("b").fingerprint == new.fingerprint
        # the changed catalog, then only b's new version (its manifest and one listing)
        assert counting.calls == {"get_if_changed": 1, "get": 1, "list": 1}
    finally:
        store.close()


def test_a_store_from_before_versions_is_served_and_gets_a_catalog(
    objects: ObjectStore,
    tmp_path: Path,
    s3_server_module: S3Server,  # noqa: F811
) -> None:
    local = tmp_path / "l"
    old = write(local, "old", 1, piece_bytes=4096)
    publish_dataset(local / "old", objects, "old")
    # the layout of the release before versions: no version objects, no catalog
    client = s3_server_module.client
    for key in s3_server_module.keys(BUCKET, "p/"):
        if "/versions/" in key or key.endswith(CATALOG_KEY):
            client.delete_object(Bucket=BUCKET, Key=key)
    assert read_catalog(objects) is None
    counting = _Counting(objects.location)
    store = _remote_store(counting, tmp_path)
    store.open_all()
    try:
        assert store.get("old").fingerprint == old.fingerprint  # found by listing
        assert store.version("old", old.fingerprint) is store.get("old")
        # its only version is its current manifest: an earlier one is not kept
        with pytest.raises(VersionOpening):
            store.version("old", "1" * 32)
        error = wait_until(lambda: _version_error(store, "old", "1" * 32), 10.0, "a refusal")
        assert isinstance(error, VersionGone)
        # the first publish with catalogs records the datasets already there too
        write(local, "new", 2, piece_bytes=4096)
        publish_dataset(local / "new", objects, "new")
        catalog = read_catalog(objects)
        assert catalog is not None and sorted(catalog.datasets) == ["new", "old"]
        assert catalog.datasets["old"].fingerprint == old.fingerprint
        assert store.wait_for_scan(timeout=10.0)
        assert store.names() == ["new", "old"]
    finally:
        store.close()


@pytest.mark.network
def test_a_mixture_resumes_on_each_source_s_version(tmp_path: Path) -> None:
    """A mixture pins each source: after one source is prepared again and the server
    restarted, a resumed state reads exactly what an undisturbed run would."""
    from tokenfeed import TokenFeedDataset

    store = tmp_path / "store"
    write(store, "a", 1)
    write(store, "b", 2)

    def loader(srv: LiveServer) -> TokenFeedDataset:
        return TokenFeedDataset(srv.zmq, {"a": 2, "b": 1}, seq_len=32, batch_size=3, rank=0,
                                world_size=1, deadline=20.0)  # fmt: skip

    with LiveServer(store, log_path=tmp_path / "log") as srv:
        reference = [b["input_ids"] for b in islice(iter(loader(srv)), 6)]
        head = loader(srv)
        assert len(list(islice(iter(head), 2))) == 2
        state = json.loads(json.dumps(head.state_dict()))
    write(store, "a", 7, overwrite=True)
    with LiveServer(store, log_path=tmp_path / "log") as srv:
        resumed = loader(srv)
        resumed.load_state_dict(state)
        tail = [b["input_ids"] for b in islice(iter(resumed), 4)]
        assert resumed.state_dict()["fingerprints"] == state["fingerprints"]
    assert all((x == y).all() for x, y in zip(tail, reference[2:], strict=True))


class _Flaky(ObjectStore):
    """An ObjectStore whose catalog polls fail while ``down`` (an outage of the endpoint)."""

    def __init__(self, location: S3Location) -> None:
        super().__init__(location)
        self.down = False

    def get_if_changed(self, key: str, etag: str | None) -> tuple[bytes, str] | None:
        if self.down:
            raise StorageUnreachable(f"{self.url(key)}: read failed: endpoint unreachable")
        return super().get_if_changed(key, etag)


def test_rescans_failing_in_an_outage_log_one_line_and_keep_serving(
    objects: ObjectStore, tmp_path: Path, caplog: Any
) -> None:
    local = tmp_path / "l"
    write(local, "a", 1, piece_bytes=4096)
    publish_dataset(local / "a", objects, "a")
    flaky = _Flaky(objects.location)
    store = _remote_store(flaky, tmp_path)
    store.open_all()
    try:
        served = store.get("a")
        flaky.down = True
        with caplog.at_level(logging.INFO, logger="tokenfeed_server.store.serving"):
            for _ in range(6):
                assert store.wait_for_scan(timeout=10.0)
            assert store.get("a") is served  # the last view, kept
            flaky.down = False
            assert store.wait_for_scan(timeout=10.0)
            wait_until(lambda: "rescans work again" in caplog.text, 10.0, "the recovery line")
        lines = [r.getMessage() for r in caplog.records if "rescan" in r.getMessage()]
        assert len(lines) == 2, lines  # one when it started failing, one when it recovered
        assert "cannot rescan store" in lines[0] and "endpoint unreachable" in lines[0]
        assert "Traceback" not in caplog.text
    finally:
        store.close()
