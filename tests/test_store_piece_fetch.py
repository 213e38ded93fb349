"""One piece fetch against storage that fails in time: the retry budget, on a fake clock.

Unreachable storage is retried with capped exponential backoff and jitter until the
budget (``--storage-retry-s``) is spent, counted from the start of the first failed
attempt; the cache is told before each retry and may say nobody waits; a missing object
is not retried; a stopping server ends the wait at once. No real time passes: every GET
and every sleep moves a fake clock.
"""

from __future__ import annotations

import random

import pytest

from tokenfeed.errors import StorageUnavailable
from tokenfeed_server.store.errors import (
    ObjectNotFound,
    PieceMissing,
    StorageExhausted,
    StorageUnreachable,
    wire_error,
)
from tokenfeed_server.store.format import piece_digest
from tokenfeed_server.store.piece_fetch import (
    FetchAbandoned,
    FetchHooks,
    RetryPolicy,
    fetch_piece,
    is_transient,
)
from tokenfeed_server.store.pieces import PieceRef

DATA = b"the piece"
REF = PieceRef(piece_digest(DATA), "d/shard-1.bin", 0, len(DATA), "s3://bkt/store/d/shard-1.bin")


class Clock:
    """A fake monotonic clock; sleeping moves it (and is recorded)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> bool:
        self.slept.append(seconds)
        self.now += seconds
        return True


class Outage:
    """Storage that fails with ``error`` until the clock reaches ``until``; each GET takes
    ``get_s`` seconds of the clock (a refused connection is quick, a timeout is not)."""

    def __init__(
        self, clock: Clock, until: float, error: Exception | None = None, get_s: float = 0.01
    ) -> None:
        self.clock, self.until, self.get_s = clock, until, get_s
        self.error = error or StorageUnreachable(f"{REF.url}: read failed: connection refused")
        self.calls = 0

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        self.calls += 1
        self.clock.now += self.get_s
        if self.clock.now < self.until:
            raise self.error
        return DATA[start:stop]


def _hooks(clock: Clock, told: list[tuple[float, float]], *, waiting: bool = True) -> FetchHooks:
    def retrying(exc: Exception, since: float, left: float) -> bool:
        told.append((since, left))
        return waiting

    return FetchHooks(
        retrying=retrying, clock=lambda: clock.now, sleep=clock.sleep, rng=random.Random(7)
    )


def test_an_outage_shorter_than_the_budget_is_a_delay() -> None:
    clock, told = Clock(), []
    began = clock.now
    source = Outage(clock, until=began + 60.0)
    policy = RetryPolicy(backoff_s=0.1, cap_s=3.0, retry_s=900.0)
    assert fetch_piece(source, REF, policy, _hooks(clock, told)) == (DATA, len(DATA))
    assert 60.0 <= clock.now - began <= 60.0 + policy.cap_s + 0.1  # noticed within a backoff
    # every wait capped, with jitter: in [d/2, d] of the doubling schedule
    for n, slept in enumerate(clock.slept, start=1):
        top = min(policy.cap_s, policy.backoff_s * 2 ** (n - 1))
        assert top / 2 <= slept <= top
    assert max(clock.slept) > policy.cap_s / 2  # it did reach the cap
    # the cache was told before every retry: since the first failed attempt began
    assert len(told) == len(clock.slept) == source.calls - 1
    assert all(since == began for since, _ in told)
    lefts = [left for _, left in told]
    assert lefts == sorted(lefts, reverse=True) and lefts[0] <= 900.0


def test_past_the_budget_it_fails_naming_the_object_and_the_last_error() -> None:
    clock, told = Clock(), []
    began = clock.now
    source = Outage(clock, until=began + 10_000, get_s=0.5)
    policy = RetryPolicy(retry_s=5.0, cap_s=2.0)
    with pytest.raises(StorageExhausted) as info:
        fetch_piece(source, REF, policy, _hooks(clock, told))
    assert 5.0 <= clock.now - began <= 5.0 + source.get_s + 0.01  # no wait past the budget
    message = str(info.value)
    assert REF.url in message and "connection refused" in message
    assert "--storage-retry-s 5" in message
    error = wire_error(info.value)  # final: the server already waited for the trainer
    assert isinstance(error, StorageUnavailable) and not error.retry


def test_a_success_in_between_starts_the_budget_afresh() -> None:
    clock, told = Clock(), []

    class Flaky(Outage):
        """Down, up with bytes that fail their digest, down again, then whole."""

        def get_range(self, key: str, start: int, stop: int) -> bytes:
            self.calls += 1
            self.clock.now += 4.0
            return b"not it!!!" if self.calls == 3 else DATA if self.calls >= 6 else self.fail()

        def fail(self) -> bytes:
            raise self.error

    source = Flaky(clock, until=0)
    policy = RetryPolicy(retry_s=10.0, backoff_s=0.1, mismatch_attempts=3)
    assert fetch_piece(source, REF, policy, _hooks(clock, told))[0] == DATA
    sinces = sorted({since for since, _ in told})
    assert len(sinces) == 2  # two faults, each with a budget of its own


def test_a_missing_object_is_not_retried() -> None:
    clock, told = Clock(), []
    source = Outage(clock, until=1e9, error=ObjectNotFound(f"{REF.url}: no such object"))
    with pytest.raises(PieceMissing):
        fetch_piece(source, REF, RetryPolicy(), _hooks(clock, told))
    assert source.calls == 1 and not told and not clock.slept


def test_nobody_waiting_gives_up_and_a_stop_ends_the_wait() -> None:
    clock, told = Clock(), []
    source = Outage(clock, until=1e9)
    with pytest.raises(FetchAbandoned):
        fetch_piece(source, REF, RetryPolicy(), _hooks(clock, told, waiting=False))
    assert source.calls == 1 and len(told) == 1
    stopping = FetchHooks(clock=lambda: clock.now, sleep=lambda s: False)
    with pytest.raises(FetchAbandoned, match="stopping"):
        fetch_piece(Outage(clock, until=1e9), REF, RetryPolicy(), stopping)


def test_what_counts_as_transient() -> None:
    assert is_transient(StorageUnreachable("503 SlowDown"))
    assert is_transient(ConnectionResetError())
    assert not is_transient(ObjectNotFound("gone"))
    assert not is_transient(ValueError("a bug"))
