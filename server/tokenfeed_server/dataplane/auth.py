"""Who may read what: tenants, tokens, and the ZAP handler that checks them.

Authentication happens in the ZeroMQ handshake, before the data plane reads a single
request: the ROUTER socket runs the PLAIN mechanism (or CURVE, for encryption) and libzmq
asks our ZAP handler (RFC 27) about every new connection. The handler answers with the
tenant's name as the ZAP user id, which libzmq then stamps on every message of that
connection; the data plane checks each request against that tenant.

Tokens are never stored or logged in clear: a tenant is looked up by the SHA-256 of the
presented token, and every stored digest is compared with :func:`hmac.compare_digest`,
so the time taken does not depend on which tenant matched or on how many bytes agreed.

With CURVE, a tenant's client key is derived from the server's secret key and the
token's digest (see :mod:`tokenfeed.protocol.curve`; the operator issues it with
``tokenfeed-server client-key``): the server computes each tenant's expected public key
from the digest it keeps, so ``token_sha256`` suffices, and a token seen in clear does not
give its key away. A key derived from the token alone (version 1 clients) is refused, and
the server says once per tenant that the client needs upgrading.

Tenants file (TOML), read against one strict schema (:class:`TenantsFile`): an unknown
key, a wrong type or a bad value anywhere stops the server at start, naming the tenant and
the field::

    admin_token_sha256 = "..."        # optional: sees every job over HTTP

    [[tenant]]
    name = "alice"
    token_sha256 = "..."              # or token = "..."
    datasets = ["web-*", "code"]      # names or glob patterns; default: none
    max_connections = 64              # default: the server's per-tenant limit
    max_jobs = 16                     # default: --max-jobs-per-tenant
    weight = 2.0                      # fair-share weight; default 1
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import logging
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import zmq
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_core import ErrorDetails
from zmq.utils import z85

from tokenfeed.errors import ConfigError, DatasetForbidden, ServerError
from tokenfeed.protocol import TOKEN_RULE
from tokenfeed.protocol.curve import client_secret_key, curve_keypair, legacy_keypair_from_token
from tokenfeed_server.config import token_rule
from tokenfeed_server.logbudget import LogBudget

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"


def token_digest(token: str) -> str:
    """The SHA-256 hex digest under which a token is stored and compared."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Tenant:
    """One tenant: its name, token digest, readable datasets, caps and weight."""

    name: str
    token_sha256: str
    datasets: tuple[str, ...] = ("*",)
    max_connections: int | None = None
    max_jobs: int | None = None
    weight: float = 1.0
    #: the CURVE public key of the client key issued to this tenant (set under CURVE)
    curve_public_key: bytes | None = None
    #: the public key a version 1 client derives from the clear token: recognised, to
    #: tell the operator to upgrade it, never admitted (None without a clear token)
    legacy_curve_key: bytes | None = None

    def may_read(self, dataset: str) -> bool:
        """True if ``dataset`` matches one of the tenant's names or patterns."""
        return any(fnmatch.fnmatchcase(dataset, pattern) for pattern in self.datasets)


class Tenants:
    """The tenant table; ``None`` entries mean an open (unauthenticated) server."""

    def __init__(self, tenants: Iterable[Tenant], admin_token_sha256: str | None = None) -> None:
        self.by_name = {t.name: t for t in tenants}
        self.admin_token_sha256 = admin_token_sha256

    @classmethod
    def shared_token(cls, token: str, admin_token: str | None = None) -> Tenants:
        """One tenant, ``default``, that reads every dataset with a single shared token."""
        tenant = _tenant(TenantEntry(name="default", token=token, datasets=["*"]))
        return cls([tenant], token_digest(admin_token) if admin_token else None)

    @classmethod
    def load(cls, path: Path, admin_token: str | None = None) -> Tenants:
        """Read and validate a tenants file; every refusal names the file, tenant and field."""
        try:
            data = tomllib.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read tenants file {path}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"tenants file {path}: not valid TOML: {exc}") from None
        try:
            parsed = TenantsFile.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(f"tenants file {path}: {_explain(exc, data)}") from None
        tenants = [_tenant(entry) for entry in parsed.tenant]
        seen: dict[str, Tenant] = {}
        for tenant in tenants:
            if tenant.name in seen:
                raise ConfigError(
                    f"tenants file {path}: tenant {tenant.name!r}: name: used by two tenants; "
                    "names must be unique"
                )
            for other in seen.values():
                if other.token_sha256 == tenant.token_sha256:
                    raise ConfigError(
                        f"tenants file {path}: tenant {tenant.name!r}: token: the same token as "
                        f"tenant {other.name!r}; give each tenant its own"
                    )
            seen[tenant.name] = tenant
        admin = token_digest(admin_token) if admin_token else parsed.admin_token_sha256
        return cls(tenants, admin)

    def authenticate(self, token: str) -> Tenant | None:
        """The tenant whose token this is, compared in constant time, or None."""
        return self._match(token_digest(token).encode(), lambda t: t.token_sha256.encode())

    def use_curve(self, server_secret: bytes) -> None:
        """Expect under CURVE each tenant's issued client key (see
        :func:`tokenfeed.protocol.curve.client_secret_key`) from this server secret key."""
        self.by_name = {
            name: replace(
                t,
                curve_public_key=curve_keypair(client_secret_key(server_secret, t.token_sha256))[0],
            )
            for name, t in self.by_name.items()
        }

    def authenticate_curve(self, public_key: bytes) -> Tenant | None:
        """The tenant issued the client key of this CURVE public key, or None."""
        return self._match(public_key, lambda t: t.curve_public_key or b"")

    def legacy_curve_tenant(self, public_key: bytes) -> Tenant | None:
        """The tenant whose clear token implies this version 1 key (to refuse it, saying why)."""
        return self._match(public_key, lambda t: t.legacy_curve_key or b"")

    def _match(self, presented: bytes, stored: Any) -> Tenant | None:
        found = None
        for tenant in self.by_name.values():  # no early exit: timing says nothing
            if hmac.compare_digest(presented, stored(tenant)):
                found = tenant
        return found

    def is_admin(self, token: str) -> bool:
        """True for the admin token (sees every job and dataset over HTTP)."""
        if self.admin_token_sha256 is None:
            return False
        return hmac.compare_digest(token_digest(token), self.admin_token_sha256)

    def weight(self, name: str) -> float:
        """Fair-share weight of a tenant (1 for unknown ones)."""
        tenant = self.by_name.get(name)
        return tenant.weight if tenant else 1.0

    def authorize(self, name: str, dataset: str) -> ServerError | None:
        """None if tenant ``name`` may read ``dataset``, else the error to send."""
        tenant = self.by_name.get(name)
        if tenant is None or not tenant.may_read(dataset):
            # The tenant's own patterns, so a typo does not pass for a permission problem
            # (and no other tenant's dataset names are shown).
            readable = ", ".join(tenant.datasets) if tenant and tenant.datasets else "none"
            return DatasetForbidden(
                f"tenant {name!r} may not read dataset {dataset!r}; it may read datasets "
                f"matching: {readable}. Check the name, or ask the operator to add it to "
                "the tenant's datasets in the tenants file"
            )
        return None

    def max_jobs(self, name: str) -> int | None:
        """The tenant's own job cap, if it has one."""
        tenant = self.by_name.get(name)
        return tenant.max_jobs if tenant else None

    def max_connections(self, name: str) -> int | None:
        """The tenant's own connection cap, if it has one."""
        tenant = self.by_name.get(name)
        return tenant.max_connections if tenant else None


Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
NamePattern = Annotated[str, Field(min_length=1)]


class TenantEntry(BaseModel):
    """One ``[[tenant]]`` table as written. Strict: TOML has exact types, so none is coerced."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str = Field(min_length=1)
    token: Annotated[str | None, AfterValidator(token_rule)] = Field(default=None, repr=False)
    token_sha256: Sha256Hex | None = None
    # a list, never a string: "web-*" read letter by letter would grant "*"
    datasets: list[NamePattern] = Field(default_factory=list)
    max_connections: int | None = Field(default=None, ge=1)
    max_jobs: int | None = Field(default=None, ge=1)
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one_token(self) -> TenantEntry:
        if (self.token is None) == (self.token_sha256 is None):
            raise ValueError("give exactly one of token or token_sha256")
        return self


class TenantsFile(BaseModel):
    """The whole tenants file; no key outside this schema is accepted, at any level."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    admin_token_sha256: Sha256Hex | None = None
    tenant: list[TenantEntry] = Field(min_length=1)


#: what each field must be, in the words of the refusal
_EXPECTED = {
    "name": "a non-empty string",
    "token": TOKEN_RULE,
    "token_sha256": "64 lowercase hex digits (the SHA-256 of the token)",
    "admin_token_sha256": "64 lowercase hex digits (the SHA-256 of the admin token)",
    "datasets": "a list of name patterns",
    "max_connections": "an integer >= 1",
    "max_jobs": "an integer >= 1",
    "weight": "a number > 0",
    "tenant": "a list of [[tenant]] tables",
}
#: never echoed, not even in part
_SECRET = {"token", "token_sha256", "admin_token_sha256"}


def _explain(error: ValidationError, data: dict[str, Any]) -> str:
    """The first problem in one line: ``tenant 'alice': datasets: must be ..., got a string``."""
    # a misspelt key explains the field it left missing: name it first
    first = min(error.errors(), key=lambda e: e["type"] != "extra_forbidden")
    loc = first["loc"]
    if loc and loc[0] == "tenant" and len(loc) >= 2 and isinstance(loc[1], int):
        where = _tenant_label(data, loc[1])
        field = loc[2] if len(loc) > 2 else None
    else:
        where, field = None, loc[0] if loc else None
    prefix = f"{where}: " if where else ""
    if field is None:  # the tenant table as a whole
        if first["type"] in ("model_type", "model_attributes_type"):
            return f"{prefix}must be a table, got {_kind(first['input'])}"
        return prefix + first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        known = TenantEntry.model_fields if where else TenantsFile.model_fields
        return f"{prefix}{field}: unknown key (known: {', '.join(known)})"
    if first["type"] == "missing":
        if field == "tenant":
            return "defines no [[tenant]] entries"
        return f"{prefix}{field}: required"
    if field == "tenant" and first["type"] == "too_short":
        return "defines no [[tenant]] entries"
    return (
        f"{prefix}{field}: must be {_EXPECTED.get(str(field), 'valid')}, got {_got(first, field)}"
    )


def _tenant_label(data: dict[str, Any], index: int) -> str:
    entries = data.get("tenant")
    entry = entries[index] if isinstance(entries, list) and index < len(entries) else None
    name = entry.get("name") if isinstance(entry, dict) else None
    return f"tenant {name!r}" if isinstance(name, str) and name else f"tenant #{index + 1}"


def _got(error: ErrorDetails, field: object) -> str:
    value = error["input"]
    nested = len(error["loc"]) > 3  # an item inside a list, e.g. one of the datasets
    if nested:
        return f"{_kind(value)} at position {int(error['loc'][3]) + 1}"
    if field in _SECRET and isinstance(value, str) and value:
        return f"a string of {len(value)} characters"
    if error["type"].endswith("_type") or field in _SECRET:
        return _kind(value)
    return repr(value) if isinstance(value, str) else str(value)


def _kind(value: object) -> str:
    if isinstance(value, str):
        return "a string" if value else "an empty string"
    for kind, words in ((bool, "a boolean"), (int, "an integer"), (float, "a number"),
                        (list, "a list"), (dict, "a table")):  # fmt: skip
        if isinstance(value, kind):
            return words
    return f"a {type(value).__name__}"


def _tenant(entry: TenantEntry) -> Tenant:
    return Tenant(
        name=entry.name,
        token_sha256=entry.token_sha256 or token_digest(entry.token or ""),
        datasets=tuple(entry.datasets),
        max_connections=entry.max_connections,
        max_jobs=entry.max_jobs,
        weight=entry.weight,
        legacy_curve_key=legacy_keypair_from_token(entry.token)[0] if entry.token else None,
    )


class ZapHandler:
    """Answers libzmq's ZAP requests for one context, in a thread of its own."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], tenants: Tenants) -> None:
        self.tenants = tenants
        self._sock = context.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenfeed-zap", daemon=True)
        self.refused = 0
        self._log_budget = LogBudget()
        #: tenants whose version 1 client was already reported (once each)
        self._legacy_reported: set[str] = set()

    def start(self) -> None:
        """Start answering (before any socket that uses ZAP binds)."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and close the socket."""
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(100):
                    self._sock.send_multipart(self._answer(self._sock.recv_multipart()))
        finally:
            self._sock.close(linger=0)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        # RFC 27: version, request id, domain, address, identity, mechanism, credentials
        if len(frames) < 6 or frames[0] != b"1.0":
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"bad ZAP", b"", b""]
        request_id, address, mechanism, credentials = frames[1], frames[3], frames[5], frames[6:]
        tenant = self._identify(mechanism, credentials)
        if tenant is None:
            self.refused += 1
            # the address only: the presented credentials never reach the log
            if self._log_budget.take():
                log.warning(
                    "refused a %s connection from %s: unknown %s",
                    mechanism.decode(errors="replace"),
                    address.decode(errors="replace"),
                    "client key (issued by `tokenfeed-server client-key`)"
                    if mechanism == b"CURVE"
                    else "token",
                )
            return [b"1.0", request_id, b"400", b"unknown token", b"", b""]
        return [b"1.0", request_id, b"200", b"OK", tenant.name.encode(), b""]

    def _identify(self, mechanism: bytes, credentials: list[bytes]) -> Tenant | None:
        """The tenant these credentials prove, or None."""
        if mechanism == b"PLAIN" and len(credentials) == 2:
            try:
                return self.tenants.authenticate(credentials[1].decode())
            except UnicodeDecodeError:
                return None
        if mechanism != b"CURVE" or len(credentials) != 1:
            return None
        key = z85.encode(credentials[0])
        tenant = self.tenants.authenticate_curve(key)
        if tenant is None:
            old = self.tenants.legacy_curve_tenant(key)
            if old is not None and old.name not in self._legacy_reported:
                # Once per tenant: its clients retry, and the operator needs one line.
                self._legacy_reported.add(old.name)
                log.warning(
                    "tenant %r: CURVE key derived from the token: upgrade the client and use "
                    "`tokenfeed-server client-key` (refused: a sniffed token would give that "
                    "key away)",
                    old.name,
                )
        return tenant
