"""One piece from object storage, verified against its digest, with retries.

A failed GET (already retried by the object store's client for what it knows to be
transient) is tried again with exponential backoff; a missing object is not (S3 is
strongly consistent: it stays missing). Bytes that do not match the manifest's digest
are fetched again a few times, then the bucket's copy itself is reported bad. The
exception raised says which of these it was (see :mod:`~tokenfeed_server.store.errors`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenfeed_server.store.errors import (
    ObjectNotFound,
    ObjectTruncated,
    PieceDamaged,
    PieceMissing,
    PieceUnavailable,
    PieceUnreadable,
    StorageUnreachable,
)
from tokenfeed_server.store.format import piece_digest
from tokenfeed_server.store.pieces import PieceRef, PieceSource

__all__ = ["FetchCounters", "RetryPolicy", "fetch_piece"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try: GETs in all per piece, fetches of bytes that fail their digest,
    and the first backoff in seconds (doubled at each retry)."""

    attempts: int = 3
    mismatch_attempts: int = 3
    backoff_s: float = 0.1

    def delay(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failure."""
        return self.backoff_s * float(2 ** (failures - 1))


@dataclass(frozen=True)
class FetchCounters:
    """Callbacks the cache counts with (under its own lock)."""

    fetch_error: Callable[[], None]
    mismatch: Callable[[], None]


def fetch_piece(
    source: PieceSource,
    ref: PieceRef,
    policy: RetryPolicy,
    counters: FetchCounters,
    stopping: Callable[[], bool],
) -> tuple[bytes, int]:
    """The bytes of ``ref``, verified, and the bytes fetched to get them (retries too).

    Raises :class:`PieceMissing`, :class:`PieceDamaged`, :class:`PieceUnavailable` (or
    :class:`PieceUnreadable` from an unexpected error) once the policy gives up.
    """
    mismatches = failures = fetched = 0
    while True:
        if stopping():
            raise PieceUnavailable(f"{ref.url}: the server is stopping")
        try:
            data = source.get_range(ref.key, ref.start, ref.stop)
        except Exception as exc:
            failures += 1
            counters.fetch_error()
            # A missing object stays missing (S3 is strongly consistent): no retry.
            if failures >= policy.attempts or isinstance(exc, ObjectNotFound):
                raise _fetch_failed(ref, failures, exc) from exc
            time.sleep(policy.delay(failures))
            continue
        fetched += len(data)
        actual = piece_digest(data) if len(data) == ref.size else f"{len(data)} bytes"
        if actual == ref.digest:
            return data, fetched
        mismatches += 1
        counters.mismatch()
        log.warning(
            "%s bytes [%d, %d): got %s, the manifest says %s (fetch %d of %d)",
            ref.url, ref.start, ref.stop, actual, ref.digest, mismatches,
            policy.mismatch_attempts,
        )  # fmt: skip
        if mismatches >= policy.mismatch_attempts:
            raise PieceDamaged(
                f"{ref.url} bytes [{ref.start}, {ref.stop}) do not match the manifest "
                f"(blake2b-128 {actual} != {ref.digest}) in {mismatches} fetches: the "
                "bucket copy itself is bad; re-run tokenfeed-server prepare ... "
                "--overwrite into the bucket"
            )
        time.sleep(policy.delay(mismatches))


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
