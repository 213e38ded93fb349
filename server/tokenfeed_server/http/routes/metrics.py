"""``/metrics``: the Prometheus text exposition (for the admin token: its labels name
every tenant and dataset)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import PlainTextResponse

from tokenfeed_server.http.access import Scraper
from tokenfeed_server.http.error_docs import json_errors
from tokenfeed_server.http.metrics import PROMETHEUS_CONTENT_TYPE, exposition
from tokenfeed_server.http.state import State

__all__ = ["router"]

router = APIRouter()


@router.get("/metrics", response_class=PlainTextResponse, responses=json_errors(401, 403))
def metrics(state: State, who: Scraper) -> Response:
    """Prometheus text exposition; its labels name tenants and datasets, so it wants the
    admin token on an authenticated server (or the shared one when there is no admin)."""
    return Response(exposition(state), media_type=PROMETHEUS_CONTENT_TYPE)
