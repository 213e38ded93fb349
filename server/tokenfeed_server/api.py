"""The HTTP API: health, readiness, datasets, jobs and Prometheus metrics.

Handlers only read: the data plane publishes a status snapshot twice a second and the
store answers dataset look-ups; no handler touches a ZeroMQ socket.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenfeed.errors import InvalidDatasetName, StoreError
from tokenfeed_server import __version__
from tokenfeed_server.auth import Tenant, Tenants
from tokenfeed_server.config import ServerConfig
from tokenfeed_server.dataplane import DataPlane
from tokenfeed_server.store import Store, summary

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerState:
    """What the HTTP side may read: config, store, data plane, and the ready flag."""

    def __init__(
        self, config: ServerConfig, store: Store, dataplane: DataPlane, tenants: Tenants | None
    ) -> None:
        self.config = config
        self.store = store
        self.dataplane = dataplane
        self.tenants = tenants
        self.ready = False


class Viewer:
    """Who is asking over HTTP: everyone (open server), the admin, or one tenant."""

    def __init__(self, tenant: Tenant | None, admin: bool) -> None:
        self.tenant = tenant
        self.admin = admin

    def sees_tenant(self, name: str) -> bool:
        return self.admin or (self.tenant is not None and self.tenant.name == name)

    def sees_dataset(self, name: str) -> bool:
        return self.admin or (self.tenant is not None and self.tenant.may_read(name))


_bearer = HTTPBearer(auto_error=False)


def _viewer(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Viewer:
    tenants = request.app.state.tokenfeed.tenants
    if tenants is None:
        return Viewer(None, admin=True)  # an open server has nothing to hide
    if credentials is None:
        raise HTTPException(
            401, "send 'Authorization: Bearer <token>'", headers={"WWW-Authenticate": "Bearer"}
        )
    token = credentials.credentials
    if tenants.is_admin(token):
        return Viewer(None, admin=True)
    tenant = tenants.authenticate(token)
    if tenant is None:
        raise HTTPException(401, "unknown token", headers={"WWW-Authenticate": "Bearer"})
    return Viewer(tenant, admin=False)


Who = Annotated[Viewer, Depends(_viewer)]


def create_app(state: ServerState) -> FastAPI:
    """Build the FastAPI application over a running server's state."""
    app = FastAPI(title="tokenfeed-server", version=__version__)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(state))
    app.state.tokenfeed = state

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        """Alive: 200 while the process runs."""
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz(response: Response) -> dict[str, Any]:
        """Ready: 200 once the store is open and the data socket is bound, else 503."""
        if not (state.ready and state.dataplane.alive):
            response.status_code = 503
            return {"status": "not ready"}
        return {"status": "ready", "zmq": state.dataplane.endpoint}

    @app.get("/v1/datasets")
    def datasets(who: Who) -> list[dict[str, Any]]:
        """Summaries of the datasets the caller may read (broken ones with their error)."""
        return [d for d in state.store.summaries() if who.sees_dataset(d["name"])]

    @app.get("/v1/datasets/{name}")
    def dataset(name: str, who: Who) -> dict[str, Any]:
        """Manifest summary of one dataset."""
        if not who.sees_dataset(name):
            raise HTTPException(status_code=404, detail=f"no dataset {name!r} for this token")
        try:
            return summary(state.store.get(name))
        except InvalidDatasetName as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from None
        except KeyError as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from None
        except StoreError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from None

    @app.get("/v1/jobs")
    def jobs(who: Who) -> list[dict[str, Any]]:
        """Per job: dataset, plan inputs, workers, batches, tokens, tokens/s, position."""
        return [j for j in state.dataplane.snapshot["jobs"] if who.sees_tenant(j["tenant"])]

    @app.get("/v1/limits")
    def limits() -> dict[str, int]:
        """The limits every client is held to."""
        return state.config.limits.as_dict()

    @app.get("/v1/status")
    def status() -> dict[str, Any]:
        """Server instance, settings, connection count and counters."""
        snap = state.dataplane.snapshot
        return {
            "version": __version__,
            "server": state.dataplane.instance,
            "ready": state.ready,
            "connections": snap["connections"],
            "counters": snap["counters"],
            "config": state.config.public_view(),
        }

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> Response:
        """Prometheus text exposition."""
        return Response(generate_latest(registry), media_type=PROMETHEUS_CONTENT_TYPE)

    return app


class _SnapshotCollector(Collector):
    """Reads the data plane's snapshot at scrape time: zero cost on the hot path."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        snap = self.state.dataplane.snapshot
        labels = ["job", "dataset", "tenant"]
        tokens = CounterMetricFamily("tokenfeed_tokens_served", "Tokens sent", labels=labels)
        batches = CounterMetricFamily("tokenfeed_batches_served", "Batches sent", labels=labels)
        retrans = CounterMetricFamily(
            "tokenfeed_retransmits", "Requests for data already sent", labels=labels
        )
        rate = GaugeMetricFamily("tokenfeed_tokens_per_second", "Recent rate", labels=labels)
        workers = GaugeMetricFamily("tokenfeed_job_workers", "Attached workers", labels=labels)
        for job in snap["jobs"]:
            values = [job["id"], job["dataset"], job["tenant"]]
            tokens.add_metric(values, job["tokens_served"])
            batches.add_metric(values, job["batches_served"])
            retrans.add_metric(values, job["retransmits"])
            rate.add_metric(values, job["tokens_per_s"])
            workers.add_metric(values, job["workers"])
        yield from (tokens, batches, retrans, rate, workers)
        yield GaugeMetricFamily(
            "tokenfeed_connections", "Attached connections", value=snap["connections"]
        )
        yield GaugeMetricFamily("tokenfeed_jobs", "Known jobs", value=len(snap["jobs"]))
        yield GaugeMetricFamily(
            "tokenfeed_ready", "1 when serving", value=1 if self.state.ready else 0
        )
        events = CounterMetricFamily("tokenfeed_events", "Data plane events", labels=["event"])
        for name, value in sorted(snap["counters"].items()):
            events.add_metric([name], value)
        yield events
