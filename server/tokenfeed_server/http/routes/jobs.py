"""``/v1/jobs``: the jobs the caller may see, from the data plane's snapshot."""

from __future__ import annotations

from fastapi import APIRouter

from tokenfeed_server.http.access import Reader
from tokenfeed_server.http.error_docs import errors
from tokenfeed_server.http.models import JobView
from tokenfeed_server.http.state import State

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/jobs", responses=errors(401))
def jobs(state: State, who: Reader) -> list[JobView]:
    """Per job: dataset, plan inputs, workers, what was served (prefetched) and what the
    trainer consumed: positions, epochs and tokens/s of each."""
    return [
        JobView.model_validate(job)
        for job in state.dataplane.snapshot["jobs"]
        if who.sees_tenant(job["tenant"])
    ]
