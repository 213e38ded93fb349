"""The FastAPI application of a running server, assembled from one router per resource.

Every ``/v1`` answer is a declared model (:mod:`tokenfeed_server.http.models`); who may
see what is :mod:`tokenfeed_server.http.access`'s business.
"""

from __future__ import annotations

from fastapi import FastAPI

from tokenfeed_server import __version__
from tokenfeed_server.http import console
from tokenfeed_server.http.console import apidocs
from tokenfeed_server.http.routes import datasets, health, jobs, metrics, status
from tokenfeed_server.http.state import ServerState

__all__ = ["create_app"]


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
    return app
