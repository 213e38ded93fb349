"""``/healthz`` and ``/readyz``: liveness and readiness, open to all."""

from __future__ import annotations

from fastapi import APIRouter, Response

from tokenfeed_server.http.models import Health, Readiness
from tokenfeed_server.http.state import State

__all__ = ["router"]

router = APIRouter()


@router.get("/healthz")
def healthz() -> Health:
    """Alive: 200 while the process runs."""
    return Health(status="ok")


@router.get("/readyz", responses={503: {"model": Readiness, "description": "Not ready yet."}})
def readyz(state: State, response: Response) -> Readiness:
    """Ready: 200 once the store is open and the data socket is bound, else 503."""
    if not (state.ready and state.dataplane.alive):
        response.status_code = 503
        return Readiness(status="not ready")
    return Readiness(status="ready", zmq=state.dataplane.endpoint)
