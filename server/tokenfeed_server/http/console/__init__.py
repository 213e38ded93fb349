"""The operator's console: one status page at ``GET /``, served from package data.

The page (``static/index.html``, ``console.js``, ``console.css``) has no build step and
loads nothing from outside the server: it reads the same JSON API as every other client
(``/v1/status``, ``/v1/limits``, ``/v1/datasets``, ``/v1/jobs``) every few seconds, with
the token the operator types (kept in the tab's ``sessionStorage``), so it shows exactly
what the API shows that token. Every name is set as text, never parsed as HTML, and the
Content-Security-Policy allows only the server's own scripts and styles, so a tenant or
dataset name cannot run script in the operator's browser.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, HTTPException
from fastapi.responses import Response

__all__ = ["CONTENT_SECURITY_POLICY", "asset", "router"]

#: Only the server's own files; no inline script or style, no framing, no plugins.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

# name -> media type: the page's whole file list (nothing else under static/ is served)
_ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}


def asset(name: str) -> bytes:
    """The bytes of one of the page's files, from the installed package."""
    return resources.files(__name__).joinpath("static").joinpath(name).read_bytes()


def router() -> APIRouter:
    """The page at ``/`` and its script and style under ``/console/``."""
    # Read once: the files are part of the installed package and do not change under it.
    files = {name: asset(name) for name in _ASSETS}
    headers = {
        "Content-Security-Policy": CONTENT_SECURITY_POLICY,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        # A new server version ships new files: never let a browser keep an old script.
        "Cache-Control": "no-cache",
    }

    routes = APIRouter(include_in_schema=False)

    @routes.get("/")
    def console_page() -> Response:
        return Response(files["index.html"], media_type=_ASSETS["index.html"], headers=headers)

    @routes.get("/console/{name}")
    def console_asset(name: str) -> Response:
        if name == "index.html" or name not in files:
            raise HTTPException(404, f"no console file {name!r}")
        return Response(files[name], media_type=_ASSETS[name], headers=headers)

    return routes
