"""The store's own exceptions, and the one place they become errors a trainer sees.

Object storage fails in three ways a trainer should tell apart (issue 21): the service
does not answer (:class:`StorageUnreachable`, retryable), an object the dataset needs is
gone (:class:`ObjectNotFound`), an object's bytes are not what the manifest says
(:class:`ObjectTruncated`, and a piece that fails its digest after refetches:
:class:`PieceDamaged`). :func:`wire_error` maps each onto its
:class:`~tokenfeed.errors.ServerError` subclass (wire codes ``storage_unavailable``,
``object_missing``, ``object_damaged``); anything else about a dataset stays
``unknown_dataset``, as before. The data plane calls it where a store exception becomes
an ``err`` frame, so the mapping lives here, next to the exceptions, and only here.

Unreachable storage is retried by the piece cache for a budget (``--storage-retry-s``);
only once it is spent does a request fail, with :class:`StorageExhausted`, which is not
retryable (the server already waited for the trainer). A stopping server
(:class:`CacheClosed`) and a server out of file descriptors
(:class:`CacheOutOfDescriptors`) are the server's faults, retryable, never the dataset's.
"""

from __future__ import annotations

from tokenfeed.errors import (
    CorruptShard,
    ObjectDamaged,
    ObjectMissing,
    ServerError,
    StorageUnavailable,
    StoreError,
    UnknownDataset,
)

__all__ = [
    "BucketNotFound",
    "CacheClosed",
    "CacheDiskFull",
    "CacheOutOfDescriptors",
    "CacheTooSmall",
    "DamagedShardObject",
    "MissingShardObject",
    "ObjectNotFound",
    "ObjectStoreError",
    "ObjectTruncated",
    "PieceDamaged",
    "PieceMissing",
    "PieceUnavailable",
    "PieceUnreadable",
    "StorageExhausted",
    "StorageUnreachable",
    "wire_error",
]


class ObjectStoreError(StoreError):
    """Object storage refused or failed a request (after retries); the message says which
    object and what to do."""


class StorageUnreachable(ObjectStoreError):
    """The endpoint did not answer, or kept failing, after the client's retries (a
    network fault, a timeout, throttling, a 5xx): worth trying again later."""


class ObjectNotFound(ObjectStoreError):
    """The object (or its bucket) does not exist."""


class BucketNotFound(ObjectNotFound):
    """The bucket does not exist."""


class ObjectTruncated(ObjectStoreError):
    """An object is shorter than its manifest says (replaced or truncated in the bucket)."""


class MissingShardObject(CorruptShard):
    """Opening a remote dataset: a shard object its manifest lists is not in the bucket."""


class DamagedShardObject(CorruptShard):
    """Opening a remote dataset: a shard object's size disagrees with its manifest."""


class PieceUnreadable(StoreError):
    """A piece could not be fetched intact (its object is missing, or the bucket's copy
    does not match the manifest) after the retries."""


class PieceMissing(PieceUnreadable):
    """The piece's object is gone from the bucket."""


class PieceDamaged(PieceUnreadable):
    """The bucket's copy of the piece fails its digest in every fetch."""


class PieceUnavailable(PieceUnreadable):
    """Object storage did not deliver the piece (the fetch gave up, or the server stops)."""


class StorageExhausted(PieceUnavailable):
    """Object storage stayed unreachable for the whole retry budget (``--storage-retry-s``):
    the request fails for good; the message names the object and the last error."""


class CacheTooSmall(StoreError):
    """One request needs more pieces at once than the whole cache holds."""


class CacheClosed(StoreError):
    """The server is stopping: a request waiting for pieces is answered so (retryable: the
    trainer reconnects, to this server restarted or to another replica)."""


class CacheOutOfDescriptors(StoreError):
    """The server has no file descriptor left to open a cached piece (EMFILE, ENFILE):
    the operator raises the limit or lowers ``--cache-max-open``; retryable."""


class CacheDiskFull(PieceUnreadable):
    """The disk under the cache refused a piece for lack of space (ENOSPC, EDQUOT); the
    cache shrinks and tries again before anyone sees this."""


# Most specific first: BucketNotFound is an ObjectNotFound, but a missing bucket is the
# service's fault as the trainer sees it, not one missing object.
_KINDS: tuple[tuple[type[BaseException], type[ServerError], bool], ...] = (
    (PieceMissing, ObjectMissing, False),
    (MissingShardObject, ObjectMissing, False),
    (BucketNotFound, StorageUnavailable, False),
    (ObjectNotFound, ObjectMissing, False),
    (CacheDiskFull, ServerError, True),  # not the piece's fault (a PieceUnreadable)
    (PieceDamaged, ObjectDamaged, False),
    (DamagedShardObject, ObjectDamaged, False),
    (ObjectTruncated, ObjectDamaged, False),
    (StorageExhausted, StorageUnavailable, False),  # the server waited its whole budget
    (PieceUnavailable, StorageUnavailable, True),
    (StorageUnreachable, StorageUnavailable, True),
    # refused credentials, access denied: the operator must act, a retry will not help
    (ObjectStoreError, StorageUnavailable, False),
    # the server's own faults: asking again (here, or at another replica) may succeed
    (CacheClosed, ServerError, True),
    (CacheOutOfDescriptors, ServerError, True),
)


def wire_error(exc: BaseException, message: str | None = None) -> ServerError:
    """The :class:`~tokenfeed.errors.ServerError` a trainer gets for store exception
    ``exc``: :class:`~tokenfeed.errors.StorageUnavailable` (``retry`` True when the
    service may answer later), :class:`~tokenfeed.errors.ObjectMissing` or
    :class:`~tokenfeed.errors.ObjectDamaged` for faults of object storage, a retryable
    :class:`~tokenfeed.errors.ServerError` for the server's own (stopping, out of file
    descriptors, a full cache disk), else :class:`~tokenfeed.errors.UnknownDataset` (a
    damaged local dataset, a bug).

    ``message`` replaces ``str(exc)`` (the caller may not want to show the store's path);
    ``.code`` and ``.retry`` of the result are what goes on the wire.
    """
    text = str(exc) if message is None else message
    # An error raised ``from`` a storage fault (a piece unreadable because its GET was
    # refused) is that fault: the chain of causes is looked through, nearest first.
    seen: BaseException | None = exc
    while seen is not None:
        for kind, error, retry in _KINDS:
            if isinstance(seen, kind):
                return error(text, retry=retry)
        seen = seen.__cause__
    return UnknownDataset(text)
