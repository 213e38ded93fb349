"""A dataset's tokenizer, fetched from the server's HTTP API.

A trainer on another machine decodes (or inspects) its batches with the exact tokenizer
the dataset was prepared with: :func:`fetch_tokenizer` downloads
``GET /v1/datasets/{name}/tokenizer.json`` and returns a Hugging Face
``tokenizers.Tokenizer``. Only the standard library speaks HTTP here, so the client stays
light; ``tokenizers`` is imported on call, and :func:`fetch_tokenizer_json` returns the
file's text for programs without it.

Byte-tokenized datasets (``tokenizer.kind == "byte"``) have no tokenizer file: ids 0-255
are the UTF-8 bytes of the text and the EOS id (256, given as ``tokenizer.eos_id`` by
``/v1/datasets/{name}`` and in the manifest) ends each document. Decode them with
:func:`decode_bytes`; :func:`fetch_tokenizer` raises :class:`NoTokenizerFile` for them.
"""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from typing import TYPE_CHECKING

from tokenfeed.errors import (
    AuthenticationFailed,
    ConfigError,
    ServerError,
    ServerUnavailable,
    TokenFeedError,
    UnknownDataset,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["NoTokenizerFile", "decode_bytes", "fetch_tokenizer", "fetch_tokenizer_json"]

TIMEOUT_S = 30.0


class NoTokenizerFile(TokenFeedError, LookupError):
    """The dataset exists but was prepared without a tokenizer file (byte-tokenized)."""


def decode_bytes(ids: Iterable[int]) -> str:
    """Text of a byte-tokenized dataset's ids: bytes 0-255 as UTF-8, the EOS id dropped."""
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", "replace")


def fetch_tokenizer_json(http_url: str, dataset: str, token: str | None = None) -> str:
    """The ``tokenizer.json`` text of ``dataset`` on the server at ``http_url``.

    Raises:
        NoTokenizerFile: the dataset is byte-tokenized (see :func:`decode_bytes`).
        UnknownDataset: no such dataset, or one this token may not read.
        AuthenticationFailed: the server wants a token, or refused this one.
        ServerUnavailable: the server could not be reached.
    """
    base = _base_url(http_url)
    quoted = urllib.parse.quote(dataset, safe="")
    path = f"/v1/datasets/{quoted}/tokenizer.json"
    status, body, etag = _get(base, path, token)
    if status == 200:
        # The server sends the file's digest as its ETag: a cut-short body is caught here.
        digest = "blake2b-128:" + hashlib.blake2b(body, digest_size=16).hexdigest()
        if etag and etag.strip('"') != digest:
            raise ServerError(f"{base}{path}: the tokenizer file arrived damaged; ask again")
        return body.decode("utf-8")
    detail = _detail(body)
    if status == 404:
        # Missing dataset or missing file? The dataset's own endpoint tells them apart.
        if _get(base, f"/v1/datasets/{quoted}", token)[0] == 200:
            raise NoTokenizerFile(detail)
        raise UnknownDataset(detail)
    if status == 401:
        hint = "the server refused this token" if token else "the server wants a token"
        raise AuthenticationFailed(f"{hint}: {detail}")
    if status == 400:
        raise ConfigError(detail)
    raise ServerError(f"GET {base}{path}: HTTP {status}: {detail}")


def fetch_tokenizer(http_url: str, dataset: str, token: str | None = None) -> Tokenizer:
    """The Hugging Face tokenizer ``dataset`` was prepared with, from the server's HTTP API.

    Args:
        http_url: the server's HTTP address, e.g. ``http://host:7401``.
        dataset: the dataset's name.
        token: a bearer token (a tenant's or the admin's) for an authenticated server.

    Raises what :func:`fetch_tokenizer_json` raises, and :class:`TokenFeedError` when the
    ``tokenizers`` package is not installed.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenFeedError(
            "fetch_tokenizer needs Hugging Face's 'tokenizers' package: pip install tokenizers "
            "(or use tokenfeed.tokenizer.fetch_tokenizer_json for the file's text)"
        ) from None
    return Tokenizer.from_str(fetch_tokenizer_json(http_url, dataset, token))


def _base_url(http_url: str) -> str:
    parsed = urllib.parse.urlsplit(http_url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(f"{http_url!r} is not an http(s) URL such as http://host:7401")
    return http_url.rstrip("/")


def _get(base: str, path: str, token: str | None) -> tuple[int, bytes, str | None]:
    """(status, body, ETag) of a GET; only an unreachable server raises."""
    request = urllib.request.Request(base + path)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
            return answer.status, answer.read(), answer.headers.get("ETag")
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read(), None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ServerUnavailable(f"cannot reach {base}: {reason}") from None


def _detail(body: bytes) -> str:
    try:
        return str(json.loads(body)["detail"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace")
