"""How routes declare their error answers in the OpenAPI schema: every error body is an
:class:`~tokenfeed_server.http.models.ErrorBody`, described once per status code here."""

from __future__ import annotations

from typing import Any

from tokenfeed_server.http.models import ErrorBody

__all__ = ["errors", "json_errors"]

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "Not a valid dataset name."},
    401: {"model": ErrorBody, "description": "No token, or one the server does not know."},
    403: {"model": ErrorBody, "description": "A valid token without the needed right."},
    404: {"model": ErrorBody, "description": "No such dataset for this caller."},
    409: {"model": ErrorBody, "description": "The dataset exists but is broken."},
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` entries of a JSON route for these error status codes."""
    return {code: _ERRORS[code] for code in codes}


def json_errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """Errors of a route whose own answer is not JSON (FastAPI would document them with
    the route's media type): spelled out as JSON."""
    # ErrorBody is in the schema's components: the JSON routes' errors() register it.
    schema = {"$ref": "#/components/schemas/ErrorBody"}
    return {
        code: {
            "description": _ERRORS[code]["description"],
            "content": {"application/json": {"schema": schema}},
        }
        for code in codes
    }
