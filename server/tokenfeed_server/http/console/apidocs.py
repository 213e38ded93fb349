"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) with every asset served by the server.

FastAPI's default pages load their JavaScript, CSS, favicon and fonts from public CDNs,
which leaves them blank on an offline cluster. This follows FastAPI's self-hosting
recipe (``docs_url=None``, ``get_swagger_ui_html(swagger_js_url=...)``) with the files
of the ``fastapi-offline`` distribution, which vendors Swagger UI and ReDoc; only its
static files are used, not its app factory.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, HTTPException
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse, Response

__all__ = ["ASSETS_PATH", "DOCS_CONTENT_SECURITY_POLICY", "router"]

#: Where the vendored assets are served.
ASSETS_PATH = "/docs/assets"

#: The docs pages may load only from the server: their own inline start-up script and
#: styles, ReDoc's blob worker, and nothing else (ReDoc's footer logo lives on a CDN; the
#: browser does not even ask for it).
DOCS_CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; connect-src 'self'; worker-src 'self' blob:; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)

_ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "redoc.standalone.js": "text/javascript; charset=utf-8",
    "favicon.png": "image/png",
}


def _read(name: str) -> bytes:
    return resources.files("fastapi_offline").joinpath("static").joinpath(name).read_bytes()


def router(*, openapi_url: str, title: str) -> APIRouter:
    """``/docs``, ``/redoc`` and their assets, for an app built with both URLs None whose
    schema is at ``openapi_url``."""
    files = {name: _read(name) for name in _ASSETS}  # about 3 MB, read once
    redirect_url = "/docs/oauth2-redirect"
    routes = APIRouter(include_in_schema=False)

    @routes.get("/docs")
    def swagger_ui() -> HTMLResponse:
        return _guarded(
            get_swagger_ui_html(
                openapi_url=openapi_url,
                title=f"{title} - API",
                oauth2_redirect_url=redirect_url,
                swagger_js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js",
                swagger_css_url=f"{ASSETS_PATH}/swagger-ui.css",
                swagger_favicon_url=f"{ASSETS_PATH}/favicon.png",
                # The default validator badge asks validator.swagger.io about the schema.
                swagger_ui_parameters={"validatorUrl": None},
            )
        )

    @routes.get(redirect_url)
    def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @routes.get("/redoc")
    def redoc() -> HTMLResponse:
        return _guarded(
            get_redoc_html(
                openapi_url=openapi_url,
                title=f"{title} - API",
                redoc_js_url=f"{ASSETS_PATH}/redoc.standalone.js",
                redoc_favicon_url=f"{ASSETS_PATH}/favicon.png",
                with_google_fonts=False,
            )
        )

    @routes.get(ASSETS_PATH + "/{name}")
    def docs_asset(name: str) -> Response:
        if name not in files:
            raise HTTPException(404, f"no docs asset {name!r}")
        return Response(
            files[name],
            media_type=_ASSETS[name],
            headers={"Cache-Control": "public, max-age=86400"},
        )

    return routes


def _guarded(page: HTMLResponse) -> HTMLResponse:
    page.headers["Content-Security-Policy"] = DOCS_CONTENT_SECURITY_POLICY
    page.headers["X-Content-Type-Options"] = "nosniff"
    return page
