"""Storage faults reach trainers as their own kinds: storage_unavailable (retryable),
object_missing, object_damaged; anything else about a dataset stays unknown_dataset."""

from __future__ import annotations

import pytest

from tokenfeed.errors import (
    CorruptShard,
    ObjectDamaged,
    ObjectMissing,
    ServerError,
    StorageUnavailable,
    StoreError,
    UnknownDataset,
)
from tokenfeed_server.store.errors import (
    BucketNotFound,
    DamagedShardObject,
    MissingShardObject,
    ObjectNotFound,
    ObjectStoreError,
    ObjectTruncated,
    PieceDamaged,
    PieceMissing,
    PieceUnavailable,
    PieceUnreadable,
    StorageExhausted,
    StorageUnreachable,
    wire_error,
)


@pytest.mark.parametrize(
    ("exc", "kind", "code", "retry"),
    [
        (
            StorageUnreachable("timed out"),
            StorageUnavailable,
            "storage_unavailable",
            True,
        ),
        (PieceUnavailable("3 attempts"), StorageUnavailable, "storage_unavailable", True),
        # past the server's budget: final (the server already waited for the trainer)
        (StorageExhausted("900 s"), StorageUnavailable, "storage_unavailable", False),
        (ObjectStoreError("access denied"), StorageUnavailable, "storage_unavailable", False),
        (BucketNotFound("no bucket"), StorageUnavailable, "storage_unavailable", False),
        (ObjectNotFound("s3://b/k: no such object"), ObjectMissing, "object_missing", False),
        (PieceMissing("s3://b/k"), ObjectMissing, "object_missing", False),
        (MissingShardObject("s3://b/d/shard"), ObjectMissing, "object_missing", False),
        (PieceDamaged("mismatch"), ObjectDamaged, "object_damaged", False),
        (ObjectTruncated("short"), ObjectDamaged, "object_damaged", False),
        (DamagedShardObject("size"), ObjectDamaged, "object_damaged", False),
        (CorruptShard("/store/d/shard: truncated"), UnknownDataset, "unknown_dataset", False),
        (StoreError("dataset 'd' is closed"), UnknownDataset, "unknown_dataset", False),
    ],
)
def test_each_store_fault_maps_to_its_wire_kind(
    exc: BaseException, kind: type[ServerError], code: str, retry: bool
) -> None:
    error = wire_error(exc)
    assert type(error) is kind
    assert (error.code, error.retry) == (code, retry)
    assert str(error) == str(exc)
    # the client turns the wire code back into the same class
    assert type(ServerError.from_code(code, "x")) is kind


def test_the_caller_may_word_the_message() -> None:
    error = wire_error(PieceMissing("s3://secret/path"), "dataset 'd' lost an object")
    assert str(error) == "dataset 'd' lost an object" and error.code == "object_missing"


def test_an_error_raised_from_a_storage_fault_is_that_fault() -> None:
    try:
        try:
            raise StorageUnreachable("s3://b/k: endpoint unreachable")
        except StorageUnreachable as cause:
            raise PieceUnreadable("cannot fetch a piece") from cause
    except PieceUnreadable as exc:
        error = wire_error(exc)
    assert error.code == "storage_unavailable" and error.retry


class _Source:
    """A piece source that fails with ``error`` (or serves ``data``), counting calls."""

    def __init__(self, error: Exception | None = None, data: bytes = b"") -> None:
        self.error, self.data, self.calls = error, data, 0

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return self.data


@pytest.mark.parametrize(
    ("error", "kind", "calls"),
    [
        (ObjectNotFound("gone"), PieceMissing, 1),  # a missing object is not retried
        # unreachable: retried for the budget (none here; tests/test_store_piece_fetch.py)
        (StorageUnreachable("timeout"), StorageExhausted, 1),
        (ObjectTruncated("short"), PieceDamaged, 3),
        (None, PieceDamaged, 2),  # bytes that never match the digest
    ],
)
def test_a_failed_fetch_says_which_fault(
    error: Exception | None, kind: type[PieceUnreadable], calls: int
) -> None:
    from tokenfeed_server.store.format import piece_digest
    from tokenfeed_server.store.piece_fetch import FetchHooks, RetryPolicy, fetch_piece
    from tokenfeed_server.store.pieces import PieceRef

    ref = PieceRef(piece_digest(b"good"), "k", 0, 4, "s3://b/k")
    source = _Source(error, b"bad!")
    counted: list[str] = []
    hooks = FetchHooks(lambda: counted.append("error"), lambda: counted.append("bad"))
    policy = RetryPolicy(attempts=3, mismatch_attempts=2, backoff_s=0.0, retry_s=0.0)
    with pytest.raises(kind):
        fetch_piece(source, ref, policy, hooks)
    assert source.calls == calls == len(counted)
    assert fetch_piece(_Source(data=b"good"), ref, policy, hooks) == (b"good", 4)
