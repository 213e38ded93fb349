"""The piece cache of a remote store, against a real S3 protocol server (moto, a process).

A dataset is written locally (small pieces, several shards), published to the bucket,
and read back through a :class:`PieceCache` a third of its size: every read equals the
local dataset's, the cache never holds more than its size on disk (watched by a thread
while it works), bad bytes are fetched again or reported naming the object, temp files
of a killed server are removed at start and never served, and eviction takes pieces the
prefetch plan does not want first.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from s3_server import S3Server, s3_server_module  # noqa: F401  (fixture)
from shard_data import BYTE
from tokenfeed.errors import StoreError
from tokenfeed.plan import Plan
from tokenfeed_server.config import parse_size
from tokenfeed_server.store import Dataset, open_dataset, write_dataset
from tokenfeed_server.store.cache import (
    UNLIMITED_ROWS,
    CacheTooSmall,
    PieceCache,
    PieceRef,
    PieceUnreadable,
)
from tokenfeed_server.store.format import piece_digest
from tokenfeed_server.store.mixing import Feed, Source
from tokenfeed_server.store.objects import ObjectStore, ObjectStoreError, S3Location
from tokenfeed_server.store.prefetch import Prefetcher, most_that_fit, wanted_ranges
from tokenfeed_server.store.publish import publish_dataset
from tokenfeed_server.store.remote import RemoteDataset, open_remote_dataset, read_blocking
from waiting import wait_until

PIECE = 4096
BUCKET = "cache-tests"


def _docs(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(50, 900))) for _ in range(400)]


@pytest.fixture(scope="module")
def s3(s3_server_module: S3Server) -> Iterator[S3Server]:  # noqa: F811
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3_server_module.env({}).items():
            mp.setenv(key, value)
        mp.delenv("AWS_PROFILE", raising=False)
        s3_server_module.make_bucket(BUCKET)
        yield s3_server_module


@pytest.fixture(scope="module")
def published(
    s3: S3Server, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Dataset, ObjectStore]:
    """The local dataset ``d`` (3+ shards, 4 KiB pieces) and the store it is published to."""
    store = tmp_path_factory.mktemp("local")
    write_dataset(
        store, "d", _docs(1), tokenizer=BYTE, shuffle_seed=0, shard_tokens=60_000, piece_bytes=PIECE
    )
    objects = ObjectStore(S3Location(BUCKET, "store"))
    publish_dataset(store / "d", objects, "d")
    return open_dataset(store, "d"), objects


def _cache(tmp_path: Path, objects: ObjectStore, capacity: int, **kw: object) -> PieceCache:
    return PieceCache(tmp_path / "cache", capacity, objects, backoff_s=0.01, **kw)  # type: ignore[arg-type]


@contextlib.contextmanager
def _remote(
    tmp_path: Path, objects: ObjectStore, capacity: int, name: str = "d", **kw: object
) -> Iterator[RemoteDataset]:
    """Dataset ``name`` of ``objects`` read through a fresh cache of ``capacity`` bytes
    (``ds.cache``), closed afterwards."""
    cache = _cache(tmp_path, objects, capacity, **kw)
    try:
        yield open_remote_dataset(objects, cache, name)
    finally:
        cache.close()


class _Watch:
    """Samples the cache directory's bytes on disk while a test works."""

    def __init__(self, cache: PieceCache) -> None:
        self.cache = cache
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.cache.disk_bytes())
            self._stop.wait(0.002)

    def __enter__(self) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.cache.disk_bytes())


def test_random_reads_equal_local_and_the_bound_holds(
    published: tuple[Dataset, ObjectStore], tmp_path: Path
) -> None:
    local, objects = published
    remote_bytes = sum(s.file_size(local.dtype.itemsize) for s in local.manifest.shards)
    capacity = remote_bytes // 3
    with _remote(tmp_path, objects, capacity) as ds:
        cache = ds.cache
        assert isinstance(ds, RemoteDataset) and ds.nbytes == remote_bytes
        assert len(ds.manifest.shards) >= 3
        assert ds.fingerprint == local.fingerprint
        rng = np.random.default_rng(7)
        with _Watch(cache) as watch:
            for _ in range(120):
                length = int(rng.integers(1, 700))
                starts = rng.integers(0, local.n_tokens - length, size=int(rng.integers(1, 9)))
                got = read_blocking(ds, lambda s=starts, n=length: ds.gather(s, n).copy())
                np.testing.assert_array_equal(got, local.gather(starts, length))
            # rows scattered over a bigger buffer (a mixture's): every row exact, nothing
            # else written, across piece and shard boundaries
            # (8 rows of 3 pieces at most fit in the cache at once)
            starts = rng.integers(0, local.n_tokens - 3000, size=8)
            big = np.zeros((16, 3000), dtype=local.dtype)
            picked = np.sort(rng.choice(16, size=8, replace=False))
            views = [(memoryview(big[i]),) for i in picked.tolist()]
            read_blocking(ds, lambda: ds.gather_rows(starts, 3000, views))
            np.testing.assert_array_equal(big[picked], local.gather(starts, 3000))
            assert not big[np.setdiff1d(np.arange(16), picked)].any()
            # a read across every shard boundary, and document starts from the index
            for k in range(1, len(local.manifest.shards)):
                edge = int(local._bounds_list[k])
                got = read_blocking(ds, lambda e=edge: ds.read(e - 300, e + 300))
                np.testing.assert_array_equal(got, local.read(edge - 300, edge + 300))
            got = read_blocking(ds, lambda: ds.document_starts(0, local.n_tokens))
            np.testing.assert_array_equal(got, local.document_starts(0, local.n_tokens))
        stats = cache.stats()
        assert watch.peak <= capacity, (watch.peak, capacity)
        assert stats["reserved_bytes"] <= capacity
        assert stats["fetching"] == 0
        # the counts are the disk's, once the evicted files are unlinked (in the background)
        wait_until(lambda: cache.stats()["size_bytes"] == cache.disk_bytes(), 10, "the files")
        assert stats["evictions"] > 0  # the cache really was too small for the dataset
        assert stats["misses"] > 0 and stats["hits"] > 0
        assert stats["bytes_fetched"] >= capacity
        assert stats["fetch_latency_p50_s"] is not None


def test_concurrent_requests_in_a_tight_cache_all_complete(
    published: tuple[Dataset, ObjectStore], tmp_path: Path
) -> None:
    """Requests that each need a good part of the cache, from several threads at once:
    admitted whole, first come first served, so none waits for room another holds."""
    local, objects = published
    capacity = 12 * PIECE
    cache = _cache(tmp_path, objects, capacity, fetchers=3)
    errors: list[BaseException] = []
    try:
        ds = open_remote_dataset(objects, cache, "d")

        def reader(seed: int) -> None:
            rng = np.random.default_rng(seed)
            try:
                for _ in range(15):
                    starts = rng.integers(0, local.n_tokens - 65, size=4)
                    got = read_blocking(ds, lambda s=starts: ds.gather(s, 65).copy(), timeout=60)
                    np.testing.assert_array_equal(got, local.gather(starts, 65))
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        with _Watch(cache) as watch:
            threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
        assert watch.peak <= capacity
    finally:
        cache.close()


def test_a_request_larger_than_the_cache_is_read_in_rounds(
    published: tuple[Dataset, ObjectStore], tmp_path: Path
) -> None:
    """Rows over ten pieces through a cache of two: read in rounds that fit, exactly; only
    a row whose own pieces do not fit is refused, naming --cache-size."""
    local, objects = published
    with _remote(tmp_path, objects, 2 * PIECE) as ds:
        starts = np.arange(0, 10 * PIECE, PIECE // 2) // ds.dtype.itemsize
        got = read_blocking(ds, lambda: ds.gather(starts, 16).copy())
        np.testing.assert_array_equal(got, local.gather(starts, 16))
        assert ds.rounds.rounds >= 5  # at most one piece a round: half of two
        assert ds.cache.stats()["reserved_bytes"] <= 2 * PIECE
        too_long = 2 * PIECE // ds.dtype.itemsize + 1  # three pieces at least
        with pytest.raises(CacheTooSmall, match="--cache-size"):
            read_blocking(ds, lambda: ds.gather(np.array([0]), too_long))


class _CorruptOnce:
    """The bucket, with the first answer for each piece damaged in transit."""

    def __init__(self, objects: ObjectStore) -> None:
        self.objects = objects
        self.seen: set[tuple[str, int]] = set()

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        data = self.objects.get_range(key, start, stop)
        if (key, start) not in self.seen:
            self.seen.add((key, start))
            return bytes([data[0] ^ 0xFF]) + data[1:]
        return data


def test_bytes_damaged_in_transit_are_fetched_again(
    published: tuple[Dataset, ObjectStore], tmp_path: Path
) -> None:
    local, objects = published
    source = _CorruptOnce(objects)
    cache = PieceCache(tmp_path / "cache", 40 * PIECE, source, backoff_s=0.01)
    try:
        ds = open_remote_dataset(objects, cache, "d")
        got = read_blocking(ds, lambda: ds.read(1000, 9000))
        np.testing.assert_array_equal(got, local.read(1000, 9000))
        stats = cache.stats()
        assert stats["checksum_mismatches"] == stats["fetches"] >= 2
        assert stats["unreadable"] == 0
    finally:
        cache.close()


def test_a_bad_copy_in_the_bucket_is_reported_naming_the_object(
    published: tuple[Dataset, ObjectStore], s3: S3Server, tmp_path: Path
) -> None:
    local, objects = published
    cache = PieceCache(tmp_path / "cache", 40 * PIECE, objects, backoff_s=0.01, failure_ttl_s=0.0)
    try:
        ds = open_remote_dataset(objects, cache, "d")
        shard = ds.manifest.shards[1]
        key = f"d/{shard.name}"
        good = objects.get(key)
        bad = bytearray(good)
        bad[PIECE + 10] ^= 0x55  # piece 1 of shard 1, same size: only the digest can tell
        objects.put_bytes(key, bytes(bad))
        try:
            first = int(local._bounds_list[1])
            # tokens in shard 1's piece 1 (the file's bytes [PIECE, 2*PIECE))
            at = first + (PIECE + 10 - 64) // 2
            with pytest.raises(PieceUnreadable) as info:
                read_blocking(ds, lambda: ds.read(at, at + 4))
            message = str(info.value)
            assert objects.url(key) in message
            assert "the bucket copy itself is bad" in message
            assert "prepare" in message
            assert cache.stats()["checksum_mismatches"] == cache.mismatch_attempts
            assert not cache.resident(ds.pieces[ds._piece_base_list[1] + 1].digest)
            # other pieces of the same dataset are still served
            np.testing.assert_array_equal(
                read_blocking(ds, lambda: ds.read(0, 500)), local.read(0, 500)
            )
        finally:
            objects.put_bytes(key, good)
        # the bucket repaired (a re-run prepare): served again
        np.testing.assert_array_equal(
            read_blocking(ds, lambda: ds.read(at, at + 4)), local.read(at, at + 4)
        )
    finally:
        cache.close()


def test_temp_files_of_a_killed_server_are_removed_and_never_served(
    published: tuple[Dataset, ObjectStore], tmp_path: Path
) -> None:
    local, objects = published
    directory = tmp_path / "cache"
    cache = PieceCache(directory, 40 * PIECE, objects)
    ds = open_remote_dataset(objects, cache, "d")
    read_blocking(ds, lambda: ds.read(0, 3000))  # 6064 bytes: pieces 0 and 1 of shard 0
    cache.close()
    good, other = ds.pieces[0], ds.pieces[1]
    assert (directory / "pieces" / good.digest).is_file()
    # What a kill mid-fetch leaves: half a piece in tmp/ (never renamed). And a piece file
    # damaged on disk after its rename: hashed again before use, so never served either.
    (directory / "tmp" / f"{ds.pieces[2].digest}.dead.part").write_bytes(b"\0" * 100)
    (directory / "pieces" / other.digest).write_bytes(b"\0" * other.size)
    cache = PieceCache(directory, 40 * PIECE, objects)
    try:
        assert cache.removed_at_start == 1
        assert not any((directory / "tmp").iterdir())
        ds = open_remote_dataset(objects, cache, "d")
        got = read_blocking(ds, lambda: ds.read(0, 3000))
        np.testing.assert_array_equal(got, local.read(0, 3000))
        stats = cache.stats()
        assert stats["verified_local"] == 1  # the good piece, hashed, not fetched again
        assert stats["fetches"] == 1  # the damaged one came from the bucket again
    finally:
        cache.close()


def test_eviction_takes_unwanted_pieces_first(
    published: tuple[Dataset, ObjectStore], tmp_path: Path
) -> None:
    _, objects = published
    with _remote(tmp_path, objects, 4 * PIECE) as ds:
        cache = ds.cache
        p = [r for r in ds.pieces if r.size == PIECE][:8]
        a, b, c, d, e, f, g, h = p
        cache.want([a, b])
        for _ in range(500):
            if cache.resident(a.digest) and cache.resident(b.digest):
                break
            threading.Event().wait(0.01)
        assert cache.resident(a.digest) and cache.resident(b.digest)
        cache.fetch_all_blocking([c], timeout=30)
        cache.fetch_all_blocking([d], timeout=30)

        def here() -> set[PieceRef]:
            return {r for r in p if cache.resident(r.digest)}

        cache.fetch_all_blocking([e], timeout=30)  # evicts c: the oldest unwanted
        assert here() == {a, b, d, e}
        cache.fetch_all_blocking([f], timeout=30)
        assert here() == {a, b, e, f}
        cache.fetch_all_blocking([g, h], timeout=30)  # the wanted ones still stay
        assert here() == {a, b, g, h}
        cache.want([b])  # a is no longer wanted: it goes first now (least recent)
        cache.fetch_all_blocking([c], timeout=30)
        assert here() == {b, g, h, c}
        assert cache.stats()["prefetches"] == 2


def test_one_cache_directory_per_server(
    published: tuple[Dataset, ObjectStore], tmp_path: Path
) -> None:
    _, objects = published
    cache = _cache(tmp_path, objects, 4 * PIECE)
    try:
        with pytest.raises(StoreError, match="in use by another server"):
            _cache(tmp_path, objects, 4 * PIECE)
    finally:
        cache.close()


def test_a_version_1_dataset_is_refused_for_object_storage(
    published: tuple[Dataset, ObjectStore], tmp_path: Path
) -> None:
    _, objects = published
    objects.put_bytes("old/manifest.json", b'{"format_version": 1}')
    cache = _cache(tmp_path, objects, 4 * PIECE)
    try:
        with pytest.raises(StoreError, match="prepare"):
            open_remote_dataset(objects, cache, "old")
    finally:
        cache.close()
        objects.delete(["old/manifest.json"])


@pytest.mark.parametrize(
    ("text", "size"),
    [("123", 123), ("4KB", 4000), ("4 kib", 4096), ("1.5GiB", 3 << 29), ("2MB", 2_000_000)],
)
def test_cache_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "12XB", "-3", "1.5", "GiB"])
def test_bad_cache_sizes_say_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError, match=r"a size|whole"):
        parse_size(text)


class _Job:
    """What the prefetcher reads of a data-plane job (a real Feed over the dataset)."""

    def __init__(self, feed: Feed, position: int) -> None:
        self.feed = feed
        self.position = position
        self.last_active = time.monotonic()


def test_prefetch_fetches_the_next_blocks_within_its_share(
    published: tuple[Dataset, ObjectStore], tmp_path: Path
) -> None:
    local, objects = published
    capacity = 60 * PIECE
    with _remote(tmp_path, objects, capacity) as ds:
        cache = ds.cache
        plan = Plan(
            n_tokens=ds.n_tokens, seq_len=64, batch_size=4, shuffle="block",
            region_windows=100, block_regions=2,
        )  # fmt: skip
        job = _Job(Feed((Source("d", ds, plan),)), position=500)
        for _ in range(1000):  # a version-3 sidecar: the digests come first (off the loop)
            if ds.digests_ready():
                break
            time.sleep(0.01)
        ranges = wanted_ranges(ds, plan, job.position, capacity)
        expected: list[PieceRef] = []
        for start, stop in plan.block_spans(job.position, 2):
            first, end = ds.piece_range(start, stop)
            expected.extend(ds.pieces[first:end])
        assert {r.digest for _, a, b in ranges for r in ds.pieces[a:b]} == {
            r.digest for r in expected
        }
        want = {r.digest for r in expected}
        budget = int(capacity * 0.75)
        assert sum(r.size for r in expected) <= budget  # two blocks fit in the share
        Prefetcher(cache).update([job])
        for _ in range(1000):  # bounded wait for the fetchers
            if all(cache.resident(d) for d in want):
                break
            time.sleep(0.01)
        here = {r.digest for r in ds.pieces if cache.resident(r.digest)}
        assert here == want  # what the plan reads next, nothing else
        assert cache.stats()["prefetches"] == len(want)
        # the current block is served from the cache without waiting (no NotResident)
        for start, stop in plan.block_spans(job.position, 1):
            np.testing.assert_array_equal(ds.read(start, stop), local.read(start, stop))
        # the global shuffle wants the whole dataset only when it fits
        glob = Plan(n_tokens=ds.n_tokens, seq_len=64, batch_size=4)
        assert wanted_ranges(ds, glob, 0, capacity) == []
        assert wanted_ranges(ds, glob, 0, ds.nbytes) == [(ds, 0, len(ds.pieces))]
        assert wanted_ranges(local, plan, 0, capacity) == []  # a local dataset: nothing


def test_requests_within_rows_per_request_always_fit(
    published: tuple[Dataset, ObjectStore], tmp_path: Path
) -> None:
    """The rows bound a job's max_count should respect: any such request (rows anywhere,
    across pieces and shards) is admitted, never CacheTooSmall."""
    local, objects = published
    with _remote(tmp_path, objects, 24 * PIECE) as ds:
        cache = ds.cache
        rng = np.random.default_rng(3)
        for length in (1, 65, 2049, 3 * PIECE):
            rows = cache.rows_per_request(PIECE, length * 2)
            assert rows >= 1
            for _ in range(10):
                starts = rng.integers(0, local.n_tokens - length, size=rows)
                got = read_blocking(ds, lambda s=starts, n=length: ds.gather(s, n).copy())
                np.testing.assert_array_equal(got, local.gather(starts, length))
        assert cache.stats()["reserved_bytes"] <= 24 * PIECE


def test_range_bytes_is_the_sum_of_the_pieces_sizes(
    published: tuple[Dataset, ObjectStore], tmp_path: Path
) -> None:
    """What the prefetch budget counts: exact bytes of any piece range (short last
    pieces included), the whole range being the dataset's bytes."""
    _, objects = published
    with _remote(tmp_path, objects, 1 << 30) as ds:
        n = len(ds.pieces)
        sizes = [ds.pieces[g].size for g in range(n)]
        assert ds.range_bytes(0, n) == ds.nbytes == sum(sizes)
        rng = np.random.default_rng(5)
        for _ in range(200):
            a, b = sorted(int(x) for x in rng.integers(0, n + 1, size=2))
            assert ds.range_bytes(a, b) == sum(sizes[a:b]), (a, b)


def test_the_prefetch_takes_the_most_pieces_that_fit_in_its_room(
    published: tuple[Dataset, ObjectStore], tmp_path: Path
) -> None:
    _, objects = published
    with _remote(tmp_path, objects, 1 << 30) as ds:
        n = len(ds.pieces)
        rng = np.random.default_rng(6)
        for _ in range(200):
            first, top = sorted(int(x) for x in rng.integers(0, n + 1, size=2))
            room = int(rng.integers(0, ds.range_bytes(first, top) + PIECE + 1))
            want = max(h for h in range(first, top + 1) if ds.range_bytes(first, h) <= room)
            assert most_that_fit(ds, first, top, room) == want


def test_identical_pieces_read_together_leave_no_descriptor_open(
    s3: S3Server, tmp_path: Path
) -> None:
    """Pieces are content-addressed, so a run of equal tokens makes equal pieces: one
    request reading two of them opens the cache file once, and closing the cache closes
    every descriptor it opened."""
    store = tmp_path / "local"
    flat = [np.full(20 * PIECE, 7, dtype=np.int64)]  # one document: equal middle pieces
    write_dataset(store, "flat", flat, tokenizer=BYTE, shuffle_seed=0, piece_bytes=PIECE)
    objects = ObjectStore(S3Location(BUCKET, "flat-store"))
    publish_dataset(store / "flat", objects, "flat")
    before = len(os.listdir("/proc/self/fd"))
    with _remote(tmp_path, objects, 1 << 24, "flat") as ds:
        starts = np.array([3 * PIECE, 9 * PIECE, 15 * PIECE])  # rows in equal pieces
        got = read_blocking(ds, lambda d=ds: d.gather(starts, 100).copy())  # type: ignore[misc]
        assert (got == 7).all()
        # (the digests are read with the first request: a version-3 sidecar)
        assert len(set(ds.digests)) < len(ds.digests)  # some pieces are the same object
    # the mapped sidecar copy holds a descriptor while the dataset object lives
    del ds
    gc.collect()  # (which may also close what earlier tests left for the collector)
    assert len(os.listdir("/proc/self/fd")) <= before


def test_a_dataset_that_fits_in_the_cache_takes_requests_of_any_size(
    published: tuple[Dataset, ObjectStore], tmp_path: Path
) -> None:
    """No request can need more than all of a dataset's pieces: when they fit in the
    cache, the rows bound is lifted, and a request far over the per-row bound (rows
    anywhere, every shard) is admitted and exact."""
    local, objects = published
    nbytes = sum(s.file_size(local.dtype.itemsize) for s in local.manifest.shards)
    with _remote(tmp_path, objects, nbytes) as ds:
        cache = ds.cache
        assert cache.rows_per_request(PIECE, 4098, ds.nbytes) == UNLIMITED_ROWS
        assert ds.nbytes == nbytes
        assert cache.rows_per_request(PIECE, 4098, nbytes + 1) < UNLIMITED_ROWS  # too big
        bounded = cache.rows_per_request(PIECE, 4098)
        starts = np.random.default_rng(4).integers(0, local.n_tokens - 2049, size=4 * bounded)
        got = read_blocking(ds, lambda: ds.gather(starts, 2049).copy())
        np.testing.assert_array_equal(got, local.gather(starts, 2049))
        assert cache.stats()["reserved_bytes"] <= nbytes


class _FailOnce:
    """The bucket, with the first request for each piece failing (a dropped connection
    after the client's own retries)."""

    def __init__(self, objects: ObjectStore) -> None:
        self.objects = objects
        self.seen: set[tuple[str, int]] = set()

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        if (key, start) not in self.seen:
            self.seen.add((key, start))
            raise ObjectStoreError(f"{self.objects.url(key)}: connection reset (injected)")
        return self.objects.get_range(key, start, stop)


def test_transient_errors_are_retried_and_a_missing_object_is_reported(
    published: tuple[Dataset, ObjectStore], tmp_path: Path
) -> None:
    local, objects = published
    cache = PieceCache(tmp_path / "cache", 40 * PIECE, _FailOnce(objects), backoff_s=0.01)
    try:
        ds = open_remote_dataset(objects, cache, "d")
        got = read_blocking(ds, lambda: ds.read(100, 5000))
        np.testing.assert_array_equal(got, local.read(100, 5000))
        stats = cache.stats()
        assert stats["fetch_errors"] == stats["fetches"] >= 2 and stats["unreadable"] == 0
    finally:
        cache.close()
    # An object deleted from under a published manifest (gc by hand): reported, naming it.
    with _remote(tmp_path / "again", objects, 40 * PIECE) as ds:
        cache = ds.cache
        key = f"d/{ds.manifest.shards[-1].name}"
        data = objects.get(key)
        objects.delete([key])
        try:
            last = int(local._bounds_list[-2])
            with pytest.raises(PieceUnreadable) as info:
                read_blocking(ds, lambda: ds.read(last, last + 10))
            assert objects.url(key) in str(info.value)
            assert cache.stats()["fetch_errors"] == 1  # not retried: it stays missing
        finally:
            objects.put_bytes(key, data)


class _LocalFiles:
    """A piece source over a local directory of shard files (object key = file name)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        with open(self.root / key, "rb") as f:
            f.seek(start)
            return f.read(stop - start)


def _local_refs(local: Dataset) -> list[PieceRef]:
    refs = []
    for k, shard in enumerate(local.manifest.shards):
        size = shard.file_size(local.dtype.itemsize)
        for i, digest in enumerate(local.manifest.shard_pieces(k)):
            stop = min((i + 1) * PIECE, size)
            refs.append(PieceRef(digest, shard.name, i * PIECE, stop, f"file://{shard.name}"))
    return refs


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    capacity_pieces=st.integers(4, 16),
    ops=st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 10_000), min_size=1, max_size=4)),
        min_size=1,
        max_size=25,
    ),
)
def test_the_bound_holds_and_pieces_are_exact_under_any_reads_and_wants(
    published: tuple[Dataset, ObjectStore], capacity_pieces: int, ops: list[tuple[bool, list[int]]]
) -> None:
    """Any sequence of reads (admitted whole) and prefetch wants: never over the bound,
    every piece on disk is exactly its bytes, every read's pieces are all there."""
    local, _ = published
    refs = _local_refs(local)
    capacity = capacity_pieces * PIECE
    with tempfile.TemporaryDirectory() as tmp:
        cache = PieceCache(Path(tmp), capacity, _LocalFiles(local.path), fetchers=3)
        try:
            for is_want, picks in ops:
                chosen = [refs[p % len(refs)] for p in picks]
                if is_want:
                    cache.want(chosen)
                else:
                    cache.fetch_all_blocking(chosen, timeout=30)  # admitted whole, or hangs
                assert cache.stats()["reserved_bytes"] <= capacity
                assert cache.disk_bytes() <= capacity
        finally:
            cache.close()  # evicted files are unlinked in the background: all of them now
        for path in (Path(tmp) / "pieces").iterdir():
            assert piece_digest(path.read_bytes()) == path.name
