"""What the HTTP side may read of a running server (:class:`ServerState`)."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Depends, Request

from tokenfeed_server.config import ServerConfig
from tokenfeed_server.dataplane.auth import Tenants, token_digest
from tokenfeed_server.dataplane.plane import DataPlane
from tokenfeed_server.http.dataset_health import DatasetHealthView
from tokenfeed_server.store import Store
from tokenfeed_server.store.redact import Redactor

__all__ = ["ServerState", "State", "server_state"]


class ServerState:
    """What the HTTP side may read: config, store, data plane, the ready flag, and each
    dataset's health (:attr:`dataset_health`)."""

    def __init__(
        self, config: ServerConfig, store: Store, dataplane: DataPlane, tenants: Tenants | None
    ) -> None:
        self.config = config
        self.store = store
        self.dataplane = dataplane
        self.tenants = tenants
        self.ready = False
        #: the store's datasets with their storage health (/v1/datasets, /readyz, /metrics)
        self.dataset_health = DatasetHealthView(store)
        self.dataset_health.entries()  # broken datasets' "since": from start-up on
        self.started = time.time()
        #: digest of --admin-token on an open server (an authenticated one keeps it in tenants)
        self.open_admin_sha256 = (
            token_digest(config.admin_token) if tenants is None and config.admin_token else None
        )
        self._redact = Redactor.for_store(store)  # the same as the data port's errors

    def redact(self, message: str) -> str:
        """``message`` with the store's location (and endpoint) replaced, for callers who
        are not the admin."""
        return self._redact(message)


def server_state(request: Request) -> ServerState:
    """The state of the server whose app answers ``request`` (set by ``create_app``)."""
    state: ServerState = request.app.state.tokenfeed
    return state


#: a handler parameter that receives the server's state
State = Annotated[ServerState, Depends(server_state)]
