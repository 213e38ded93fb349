"""The FastAPI application of a running server, assembled from one router per resource.

Every ``/v1`` answer is a declared model (:mod:`tokenfeed_server.http.models`); who may
see what is :mod:`tokenfeed_server.http.access`'s business.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.middleware.trustedhost import TrustedHostMiddleware

from tokenfeed_server import __version__
from tokenfeed_server.config import ServerConfig
from tokenfeed_server.http import console
from tokenfeed_server.http.console import apidocs
from tokenfeed_server.http.routes import datasets, health, jobs, metrics, status
from tokenfeed_server.http.state import ServerState

__all__ = ["LOOPBACK_HOSTS", "allowed_hosts", "create_app"]


def create_app(state: ServerState) -> FastAPI:
    """Build the FastAPI application over a running server's state."""
    # The docs pages come from apidocs, from assets shipped in the package: the defaults
    # load Swagger UI and ReDoc from a CDN, blank on an offline cluster.
    app = FastAPI(title="tokenfeed-server", version=__version__, docs_url=None, redoc_url=None)
    app.state.tokenfeed = state
    for resource in (health, datasets, jobs, status, metrics):
        app.include_router(resource.router)
    app.include_router(console.router())
    app.include_router(
        apidocs.router(openapi_url=app.openapi_url or "/openapi.json", title=app.title)
    )
    hosts = allowed_hosts(state.config)
    if hosts != ["*"]:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=hosts)
    return app


#: the names a browser on this machine uses for a loopback server
LOOPBACK_HOSTS = ["localhost", "127.0.0.1", "::1", "[::1]"]


def allowed_hosts(config: ServerConfig) -> list[str]:
    """The ``Host`` headers the HTTP port answers: ``--http-allowed-hosts`` when given;
    else, on loopback, only loopback names. A page in a local browser can otherwise
    rebind a DNS name of its own to 127.0.0.1 and read jobs, the store path and
    tokenizer files through the browser (DNS rebinding); a server on a network address
    answers any host (it is reached by many names)."""
    if config.http_allowed_hosts:
        return [h.strip() for h in config.http_allowed_hosts.split(",") if h.strip()]
    if not config.is_loopback():
        return ["*"]
    own = config.host if ":" not in config.host else f"[{config.host}]"
    return sorted({*LOOPBACK_HOSTS, config.host, own})
