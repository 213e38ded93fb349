"""The piece cache when object storage fails: an outage is a delay, never a lost request.

The source is an in-memory bucket that can be switched to failing (unreachable, or the
object missing); requests are parked the way the data plane parks them
(``acquire_locked`` raising ``NotResident``). While storage does not answer, a waiting
request carries the fault (object, last error, how long the fetch keeps trying) and its
dataset's health is ``degraded``; past the budget the request fails for good, naming the
object; nothing of a transient fault is remembered, so the next request fetches afresh;
a missing piece is remembered only briefly; ``close()`` answers every waiting request;
a prefetch nobody waits for gives up instead of holding a fetcher.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from tokenfeed.errors import ServerError, StorageUnavailable
from tokenfeed_server.store.cache import NotResident, PieceCache, PieceRef, Waiter
from tokenfeed_server.store.errors import (
    CacheClosed,
    ObjectNotFound,
    PieceMissing,
    StorageExhausted,
    StorageUnreachable,
    wire_error,
)
from tokenfeed_server.store.format import piece_digest
from waiting import wait_until

PIECE = 4096
KEY = "d/shard-0.bin"
URL = f"s3://bkt/store/{KEY}"


class Bucket:
    """One object of random bytes; ``fail`` (an exception) makes every GET raise it."""

    def __init__(self, pieces: int = 12) -> None:
        self.data = np.random.default_rng(0).bytes(pieces * PIECE)
        self.fail: Exception | None = None
        self.calls = 0
        self._lock = threading.Lock()

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        with self._lock:
            self.calls += 1
        if self.fail is not None:
            raise self.fail
        return self.data[start:stop]

    def refs(self) -> list[PieceRef]:
        out = []
        for start in range(0, len(self.data), PIECE):
            piece = self.data[start : start + PIECE]
            out.append(PieceRef(piece_digest(piece), KEY, start, start + len(piece), URL, "d"))
        return out


REFUSED = StorageUnreachable(f"{URL}: read failed: endpoint unreachable (connection refused)")


@pytest.fixture
def bucket() -> Bucket:
    return Bucket()


@pytest.fixture
def make_cache(tmp_path: Path, bucket: Bucket) -> Iterator[type[PieceCache]]:
    made: list[PieceCache] = []

    def make(**kw: object) -> PieceCache:
        kw.setdefault("backoff_s", 0.01)
        cache = PieceCache(tmp_path / f"cache{len(made)}", 64 * PIECE, bucket, **kw)  # type: ignore[arg-type]
        made.append(cache)
        return cache

    yield make  # type: ignore[misc]
    for cache in made:
        cache.close()


def park(cache: PieceCache, refs: Sequence[PieceRef]) -> Waiter:
    """What the data plane does with a request whose pieces are not here: its waiter."""
    with cache.lock:
        try:
            cache.acquire_locked([r.digest for r in refs], lambda: refs)
        except NotResident as exc:
            return exc.waiter
    raise AssertionError("the pieces were resident already")


def test_an_outage_is_a_delay_and_the_waiting_request_knows_why(
    make_cache: type[PieceCache], bucket: Bucket
) -> None:
    cache = make_cache(retry_s=60.0)
    refs = bucket.refs()[:3]
    bucket.fail = REFUSED
    waiter = park(cache, refs)
    fault = wait_until(lambda: cache.fault_of(waiter), 10, "a fault on the waiting request")
    assert fault.url == URL and "connection refused" in fault.error
    notice = fault.notice(fault.since)
    assert StorageUnavailable.seconds_left(notice) == pytest.approx(60, abs=1)
    assert URL in notice and "connection refused" in notice
    health = cache.health.of("d")
    assert health.state == "degraded" and "connection refused" in health.error
    assert cache.stats()["retrying"] >= 1 and cache.stats()["unreadable"] == 0
    assert not waiter.done
    bucket.fail = None  # storage answers again: the same fetches complete
    assert waiter.wait(10) and waiter.error is None
    assert cache.fault_of(waiter) is None and cache.health.of("d").state == "ok"
    assert cache.stats()["retrying"] == 0
    cache.release(waiter)
    assert all(cache.resident(r.digest) for r in refs)


def test_past_the_budget_it_fails_naming_the_object_and_remembers_nothing(
    make_cache: type[PieceCache], bucket: Bucket
) -> None:
    cache = make_cache(retry_s=0.3)
    refs = bucket.refs()[:2]
    bucket.fail = REFUSED
    waiter = park(cache, refs)
    assert waiter.wait(10)
    assert isinstance(waiter.error, StorageExhausted)
    assert URL in str(waiter.error) and "connection refused" in str(waiter.error)
    error = wire_error(waiter.error)
    assert isinstance(error, StorageUnavailable) and not error.retry
    health = cache.health.of("d")
    assert health.state == "unavailable" and URL in health.error
    cache.release(waiter)
    # Storage is back: the very next request fetches (no failure kept for failure_ttl_s).
    bucket.fail = None
    again = park(cache, refs)
    assert again.wait(10) and again.error is None
    assert cache.health.of("d").state == "ok"
    cache.release(again)


def test_a_missing_piece_is_remembered_briefly_then_fetched_again(
    make_cache: type[PieceCache], bucket: Bucket
) -> None:
    cache = make_cache(failure_ttl_s=0.5)
    refs = bucket.refs()[:1]
    bucket.fail = ObjectNotFound(f"{URL}: no such object")
    first = park(cache, refs)
    assert first.wait(10) and isinstance(first.error, PieceMissing)
    assert cache.health.of("d").objects == {URL: "missing"}
    calls = bucket.calls
    cache.release(first)
    soon = park(cache, refs)  # answered at once from memory: not fetched again
    assert soon.done and isinstance(soon.error, PieceMissing) and bucket.calls == calls
    cache.release(soon)
    bucket.fail = None  # restored in the bucket: served again within the memory's time
    later = wait_until(
        lambda: (w := park(cache, refs)).wait(10) and w.error is None and w,
        10,
        "the restored piece served",
        interval=0.1,
    )
    cache.release(later)
    assert cache.health.of("d").state == "ok"


def test_close_answers_every_waiting_request_retryably(
    make_cache: type[PieceCache], bucket: Bucket
) -> None:
    cache = make_cache(retry_s=600.0)
    bucket.fail = REFUSED
    waiters = [park(cache, bucket.refs()[i : i + 2]) for i in (0, 4)]
    wait_until(lambda: all(cache.fault_of(w) for w in waiters), 10, "faults on the requests")
    cache.close()
    for waiter in waiters:
        assert waiter.done and isinstance(waiter.error, CacheClosed)
        error = wire_error(waiter.error)
        assert type(error) is ServerError and error.retry
    assert {id(w) for w in cache.completed()} <= {id(w) for w in waiters}


def test_a_prefetch_nobody_waits_for_gives_up_and_is_not_remembered(
    make_cache: type[PieceCache], bucket: Bucket
) -> None:
    cache = make_cache(retry_s=600.0, fetchers=2)
    refs = bucket.refs()
    bucket.fail = REFUSED
    cache.want(refs)
    wait_until(lambda: bucket.calls >= 1, 10, "a prefetch GET")
    wait_until(lambda: cache.stats()["fetching"] == 0, 10, "the prefetches given up")
    stats = cache.stats()
    assert stats["unreadable"] == 0 and stats["retrying"] == 0
    assert bucket.calls <= 4  # not retried, and prefetching paused: the fetchers are free
    bucket.fail = None
    waiter = park(cache, refs[:2])  # a request is fetched at once
    assert waiter.wait(10) and waiter.error is None
    cache.release(waiter)


def test_a_request_that_goes_away_lets_its_fetch_give_up(
    make_cache: type[PieceCache], bucket: Bucket
) -> None:
    cache = make_cache(retry_s=600.0)
    bucket.fail = REFUSED
    waiter = park(cache, bucket.refs()[:2])
    wait_until(lambda: cache.fault_of(waiter), 10, "a fault on the request")
    cache.release(waiter)  # its trainer left: nobody waits for those pieces any more
    wait_until(lambda: cache.stats()["fetching"] == 0, 10, "the fetches given up")
    stats = cache.stats()
    assert stats["retrying"] == 0 and stats["unreadable"] == 0 and stats["reserved_bytes"] == 0
