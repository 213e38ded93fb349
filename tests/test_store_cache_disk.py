"""The piece cache's disk chores: evicted files are unlinked off the caller's thread, the
cache shrinks when the real disk fills (and grows back), a full disk on a write shrinks it
instead of failing the request, and file-descriptor exhaustion is said as such without
showing the cache's path.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_store_cache_faults import PIECE, Bucket, park
from tokenfeed_server.store.cache import PieceCache
from tokenfeed_server.store.cache_disk import DiskUsage
from tokenfeed_server.store.errors import CacheDiskFull, CacheOutOfDescriptors, wire_error
from tokenfeed_server.store.piece_files import PieceDirectory
from waiting import wait_until


class Disk:
    """A disk shared with other files: ``room`` (set by the test) is what would be free if
    the cache held nothing; the cache's own files take the rest, as on a real disk."""

    TOTAL = 1 << 41

    def __init__(self) -> None:
        self.room = 1 << 40

    def usage(self, path: Path) -> DiskUsage:
        held = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        free = max(0, self.room - held)
        return DiskUsage(self.TOTAL, self.TOTAL - free, free)


@pytest.fixture
def bucket() -> Bucket:
    return Bucket(pieces=24)


@pytest.fixture
def disk() -> Disk:
    return Disk()


@pytest.fixture
def cache(tmp_path: Path, bucket: Bucket, disk: Disk) -> Iterator[PieceCache]:
    made = PieceCache(tmp_path / "cache", 8 * PIECE, bucket, disk_usage=disk.usage)  # type: ignore[arg-type]
    try:
        yield made
    finally:
        made.close()


def read(cache: PieceCache, refs: list, timeout: float = 10) -> None:  # type: ignore[type-arg]
    waiter = park(cache, refs)
    assert waiter.wait(timeout) and waiter.error is None, waiter.error
    cache.release(waiter)


def test_evicted_files_are_unlinked_off_the_callers_thread(
    cache: PieceCache, bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    removed_by: list[str] = []
    remove = PieceDirectory.remove

    def recording(self: PieceDirectory, digest: str) -> None:
        removed_by.append(threading.current_thread().name)
        remove(self, digest)

    monkeypatch.setattr(PieceDirectory, "remove", recording)
    refs = bucket.refs()
    for i in range(0, len(refs), 4):  # 24 pieces through a cache of 8: evictions
        read(cache, refs[i : i + 4])  # evicts on this thread, as the data plane's loop does
    wait_until(lambda: cache.disk_bytes() <= 8 * PIECE, 10, "the evicted files unlinked")
    assert cache.stats()["evictions"] >= 16 and len(removed_by) >= 16
    assert threading.current_thread().name not in removed_by
    assert set(removed_by) <= {"tokenfeed-cache-disk"} | {f"tokenfeed-fetch-{i}" for i in range(16)}


def test_the_cache_shrinks_when_the_disk_fills_and_grows_back(
    cache: PieceCache, bucket: Bucket, disk: Disk, caplog: pytest.LogCaptureFixture
) -> None:
    refs = bucket.refs()
    read(cache, refs[:8])  # full: 8 pieces
    caplog.set_level(logging.WARNING, logger="tokenfeed_server.store.cache_disk")
    reserve = min(256 << 20, Disk.TOTAL // 50)
    disk.room = reserve + 5 * PIECE  # other files filled the disk: room for 5 pieces
    wait_until(
        lambda: cache.stats()["capacity_effective_bytes"] == 5 * PIECE, 10, "the cache shrunk"
    )
    stats = cache.stats()
    assert stats["capacity_bytes"] == 8 * PIECE  # --cache-size is unchanged
    assert stats["reserved_bytes"] <= stats["capacity_effective_bytes"]
    wait_until(
        lambda: cache.disk_bytes() <= cache.stats()["capacity_effective_bytes"],
        10,
        "the files over the effective capacity unlinked",
    )
    read(cache, refs[8:10])  # requests are still served, within the smaller cache
    shrunk = [r for r in caplog.records if "nearly full" in r.getMessage()]
    assert len(shrunk) == 1  # logged once per episode
    disk.room = 1 << 40
    wait_until(lambda: cache.stats()["capacity_effective_bytes"] == 8 * PIECE, 10, "the size back")
    assert any("room again" in r.getMessage() for r in caplog.records)


def test_a_full_disk_on_a_write_shrinks_the_cache_instead_of_failing(
    cache: PieceCache, bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    refs = bucket.refs()
    read(cache, refs[:8])
    install = cache.files.install
    refused: list[str] = []

    def full_once(ref: object, data: bytes) -> None:
        if not refused:
            refused.append("ENOSPC")
            raise CacheDiskFull("cannot write a piece to the server's cache: No space left")
        install(ref, data)  # type: ignore[arg-type]

    monkeypatch.setattr(cache.files, "install", full_once)
    read(cache, refs[8:9])
    assert refused and cache.stats()["unreadable"] == 0
    assert isinstance(wire_error(CacheDiskFull("x")).retry, bool)
    assert wire_error(CacheDiskFull("x")).retry  # if it ever reaches a trainer: retryable


def test_out_of_file_descriptors_is_said_as_such_without_the_cache_path(
    cache: PieceCache, bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    refs = bucket.refs()[:2]
    read(cache, refs)
    cache._index.close_files()  # so the next read opens them again

    def no_descriptors(*args: object, **kw: object) -> int:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr("tokenfeed_server.store.piece_files.os.open", no_descriptors)
    with pytest.raises(CacheOutOfDescriptors) as info, cache.lock:
        cache.acquire_locked([r.digest for r in refs], lambda: refs)
    message = str(info.value)
    assert "too many open files: raise the limit or lower --cache-max-open" in message
    assert str(cache.directory) not in message
    assert wire_error(info.value).retry
