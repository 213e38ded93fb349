"""``/v1/jobs``: the jobs the caller may see, from the data plane's snapshot."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Query, Response

from tokenfeed_server.http.access import Reader
from tokenfeed_server.http.error_docs import errors
from tokenfeed_server.http.models import JobView
from tokenfeed_server.http.state import State

__all__ = ["router"]

router = APIRouter()


#: The response header with the snapshot's age in seconds (also in every job view).
AGE_HEADER = "X-Tokenfeed-Snapshot-Age"


@router.get("/v1/jobs", responses=errors(401))
def jobs(
    state: State,
    who: Reader,
    response: Response,
    forgotten: Annotated[
        bool,
        Query(
            description="Also list the last 64 jobs the data plane forgot, newest first, "
            "with their final counters (`forgotten: true`)."
        ),
    ] = False,
) -> list[JobView]:
    """Per job: its kind (one dataset or a mixture with its current weights), run id,
    plan inputs, workers, what was served (prefetched by the trainer's loader) and what
    the trainer consumed (reached its training loop): positions, epochs and tokens/s of
    each. From the data plane's snapshot: its age is `snapshot_age_s` and the
    `X-Tokenfeed-Snapshot-Age` header."""
    snap = state.dataplane.snapshot
    taken = snap.get("taken")
    age = None if taken is None else round(max(0.0, time.time() - taken), 3)
    if age is not None:
        response.headers[AGE_HEADER] = f"{age:.3f}"
    listed = [*snap["jobs"], *(snap.get("ended_jobs", []) if forgotten else [])]
    return [
        JobView.model_validate({**job, "snapshot_age_s": age})
        for job in listed
        if who.sees_tenant(job["tenant"])
    ]
