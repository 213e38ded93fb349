"""Object storage: store URLs, and the one client through which tokenfeed talks S3.

A store is a local directory or ``s3://BUCKET/PREFIX`` (:func:`parse_store`). S3 is
spoken with boto3, and this module is the one place that touches it: every botocore or
boto3 exception becomes an :class:`ObjectStoreError` (a
:class:`~tokenfeed.errors.StoreError`) whose message names the object's URL and says what
to do; nothing else in tokenfeed catches a botocore type.

Credentials, region and endpoint come from the standard AWS chain: ``AWS_ENDPOINT_URL``
(or ``AWS_ENDPOINT_URL_S3``) for MinIO, Ceph, R2 or a test server, ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, ``~/.aws/config`` and
``~/.aws/credentials``, SSO, ``credential_process``, instance and container roles.
Transient errors (throttling, 5xx, resets, timeouts) are retried with botocore's
*standard* retry mode (exponential backoff with jitter), 5 attempts unless
``AWS_MAX_ATTEMPTS`` / ``AWS_RETRY_MODE`` say otherwise.
"""

from __future__ import annotations

import builtins
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenfeed.errors import ConfigError, TokenFeedError
from tokenfeed_server.store.errors import (
    BucketNotFound,
    ObjectNotFound,
    ObjectStoreError,
    ObjectTruncated,
    StorageUnreachable,
)

__all__ = [
    "MULTIPART_CHUNKSIZE",
    "MULTIPART_THRESHOLD",
    "BucketNotFound",
    "ConditionalWritesUnsupported",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "ObjectStoreError",
    "ObjectTruncated",
    "PreconditionFailed",
    "S3Location",
    "StorageUnreachable",
    "is_remote",
    "parse_store",
]

_BUCKET_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{2,62}")
_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_DEFAULT_ATTEMPTS = 5
_DELETE_BATCH = 1000  # DeleteObjects takes at most 1000 keys
#: Uploads of at least this many bytes go in parts of :data:`MULTIPART_CHUNKSIZE` (boto3's
#: transfer settings, fixed here: an object's ETag depends on them, and publish predicts it
#: to tell an intact object from a damaged one, see :meth:`ObjectStore.part_size`).
MULTIPART_THRESHOLD = 64 << 20
MULTIPART_CHUNKSIZE = 16 << 20


class PreconditionFailed(ObjectStoreError):
    """A conditional write lost: the object changed (If-Match) or exists (If-None-Match)
    since it was read. Nothing was written."""


class ConditionalWritesUnsupported(ObjectStoreError):
    """The service does not implement If-Match / If-None-Match on writes (501
    NotImplemented): the caller writes unconditionally, knowing a race is possible."""


@dataclass(frozen=True)
class S3Location:
    """``s3://bucket/prefix``: a bucket and a key prefix without leading or trailing ``/``
    (``""``: the whole bucket)."""

    bucket: str
    prefix: str = ""

    def key(self, relative: str) -> str:
        """The full object key of ``relative`` (a key relative to the prefix)."""
        if not relative:
            return self.prefix
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def url(self, relative: str = "") -> str:
        """``s3://bucket/prefix/relative``."""
        key = self.key(relative)
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"

    def child(self, name: str) -> S3Location:
        """The location ``name`` below this one."""
        return S3Location(self.bucket, self.key(name))

    def split(self) -> tuple[S3Location, str]:
        """``s3://b/p/NAME`` -> (``s3://b/p``, ``NAME``) (ConfigError for a bare bucket)."""
        if not self.prefix:
            raise ConfigError(
                f"{self.url()} names a bucket, not a dataset: give s3://BUCKET/PREFIX/NAME"
            )
        parent, _, name = self.prefix.rpartition("/")
        return S3Location(self.bucket, parent), name

    def __str__(self) -> str:
        return self.url()


def is_remote(store: Path | S3Location) -> bool:
    """True for a store in object storage."""
    return isinstance(store, S3Location)


def parse_store(text: str | os.PathLike[str]) -> Path | S3Location:
    """A local path, or an :class:`S3Location` for ``s3://bucket[/prefix]``.

    Raises ConfigError for a URL that names no bucket (``s3://``, ``s3:///x``), an empty
    or relative path segment, an unsupported scheme (``gs://``, ``http://``: point an
    S3-compatible endpoint at ``AWS_ENDPOINT_URL`` instead), and ``s3:/bucket``, which is
    what a ``Path`` makes of ``s3://bucket``.
    """
    raw = os.fspath(text)
    match = _SCHEME_RE.match(raw)
    if match is None:
        if raw.lower().startswith("s3:/"):
            raise ConfigError(
                f"store {raw!r} looks like a mangled S3 URL (a path collapses '//'); "
                "write s3://BUCKET/PREFIX"
            )
        return Path(raw)
    scheme = match.group(1).lower()
    if scheme != "s3":
        raise ConfigError(
            f"store {raw!r}: the {scheme}:// scheme is not supported; use a local path or "
            "s3://BUCKET/PREFIX (for another S3-compatible service set AWS_ENDPOINT_URL)"
        )
    rest = raw[match.end() :]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ConfigError(f"store {raw!r} names no bucket: write s3://BUCKET/PREFIX")
    if not _BUCKET_RE.fullmatch(bucket):
        raise ConfigError(
            f"store {raw!r}: {bucket!r} is not a valid bucket name (3-63 characters of "
            "letters, digits, '.', '_' or '-')"
        )
    prefix = prefix.strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ConfigError(
            f"store {raw!r}: the prefix has an empty, '.' or '..' segment; write s3://BUCKET/a/b"
        )
    return S3Location(bucket, prefix)


@dataclass(frozen=True)
class ObjectInfo:
    """One object: its key relative to the store's prefix, size, ETag and last change."""

    key: str
    size: int
    etag: str
    modified: datetime


class ObjectStore:
    """An S3 bucket prefix; keys given to and returned by every method are relative to it.

    Thread-safe (one boto3 client, which botocore makes safe to share between threads).

    Args:
        location: the bucket and prefix.
        max_attempts: attempts per request, retries included (default: AWS_MAX_ATTEMPTS,
            else 5).
        max_pool_connections: HTTP connections kept to the endpoint.
        connect_timeout, read_timeout: seconds, per attempt.
    """

    def __init__(
        self,
        location: S3Location,
        *,
        max_attempts: int | None = None,
        max_pool_connections: int = 32,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        multipart_threshold: int = MULTIPART_THRESHOLD,
        multipart_chunksize: int = MULTIPART_CHUNKSIZE,
    ) -> None:
        self.location = location
        try:
            import boto3
            import boto3.s3.transfer
            from botocore.config import Config
        except ImportError as exc:  # pragma: no cover - boto3 is a dependency
            raise ConfigError(
                f"{location.url()}: object storage needs boto3: pip install boto3"
            ) from exc
        retries: dict[str, Any] = {"mode": os.environ.get("AWS_RETRY_MODE") or "standard"}
        if max_attempts is not None:
            retries["max_attempts"] = max_attempts
        elif not os.environ.get("AWS_MAX_ATTEMPTS"):
            retries["max_attempts"] = _DEFAULT_ATTEMPTS
        config = Config(
            retries=retries,
            max_pool_connections=max_pool_connections,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            user_agent_extra="tokenfeed",
        )
        try:
            self._client: Any = boto3.session.Session().client("s3", config=config)
        except Exception as exc:  # botocore: a bad profile, region or endpoint in config
            raise self._error(exc, "connecting", "") from exc
        self._transfer = boto3.s3.transfer.TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=8,
        )

    def part_size(self, size: int) -> int | None:
        """The part size :meth:`put_file` uploads a file of ``size`` bytes in, None for one
        PUT: what an S3 ETag (MD5 of the parts' MD5s, ``-N``) of the upload is made of."""
        from s3transfer.utils import ChunksizeAdjuster

        if size < self._transfer.multipart_threshold:
            return None
        return int(ChunksizeAdjuster().adjust_chunksize(self._transfer.multipart_chunksize, size))

    @property
    def endpoint(self) -> str:
        """The endpoint URL the client talks to."""
        return str(self._client.meta.endpoint_url)

    def url(self, key: str = "") -> str:
        """``s3://bucket/prefix/key``."""
        return self.location.url(key)

    # -- reads ---------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """The whole object ``key`` (ObjectNotFound if there is none)."""
        try:
            resp = self._client.get_object(Bucket=self.location.bucket, Key=self.location.key(key))
            return bytes(resp["Body"].read())
        except Exception as exc:
            raise self._error(exc, "read", key) from exc

    def get_if_changed(self, key: str, etag: str | None) -> tuple[bytes, str] | None:
        """Object ``key`` and its ETag, or None when its ETag is still ``etag``
        (If-None-Match: one request, no body, when nothing changed). ObjectNotFound if
        there is no such object."""
        args: dict[str, Any] = {"Bucket": self.location.bucket, "Key": self.location.key(key)}
        if etag:
            args["IfNoneMatch"] = f'"{etag}"'
        try:
            resp = self._client.get_object(**args)
            return bytes(resp["Body"].read()), str(resp.get("ETag", "")).strip('"')
        except Exception as exc:
            if etag and _status(exc)[1] == 304:
                return None
            raise self._error(exc, "read", key) from exc

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of object ``key``; ObjectStoreError if fewer come back
        (the object is shorter than the manifest says: it was replaced or truncated)."""
        if stop <= start:
            return b""
        try:
            resp = self._client.get_object(
                Bucket=self.location.bucket,
                Key=self.location.key(key),
                Range=f"bytes={start}-{stop - 1}",
            )
            # read() is one allocation of the whole body (http.client reads into it);
            # bytes() of a bytes is that same object, no copy: it only pins the type
            data = bytes(resp["Body"].read())
        except Exception as exc:
            raise self._error(exc, "read", key) from exc
        if len(data) != stop - start:
            raise ObjectTruncated(
                f"{self.url(key)}: asked for bytes [{start}, {stop}), got {len(data)} bytes; "
                "the object is shorter than its manifest says: rebuild the dataset with "
                "tokenfeed-server prepare ... --overwrite"
            )
        return data

    def get_to_file(self, key: str, path: Path) -> None:
        """Download object ``key`` into ``path`` (ranged and parallel for big objects)."""
        try:
            self._client.download_file(
                self.location.bucket, self.location.key(key), str(path), Config=self._transfer
            )
        except Exception as exc:
            raise self._error(exc, "download", key) from exc

    def head(self, key: str) -> ObjectInfo | None:
        """The object's size, ETag and time, or None if there is no such object."""
        try:
            resp = self._client.head_object(Bucket=self.location.bucket, Key=self.location.key(key))
        except Exception as exc:
            error = self._error(exc, "lookup", key)
            if isinstance(error, ObjectNotFound) and not isinstance(error, BucketNotFound):
                return None
            raise error from exc
        return ObjectInfo(
            key=key,
            size=int(resp["ContentLength"]),
            etag=str(resp.get("ETag", "")).strip('"'),
            modified=resp["LastModified"],
        )

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose relative key starts with ``prefix``, in key order."""
        full = self.location.key(prefix) if prefix else self.location.key("")
        if self.location.prefix and not prefix:
            full += "/"  # the prefix is a directory: not "data2/..." for "data"
        strip = len(self.location.prefix) + 1 if self.location.prefix else 0
        try:
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.location.bucket, Prefix=full):
                for obj in page.get("Contents", ()):
                    yield ObjectInfo(
                        key=str(obj["Key"])[strip:],
                        size=int(obj["Size"]),
                        etag=str(obj.get("ETag", "")).strip('"'),
                        modified=obj["LastModified"],
                    )
        except Exception as exc:
            raise self._error(exc, "listing", prefix) from exc

    def check_bucket(self) -> None:
        """Fail early, with the clearest message, when the bucket is missing or refused."""
        try:
            self._client.head_bucket(Bucket=self.location.bucket)
        except Exception as exc:
            raise self._error(exc, "bucket check", "", bucket_call=True) from exc

    def check_readable(self) -> None:
        """Fail early when the store cannot be read: a listing of one key under the prefix.

        What ``serve`` checks: it needs no write permission (HeadBucket would also need
        s3:ListBucket on the whole bucket, where a policy may grant it per prefix only).
        """
        full = self.location.key("")
        try:
            self._client.list_objects_v2(
                Bucket=self.location.bucket, Prefix=f"{full}/" if full else "", MaxKeys=1
            )
        except Exception as exc:
            raise self._error(exc, "read check", "", bucket_call=True) from exc

    # -- writes --------------------------------------------------------------------------

    def put_bytes(
        self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False
    ) -> str:
        """Write object ``key`` (replacing any; S3 makes the new version visible whole);
        return its new ETag.

        ``if_match``: only if the object's ETag is still this; ``if_none_match``: only if
        there is no such object. A write that loses raises :class:`PreconditionFailed`
        (nothing written); a service without conditional writes
        :class:`ConditionalWritesUnsupported`.
        """
        args: dict[str, Any] = {
            "Bucket": self.location.bucket,
            "Key": self.location.key(key),
            "Body": data,
        }
        if if_match is not None:
            args["IfMatch"] = f'"{if_match}"'
        if if_none_match:
            args["IfNoneMatch"] = "*"
        try:
            resp = self._client.put_object(**args)
        except Exception as exc:
            code, status = _status(exc)
            conditional = if_match is not None or if_none_match
            if conditional and (status == 412 or code in _CONFLICT_CODES):
                raise PreconditionFailed(
                    f"{self.url(key)}: conditional write lost ({code or status}): the "
                    "object changed since it was read"
                ) from exc
            if conditional and (status == 501 or code == "NotImplemented"):
                raise ConditionalWritesUnsupported(
                    f"{self.url(key)}: the service at {self.endpoint} does not support "
                    f"conditional writes ({code or status})"
                ) from exc
            raise self._error(exc, "write", key) from exc
        return str(resp.get("ETag", "")).strip('"')

    def put_file(self, key: str, path: Path) -> None:
        """Upload ``path`` as object ``key`` (multipart, in parallel, for big files)."""
        try:
            self._client.upload_file(
                str(path), self.location.bucket, self.location.key(key), Config=self._transfer
            )
        except Exception as exc:
            raise self._error(exc, "upload", key) from exc

    def touch(self, key: str) -> bool:
        """Renew object ``key``'s last-modified time (a copy onto itself: same bytes).

        Returns False if it does not exist. A publish that reuses an existing object
        touches it, so that ``gc``'s grace period protects it as a fresh upload.
        """
        try:
            self._client.copy_object(
                Bucket=self.location.bucket,
                Key=self.location.key(key),
                CopySource={"Bucket": self.location.bucket, "Key": self.location.key(key)},
                MetadataDirective="REPLACE",
            )
        except Exception as exc:
            error = self._error(exc, "refresh", key)
            if isinstance(error, ObjectNotFound) and not isinstance(error, BucketNotFound):
                return False
            raise error from exc
        return True

    def delete(self, keys: Iterable[str]) -> None:
        """Delete the objects ``keys`` (absent ones are no error), 1000 per request."""
        batch: builtins.list[str] = []
        for key in keys:
            batch.append(key)
            if len(batch) == _DELETE_BATCH:
                self._delete_batch(batch)
                batch = []
        if batch:
            self._delete_batch(batch)

    def _delete_batch(self, keys: Sequence[str]) -> None:
        try:
            resp = self._client.delete_objects(
                Bucket=self.location.bucket,
                Delete={"Objects": [{"Key": self.location.key(k)} for k in keys], "Quiet": True},
            )
        except Exception as exc:
            raise self._error(exc, "delete", keys[0]) from exc
        errors = resp.get("Errors") or []
        if errors:
            first = errors[0]
            raise ObjectStoreError(
                f"s3://{self.location.bucket}/{first.get('Key')}: delete refused "
                f"({first.get('Code')}: {first.get('Message')}); {len(errors)} of {len(keys)} "
                "objects not deleted: check that the credentials may s3:DeleteObject"
            )

    # -- the one mapping of botocore errors ----------------------------------------------

    def _error(
        self, exc: BaseException, verb: str, key: str, *, bucket_call: bool = False
    ) -> TokenFeedError:
        """``exc`` (anything boto3 raised) as a tokenfeed error naming the object."""
        from boto3.exceptions import S3UploadFailedError
        from botocore import exceptions as bx

        if isinstance(exc, TokenFeedError):
            return exc
        url = f"s3://{self.location.bucket}" if bucket_call else self.location.url(key)
        if isinstance(exc, S3UploadFailedError) and isinstance(exc.__cause__, Exception):
            exc = exc.__cause__  # the ClientError that failed the transfer
        try:
            endpoint = self.endpoint
        except AttributeError:  # no client yet
            endpoint = os.environ.get("AWS_ENDPOINT_URL", "the default AWS endpoint")
        known = _credentials_error(exc, url)
        if known is not None:
            return known
        if isinstance(
            exc,
            bx.EndpointConnectionError
            | bx.ConnectTimeoutError
            | bx.ReadTimeoutError
            | bx.ConnectionClosedError,
        ):
            return StorageUnreachable(
                f"{url}: {verb} failed: endpoint {endpoint} unreachable after retries "
                f"({exc}); check AWS_ENDPOINT_URL, the network, or the service's status"
            )
        if isinstance(exc, bx.ClientError):
            return self._client_error(exc, url, verb, endpoint, bucket_call)
        if isinstance(exc, bx.NoRegionError):
            return ObjectStoreError(f"{url}: no AWS region configured; set AWS_DEFAULT_REGION")
        if isinstance(exc, bx.BotoCoreError | OSError):
            # a transport fault below botocore's own classes (a reset, a broken stream)
            return StorageUnreachable(f"{url}: {verb} failed: {type(exc).__name__}: {exc}")
        if isinstance(exc, ValueError):  # botocore refuses e.g. a malformed endpoint URL
            return ConfigError(f"{url}: {exc}; check AWS_ENDPOINT_URL and ~/.aws/config")
        return ObjectStoreError(f"{url}: {verb} failed: {type(exc).__name__}: {exc}")

    def _client_error(
        self, exc: Any, url: str, verb: str, endpoint: str, bucket_call: bool
    ) -> ObjectStoreError:
        """A botocore ``ClientError`` (the service answered, refusing) as a tokenfeed error."""
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
        message = err.get("Message") or code
        if code == "NoSuchBucket" or (bucket_call and status == 404):
            return BucketNotFound(
                f"{url}: bucket {self.location.bucket!r} does not exist at {endpoint}; "
                "create it, or fix the store URL / AWS_ENDPOINT_URL"
            )
        if code in ("NoSuchKey", "404", "NotFound") or status == 404:
            return ObjectNotFound(f"{url}: no such object")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"):
            return ObjectStoreError(
                f"{url}: the credentials were refused ({code}: {message}); check "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or the profile"
            )
        if code in ("AccessDenied", "403", "Forbidden", "AllAccessDisabled") or status == 403:
            needs = (
                "s3:GetObject and s3:ListBucket (what reading needs; serve writes only its "
                "leases under _tokenfeed/leases/, prepare needs s3:PutObject, gc "
                "s3:DeleteObject)"
                if verb in _READ_VERBS
                else "s3:GetObject, s3:PutObject, s3:ListBucket (and s3:DeleteObject for gc)"
            )
            return ObjectStoreError(
                f"{url}: access denied ({verb}: {message}); check the credentials and that "
                f"their policy allows {needs} on this bucket and prefix"
            )
        # throttling or a 5xx still failing after botocore's retries: may pass later
        kind = StorageUnreachable if status >= 500 or code in _TRANSIENT_CODES else ObjectStoreError
        return kind(f"{url}: {verb} failed: {code or status} {message} (after retries)")


#: What a lost conditional write answers besides 412 (AWS: 409 when two race at once).
_CONFLICT_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict"})
#: The verbs of requests that only read (an access-denied message names read rights only).
_READ_VERBS = frozenset({"read", "download", "lookup", "listing", "read check"})


def _status(exc: BaseException) -> tuple[str, int]:
    """The error code and HTTP status of a botocore ``ClientError`` (``("", 0)`` else)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return "", 0
    code = str(response.get("Error", {}).get("Code", ""))
    return code, int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


#: Error codes S3 and its look-alikes answer when overloaded (retried by botocore first).
_TRANSIENT_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "ServiceUnavailable"}
)


def _credentials_error(exc: BaseException, url: str) -> ObjectStoreError | None:
    """A missing or unusable credential or profile as a tokenfeed error; None for others."""
    from botocore import exceptions as bx

    if isinstance(exc, bx.NoCredentialsError | bx.PartialCredentialsError):
        return ObjectStoreError(
            f"{url}: no AWS credentials found ({exc}); set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or configure ~/.aws/credentials"
        )
    if isinstance(exc, bx.CredentialRetrievalError | bx.TokenRetrievalError):
        return ObjectStoreError(
            f"{url}: could not obtain AWS credentials ({exc}); check the profile's "
            "credential_process / SSO session (aws sso login)"
        )
    if isinstance(exc, bx.ProfileNotFound):
        return ObjectStoreError(f"{url}: {exc}; fix AWS_PROFILE or ~/.aws/config")
    return None
