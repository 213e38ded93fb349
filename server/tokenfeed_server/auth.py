"""Who may read what: tenants, tokens, and the ZAP handler that checks them.

Authentication happens in the ZeroMQ handshake, before the data plane reads a single
request: the ROUTER socket runs the PLAIN mechanism (or CURVE, for encryption) and libzmq
asks our ZAP handler (RFC 27) about every new connection. The handler answers with the
tenant's name as the ZAP user id, which libzmq then stamps on every message of that
connection; the data plane checks each request against that tenant.

Tokens are never stored or logged in clear: a tenant is looked up by the SHA-256 of the
presented token, and every stored digest is compared with :func:`hmac.compare_digest`,
so the time taken does not depend on which tenant matched or on how many bytes agreed.

With CURVE, the client's key pair is derived from its token (see
:func:`tokenfeed.client.curve_keypair_from_token`), so the same token identifies the
tenant: the server only needs the public key that each token implies.

Tenants file (TOML)::

    admin_token_sha256 = "..."        # optional: sees every job over HTTP

    [[tenant]]
    name = "alice"
    token_sha256 = "..."              # or token = "..." (needed for CURVE)
    datasets = ["web-*", "code"]      # names or glob patterns; default: none
    max_connections = 64              # default: the server's per-tenant limit
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from tokenfeed.client import curve_keypair_from_token
from tokenfeed.errors import ConfigError, DatasetForbidden, ServerError
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
    weight: float = 1.0
    curve_public_key: bytes | None = None

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
        tenant = _tenant(name="default", token=token, datasets=("*",))
        return cls([tenant], token_digest(admin_token) if admin_token else None)

    @classmethod
    def load(cls, path: Path, admin_token: str | None = None) -> Tenants:
        """Read a tenants file; errors name the file and the entry."""
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read tenants file {path}: {exc}") from None
        tenants = []
        for i, entry in enumerate(data.get("tenant", [])):
            try:
                tenants.append(_tenant(**entry))
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{path}: [[tenant]] #{i + 1}: {exc}") from None
        if not tenants:
            raise ConfigError(f"{path} defines no [[tenant]] entries")
        names = [t.name for t in tenants]
        if len(set(names)) != len(names):
            raise ConfigError(f"{path}: tenant names must be unique")
        digests = [t.token_sha256 for t in tenants]
        if len(set(digests)) != len(digests):
            raise ConfigError(f"{path}: two tenants share a token; give each its own")
        admin = data.get("admin_token_sha256")
        if admin_token:
            admin = token_digest(admin_token)
        return cls(tenants, admin)

    def authenticate(self, token: str) -> Tenant | None:
        """The tenant whose token this is, compared in constant time, or None."""
        return self._match(token_digest(token).encode(), lambda t: t.token_sha256.encode())

    def authenticate_curve(self, public_key: bytes) -> Tenant | None:
        """The tenant whose token implies this CURVE public key, or None."""
        return self._match(public_key, lambda t: t.curve_public_key or b"")

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
            return DatasetForbidden(
                f"tenant {name!r} may not read dataset {dataset!r}; ask the operator to add "
                "it to the tenant's datasets in the tenants file"
            )
        return None

    def max_connections(self, name: str) -> int | None:
        """The tenant's own connection cap, if it has one."""
        tenant = self.by_name.get(name)
        return tenant.max_connections if tenant else None


def _tenant(
    *,
    name: str,
    token: str | None = None,
    token_sha256: str | None = None,
    datasets: Iterable[str] = (),
    max_connections: int | None = None,
    weight: float = 1.0,
) -> Tenant:
    if not name or not isinstance(name, str):
        raise ValueError("name is required")
    if (token is None) == (token_sha256 is None):
        raise ValueError(f"tenant {name!r}: give exactly one of token or token_sha256")
    if token is not None and len(token) < 16:
        raise ValueError(f"tenant {name!r}: tokens must be at least 16 characters")
    if token_sha256 is not None and (
        len(token_sha256) != 64 or any(c not in "0123456789abcdef" for c in token_sha256)
    ):
        raise ValueError(f"tenant {name!r}: token_sha256 must be 64 lowercase hex digits")
    if not float(weight) > 0:
        raise ValueError(f"tenant {name!r}: weight must be > 0")
    if max_connections is not None and max_connections < 1:
        raise ValueError(f"tenant {name!r}: max_connections must be >= 1")
    return Tenant(
        name=name,
        token_sha256=token_sha256 or token_digest(token or ""),
        datasets=tuple(datasets),
        max_connections=max_connections,
        weight=float(weight),
        curve_public_key=curve_keypair_from_token(token)[0] if token else None,
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
        tenant = None
        if mechanism == b"PLAIN" and len(credentials) == 2:
            try:
                tenant = self.tenants.authenticate(credentials[1].decode())
            except UnicodeDecodeError:
                tenant = None
        elif mechanism == b"CURVE" and len(credentials) == 1:
            tenant = self.tenants.authenticate_curve(zmq.utils.z85.encode(credentials[0]))
        if tenant is None:
            self.refused += 1
            # the address only: the presented credentials never reach the log
            if self._log_budget.take():
                log.warning(
                    "refused a %s connection from %s: unknown token",
                    mechanism.decode(errors="replace"),
                    address.decode(errors="replace"),
                )
            return [b"1.0", request_id, b"400", b"unknown token", b"", b""]
        return [b"1.0", request_id, b"200", b"OK", tenant.name.encode(), b""]
