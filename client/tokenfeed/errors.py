"""The one exception tree of tokenfeed.

Every error a user can meet is a subclass of :class:`TokenFeedError`, and every message
says what went wrong *and what to do about it*. Foreign errors (zmq, msgpack, OS) are
mapped onto this tree at the boundary where they happen, never leaked raw::

    TokenFeedError
    ├── ConfigError              a setting or argument is invalid (also a ValueError)
    │   └── PlanError            the order math cannot serve these sizes
    ├── StoreError               the data store on disk
    │   ├── InvalidDatasetName   a name that could escape the store or is not portable
    │   ├── DatasetNotFound      no such dataset in the store
    │   ├── DatasetExists        prepare would overwrite a dataset (use --overwrite)
    │   ├── ManifestError        manifest.json missing, unreadable or inconsistent
    │   └── CorruptShard         a shard fails its header, size or checksum check
    ├── PrepareError             turning a corpus into a dataset failed
    │   ├── BadRecord            one input record is unusable (file and line named)
    │   └── StoreFull            the store ran out of space (which store, about how much)
    ├── ProtocolError            a frame that does not follow the wire protocol
    ├── ServerError              the server answered ERR (carries .code and .retry)
    │   ├── UnknownDataset       the server has no dataset of that name
    │   ├── RequestRejected      the request is invalid or exceeds a server limit
    │   ├── AuthenticationFailed wrong or missing token
    │   ├── DatasetForbidden     the token's tenant may not read that dataset
    │   ├── ConnectionLimit      the tenant or server has no free connection slot
    │   ├── DatasetChanged       the dataset behind a running job was replaced
    │   ├── StorageUnavailable   object storage does not answer: the trainer waits while
    │   │                        the server retries; final past its --storage-retry-s
    │   ├── ObjectMissing        an object the dataset needs is gone from the bucket
    │   └── ObjectDamaged        an object fails its checksum again after a refetch
    └── ServerUnavailable        no answer from the endpoint before the deadline

``ServerError.from_code`` maps a wire error code to the matching subclass, so the
client raises the precise type without a table of its own. A code without a subclass of
its own (``unknown_job``, ``overloaded``, or one a newer server sends) gives a plain
``ServerError`` that still carries that code: ``.code`` is always the code on the wire.
"""

from __future__ import annotations

import math
import re
from typing import ClassVar


class TokenFeedError(Exception):
    """Base of every error raised by tokenfeed."""


class ConfigError(TokenFeedError, ValueError):
    """A setting or argument is invalid."""


class PlanError(ConfigError):
    """The plan's sizes are degenerate or would overflow."""


class StoreError(TokenFeedError):
    """Something is wrong with the data store on disk."""


class InvalidDatasetName(StoreError, ValueError):
    """A dataset name that is empty, too long, or could escape the store directory."""


class DatasetNotFound(StoreError, KeyError):
    """The store has no dataset of that name."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DatasetExists(StoreError):
    """A dataset of that name exists and overwriting was not asked for."""


class ManifestError(StoreError):
    """manifest.json is missing, unreadable, or disagrees with the shards."""


class CorruptShard(StoreError):
    """A shard file fails its header, size or checksum check."""


class PrepareError(TokenFeedError):
    """The prepare pipeline could not build the dataset."""


class BadRecord(PrepareError):
    """One input record is unusable; the message names the file and line."""


class StoreFull(PrepareError):
    """The store's file system refused a write for lack of space (or quota, or file size)."""


class ProtocolError(TokenFeedError):
    """A message that does not follow the wire protocol (or carries an invalid value)."""


class ServerError(TokenFeedError):
    """The server answered with an ERR message; ``code`` is its wire error code."""

    #: the wire code of this class; an instance may carry another (see ``from_code``)
    code: str = "internal"
    _by_code: ClassVar[dict[str, type[ServerError]]] = {}

    def __init__(
        self, message: str, *, retry: bool = False, code: str | None = None, quiet: bool = False
    ) -> None:
        super().__init__(message)
        #: the server says asking again may succeed (the client keeps trying)
        self.retry = retry
        #: an expected refusal (a bad token, a full server): the server logs it at debug,
        #: not as a problem of its own; no effect on the client
        self.quiet = quiet
        if code is not None:
            self.code = code

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        ServerError._by_code[cls.code] = cls

    @staticmethod
    def from_code(
        code: str, message: str, *, retry: bool = False, quiet: bool = False
    ) -> ServerError:
        """The exception for a wire error code: its subclass, else ServerError with that code."""
        cls = ServerError._by_code.get(code, ServerError)
        return cls(message, retry=retry, code=code, quiet=quiet)


class UnknownDataset(ServerError):
    """The server has no dataset of that name."""

    code = "unknown_dataset"


class RequestRejected(ServerError):
    """The request is malformed or exceeds one of the server's limits."""

    code = "bad_request"


class AuthenticationFailed(ServerError):
    """The token is wrong or missing."""

    code = "auth_failed"


class DatasetForbidden(ServerError):
    """The tenant of this token may not read the dataset."""

    code = "forbidden"


class ConnectionLimit(ServerError):
    """The tenant, or the server as a whole, has no free connection slot."""

    code = "connection_limit"


class DatasetChanged(ServerError):
    """The dataset was replaced while a job was reading it; resuming would mix two datasets."""

    code = "dataset_changed"


class StorageUnavailable(ServerError):
    """The dataset's object storage does not answer; the server retries within its budget.

    While the server retries, it tells the waiting trainer so every few seconds with a
    retryable ``err`` worded by :meth:`retrying_message` (the request stays queued on the
    server): the client logs what it waits for and keeps waiting, without counting that
    time against its own ``deadline``, since the server's budget bounds it. Past the
    budget the request fails with ``retry`` False. An older client sees the notice as a
    plain retryable refusal: it asks again, and still waits out an outage shorter than its
    ``deadline``.
    """

    code = "storage_unavailable"

    @staticmethod
    def retrying_message(seconds_left: float, url: str, error: str) -> str:
        """The notice a waiting request gets while the server retries object ``url``."""
        left = max(0, math.ceil(seconds_left))
        return f"{_NOTICE_PREFIX} {left} s more: {url}: {error}"

    @staticmethod
    def seconds_left(message: str) -> float | None:
        """The seconds the server still retries, if ``message`` is such a notice (the
        request still waits on the server); None for any other message."""
        match = _NOTICE.match(message)
        return float(match.group(1)) if match is not None else None


#: The words of a storage notice: the one part of a message the client reads.
_NOTICE_PREFIX = "object storage unavailable, retrying for up to"
_NOTICE = re.compile(re.escape(_NOTICE_PREFIX) + r" (\d+) s more: ")


class ObjectMissing(ServerError):
    """An object the dataset's manifest names is missing from object storage."""

    code = "object_missing"


class ObjectDamaged(ServerError):
    """An object in object storage fails its checksum, also after a fresh fetch."""

    code = "object_damaged"


class ServerUnavailable(TokenFeedError):
    """The endpoint did not answer before the deadline."""
