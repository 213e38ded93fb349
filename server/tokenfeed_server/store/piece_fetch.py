"""One piece from object storage, verified against its digest, with retries.

Object storage fails in ordinary ways, and each is tried again its own way:

* **unreachable** (refused, reset, timed out, 5xx, throttled:
  :class:`~tokenfeed_server.store.errors.StorageUnreachable`, or a raw ``OSError``): tried
  again with capped exponential backoff and jitter until a time budget
  (:attr:`RetryPolicy.retry_s`, ``--storage-retry-s``) is spent, counted from the start of
  the first failed attempt; then :class:`~tokenfeed_server.store.errors.StorageExhausted`.
  An outage is a delay, not a failure: before each retry the cache is told
  (:attr:`FetchHooks.retrying`), so that the requests waiting for the piece hear why, and
  the fetch is dropped instead when nobody waits for it (a prefetch: it is wanted again
  once storage answers);
* **missing** (:class:`~tokenfeed_server.store.errors.ObjectNotFound`): not tried again,
  S3 is strongly consistent: it stays missing;
* **damaged** (bytes that do not match the manifest's digest): fetched again a few times
  (:attr:`RetryPolicy.mismatch_attempts`), then the bucket's copy itself is reported bad;
* anything else (refused credentials, a truncated object, a bug): a few attempts in all
  (:attr:`RetryPolicy.attempts`).

The exception raised says which of these it was (see :mod:`~tokenfeed_server.store.errors`).
Clock, sleep and jitter come from :class:`FetchHooks`, so the budget logic is unit-tested
without waiting.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenfeed_server.store.errors import (
    ObjectNotFound,
    ObjectTruncated,
    PieceDamaged,
    PieceMissing,
    PieceUnavailable,
    PieceUnreadable,
    StorageExhausted,
    StorageUnreachable,
)
from tokenfeed_server.store.format import piece_digest
from tokenfeed_server.store.pieces import PieceRef, PieceSource

__all__ = [
    "FetchAbandoned",
    "FetchHooks",
    "RetryPolicy",
    "fetch_piece",
    "is_transient",
    "last_error",
]

log = logging.getLogger(__name__)


class FetchAbandoned(PieceUnavailable):
    """The fetch gave up without a verdict on the piece: nobody waits for it while storage
    does not answer, or the server stops. Never remembered as a failure."""


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try (see the module docstring): GETs in all after an unexpected error,
    fetches of bytes failing their digest, the first backoff in seconds (doubled at each
    retry up to ``cap_s``), and the seconds unreachable storage is retried."""

    attempts: int = 3
    mismatch_attempts: int = 3
    backoff_s: float = 0.1
    retry_s: float = 900.0
    cap_s: float = 3.0

    def delay(self, failures: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after the ``failures``-th failure in a row: ``backoff_s *
        2**(failures - 1)`` capped at ``cap_s``; with ``rng``, drawn from ``[d / 2, d]``
        (equal jitter: fetchers failing together do not come back together)."""
        top = min(self.cap_s, self.backoff_s * 2.0 ** min(failures - 1, 64))
        return top if rng is None else rng.uniform(top / 2, top)


def _count() -> None:
    pass


def _retry(exc: Exception, since: float, left: float) -> bool:
    return True


def _never() -> bool:
    return False


def _sleep(seconds: float) -> bool:
    time.sleep(seconds)
    return True


@dataclass(frozen=True)
class FetchHooks:
    """What a fetch tells its cache, and the clock it runs on (injectable for tests)."""

    #: a GET failed (counted under the cache's lock)
    fetch_error: Callable[[], None] = _count
    #: bytes failed their digest
    mismatch: Callable[[], None] = _count
    #: unreachable storage, about to be retried: ``(error, when the fault began, seconds
    #: of budget left)``; False to give up now (nobody waits for the piece)
    retrying: Callable[[Exception, float, float], bool] = _retry
    #: True once the server stops
    stopping: Callable[[], bool] = _never
    clock: Callable[[], float] = time.monotonic
    #: wait this many seconds; False if woken because the server stops
    sleep: Callable[[float], bool] = _sleep
    rng: random.Random = field(default_factory=random.Random)


def last_error(ref: PieceRef, exc: BaseException) -> str:
    """``exc`` as the last error of a fetch of ``ref``, for a message that names the
    object already (the object store's own messages begin with its URL)."""
    return str(exc).removeprefix(f"{ref.url}: ")


def is_transient(exc: BaseException) -> bool:
    """True for a fault of the service or the network, worth trying again later."""
    return isinstance(exc, StorageUnreachable | OSError)


def fetch_piece(
    source: PieceSource, ref: PieceRef, policy: RetryPolicy, hooks: FetchHooks
) -> tuple[bytes, int]:
    """The bytes of ``ref``, verified, and the bytes fetched to get them (retries too).

    Raises :class:`PieceMissing`, :class:`PieceDamaged`, :class:`StorageExhausted`,
    :class:`FetchAbandoned` (or :class:`PieceUnreadable` from an unexpected error) once
    the policy gives up.
    """
    tries = _Tries(source, ref, policy, hooks)
    while True:
        data = tries.get()
        if data is None:
            continue  # failed, waited: again
        actual = piece_digest(data) if len(data) == ref.size else f"{len(data)} bytes"
        if actual == ref.digest:
            return data, tries.fetched
        tries.mismatched(actual)


class _Tries:
    """The attempts of one fetch: what failed so far, and whether to go on."""

    def __init__(
        self, source: PieceSource, ref: PieceRef, policy: RetryPolicy, hooks: FetchHooks
    ) -> None:
        self.source, self.ref, self.policy, self.hooks = source, ref, policy, hooks
        self.failures = self.mismatches = self.fetched = 0
        self.unreachable = 0  # transient failures in a row
        self.since: float | None = None  # when the first of them began

    def get(self) -> bytes | None:
        """One GET: its bytes, or None after a failure worth another try (waited out)."""
        ref, hooks = self.ref, self.hooks
        if hooks.stopping():
            raise FetchAbandoned(f"{ref.url}: the server is stopping")
        started = hooks.clock()
        try:
            data = self.source.get_range(ref.key, ref.start, ref.stop)
        except Exception as exc:
            hooks.fetch_error()
            if is_transient(exc):
                self._unreachable(exc, started)
            else:
                self._failed(exc)
            return None
        self.unreachable, self.since = 0, None  # storage answers
        self.fetched += len(data)
        return data

    def _unreachable(self, exc: Exception, started: float) -> None:
        """Wait before trying again, or raise once the budget is spent."""
        ref, policy, hooks = self.ref, self.policy, self.hooks
        self.since = started if self.since is None else self.since
        self.unreachable += 1
        waited = hooks.clock() - self.since
        left = policy.retry_s - waited
        if left <= 0:
            raise StorageExhausted(
                f"{ref.url}: object storage did not answer for {waited:.1f} s, the server's "
                f"retry budget (--storage-retry-s {policy.retry_s:g}); the last error: "
                f"{last_error(ref, exc)}"
            ) from exc
        if not hooks.retrying(exc, self.since, left):
            raise FetchAbandoned(f"{ref.url}: no request waits for it: {exc}") from exc
        self._pause(min(policy.delay(self.unreachable, hooks.rng), left))

    def _failed(self, exc: Exception) -> None:
        """An error that is neither a fault of the service nor a missing object."""
        self.failures += 1
        # A missing object stays missing (S3 is strongly consistent): no retry.
        if self.failures >= self.policy.attempts or isinstance(exc, ObjectNotFound):
            raise _fetch_failed(self.ref, self.failures, exc) from exc
        self._pause(self.policy.delay(self.failures, self.hooks.rng))

    def mismatched(self, actual: str) -> None:
        """Bytes that are not the piece: wait to fetch again, or report the bucket copy."""
        ref, policy = self.ref, self.policy
        self.mismatches += 1
        self.hooks.mismatch()
        log.warning(
            "%s bytes [%d, %d): got %s, the manifest says %s (fetch %d of %d)",
            ref.url, ref.start, ref.stop, actual, ref.digest, self.mismatches,
            policy.mismatch_attempts,
        )  # fmt: skip
        if self.mismatches >= policy.mismatch_attempts:
            raise PieceDamaged(
                f"{ref.url} bytes [{ref.start}, {ref.stop}) do not match the manifest "
                f"(blake2b-128 {actual} != {ref.digest}) in {self.mismatches} fetches: the "
                "bucket copy itself is bad; re-run tokenfeed-server prepare ... "
                "--overwrite into the bucket"
            )
        self._pause(policy.delay(self.mismatches, self.hooks.rng))

    def _pause(self, seconds: float) -> None:
        if not self.hooks.sleep(seconds):
            raise FetchAbandoned(f"{self.ref.url}: the server is stopping")


def _fetch_failed(ref: PieceRef, failures: int, exc: Exception) -> PieceUnreadable:
    """The error for a piece whose GETs failed, of the kind of the last failure."""
    kind: type[PieceUnreadable] = PieceUnreadable
    if isinstance(exc, ObjectNotFound):
        kind = PieceMissing
    elif isinstance(exc, ObjectTruncated):
        kind = PieceDamaged
    elif isinstance(exc, StorageUnreachable):
        kind = PieceUnavailable
    return kind(
        f"cannot fetch {ref.url} bytes [{ref.start}, {ref.stop}) after "
        f"{failures} attempts: {exc}; check the bucket and the credentials "
        "(the dataset may have been deleted: re-run prepare)"
    )
