"""``/healthz`` and ``/readyz``: liveness and readiness, open to all."""

from __future__ import annotations

from fastapi import APIRouter, Response

from tokenfeed_server.http.access import Prober
from tokenfeed_server.http.models import Health, Readiness
from tokenfeed_server.http.state import State

__all__ = ["router"]

router = APIRouter()


@router.get("/healthz")
def healthz() -> Health:
    """Alive: 200 while the process runs."""
    return Health(status="ok")


@router.get("/readyz", responses={503: {"model": Readiness, "description": "Not ready."}})
def readyz(state: State, who: Prober, response: Response) -> Readiness:
    """Ready: 200 once the store is open and the data socket is bound, as long as the
    store holds no dataset or at least one serves; else 503. Either way the body names the
    datasets that do not serve (those the caller may see)."""
    if not (state.ready and state.dataplane.alive):
        response.status_code = 503
        return Readiness(status="not ready", reason="the server is starting or stopping")
    entries = state.dataset_health.entries()
    down = [entry.name for entry in entries if not entry.serves]
    shown = [name for name in down if who.sees_dataset(name)]
    if entries and len(down) == len(entries):
        # An empty store is ready (a prepare may come later); one where nothing serves
        # can serve no trainer: a load balancer should send them elsewhere.
        response.status_code = 503
        return Readiness(
            status="not ready",
            reason=f"no dataset serves: all {len(down)} are unavailable (see /v1/datasets)",
            not_serving=shown,
            not_serving_count=len(down),
        )
    return Readiness(
        status="ready", zmq=state.dataplane.endpoint, not_serving=shown, not_serving_count=len(down)
    )
