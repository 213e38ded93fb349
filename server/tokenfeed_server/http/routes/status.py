"""``/v1/limits`` (open to all) and ``/v1/status``: the server's settings and counters."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter

from tokenfeed_server import __version__
from tokenfeed_server.http.access import Caller
from tokenfeed_server.http.error_docs import errors
from tokenfeed_server.http.models import CacheView, ConfigView, LimitsView, StatusView
from tokenfeed_server.http.state import State
from tokenfeed_server.store import memory

__all__ = ["memory_figures", "router"]

router = APIRouter()


@router.get("/v1/limits")
def limits(state: State) -> LimitsView:
    """The limits every client is held to."""
    return LimitsView.model_validate(state.config.limits.as_dict())


@router.get("/v1/status", responses=errors(401))
def status(state: State, who: Caller) -> StatusView:
    """Server instance and settings; the server-wide figures (connections, counters,
    cache, memory) to callers who see every job; the store path to the admin."""
    snap = state.dataplane.snapshot
    config = dict(state.config.public_view())
    if not who.admin:
        config["store"] = None
        config["cache_dir"] = None
    # Server-wide figures move with every tenant's work: on an authenticated server a
    # tenant (or anyone without a token) does not get them, or bob could watch alice.
    everything = who.sees_all
    cache = state.store.cache if everything else None
    return StatusView(
        version=__version__,
        server=state.dataplane.instance,
        ready=state.ready,
        started=state.started,
        uptime_s=round(time.time() - state.started, 1),
        connections=snap["connections"] if everything else None,
        unattached=snap.get("unattached", 0) if everything else None,
        rings=snap.get("rings", {}).get("open", 0) if everything else None,
        counters=snap["counters"] if everything else None,
        config=ConfigView.model_validate(config),
        cache=CacheView.model_validate(cache.stats()) if cache is not None else None,
        memory=memory_figures(snap) if everything else None,
    )


def memory_figures(snap: dict[str, Any]) -> dict[str, int]:
    """The store's owners (read now) and the data plane's (from its last snapshot)."""
    return {**memory.memory_by_owner(), **snap.get("memory", {})}
