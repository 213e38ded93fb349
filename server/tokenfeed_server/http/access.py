"""Who is asking over HTTP, and so what the answer may show.

Health, readiness and limits are open to all. On an authenticated server (a tenants
file or ``--token``) a tenant sees its own jobs and the datasets its patterns match, by
name only; the store's path (in ``/v1/status`` and in dataset errors) and ``/metrics``
(whose labels name every tenant and dataset) are for the admin token. An open server is
single-user, so its caller is the admin, unless ``--admin-token`` is set to keep paths
and metrics to that token's holder.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from tokenfeed_server.dataplane.auth import Tenant, token_digest
from tokenfeed_server.http.state import State

__all__ = [
    "Caller",
    "Prober",
    "Reader",
    "Scraper",
    "Viewer",
    "caller",
    "prober",
    "reader",
    "scraper",
]

_bearer = HTTPBearer(auto_error=False)
_WANT_BEARER = {"WWW-Authenticate": "Bearer"}


class Viewer:
    """Who is asking over HTTP, and so what the answer may show.

    ``admin``: everything, store paths and ``/metrics`` included. ``sees_all``: every job
    and dataset by name (the admin, or anyone on an open server). A ``tenant``: its own
    jobs and the datasets its patterns match. Neither: an anonymous caller of an
    authenticated server, who gets only what is open to all.
    """

    def __init__(self, tenant: Tenant | None, *, admin: bool, sees_all: bool = False) -> None:
        self.tenant = tenant
        self.admin = admin
        self.sees_all = admin or sees_all

    def sees_tenant(self, name: str) -> bool:
        """True if the caller may see the jobs of tenant ``name``."""
        return self.sees_all or (self.tenant is not None and self.tenant.name == name)

    def sees_dataset(self, name: str) -> bool:
        """True if the caller may learn that dataset ``name`` exists."""
        return self.sees_all or (self.tenant is not None and self.tenant.may_read(name))


def caller(
    state: State,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Viewer:
    """Identify the caller; an unknown token on an authenticated server is a 401."""
    token = credentials.credentials if credentials is not None else None
    tenants = state.tenants
    if tenants is None:
        # An open server is single-user (loopback, or --insecure on purpose): everyone is
        # the admin, unless an admin token was set to keep paths and metrics to its holder.
        admin = state.open_admin_sha256 is None or (
            token is not None and hmac.compare_digest(token_digest(token), state.open_admin_sha256)
        )
        return Viewer(None, admin=admin, sees_all=True)
    if token is None:
        return Viewer(None, admin=False)
    if tenants.is_admin(token):
        return Viewer(None, admin=True)
    tenant = tenants.authenticate(token)
    if tenant is None:
        raise HTTPException(401, "unknown token", headers=_WANT_BEARER)
    return Viewer(tenant, admin=False)


def prober(
    state: State,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Viewer:
    """The caller of an endpoint open to all (``/readyz``): identified if it sends a known
    token, else anonymous; never refused, so that a probe cannot fail on a token."""
    try:
        return caller(state, credentials)
    except HTTPException:
        return Viewer(None, admin=False)


def reader(who: Annotated[Viewer, Depends(caller)]) -> Viewer:
    """A caller allowed to read jobs and datasets: the admin, a tenant, or anyone if open."""
    if who.tenant is None and not who.sees_all:
        raise HTTPException(401, "send 'Authorization: Bearer <token>'", headers=_WANT_BEARER)
    return who


def scraper(state: State, who: Annotated[Viewer, Depends(caller)]) -> Viewer:
    """A caller allowed to scrape /metrics, whose labels name every tenant and dataset."""
    if who.admin:
        return who
    if who.tenant is None:
        raise HTTPException(
            401, "/metrics wants 'Authorization: Bearer <admin token>'", headers=_WANT_BEARER
        )
    tenants = state.tenants
    assert tenants is not None  # a tenant was authenticated
    if state.config.tenants_file is None and tenants.admin_token_sha256 is None:
        return who  # one shared token and no admin: its holder already sees every job
    hint = (
        ""
        if tenants.admin_token_sha256 is not None
        else "; none is configured: set admin_token_sha256 in the tenants file or --admin-token"
    )
    raise HTTPException(403, f"/metrics wants the admin token, not a tenant's{hint}")


Caller = Annotated[Viewer, Depends(caller)]
Prober = Annotated[Viewer, Depends(prober)]
Reader = Annotated[Viewer, Depends(reader)]
Scraper = Annotated[Viewer, Depends(scraper)]
