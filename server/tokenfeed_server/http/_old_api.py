"""The HTTP API: health, readiness, datasets, jobs and Prometheus metrics.

Handlers only read: the data plane publishes a status snapshot twice a second and the
store answers dataset look-ups; no handler touches a ZeroMQ socket. Every ``/v1``
answer is a declared model (:mod:`tokenfeed_server.http.models`).

Who sees what: health, readiness and limits are open to all. On an authenticated
server (a tenants file or ``--token``) a tenant sees its own jobs and the datasets its
patterns match, by name only; the store's path (in ``/v1/status`` and in dataset errors)
and ``/metrics`` (whose labels name every tenant and dataset) are for the admin token.
An open server is single-user, so its caller is the admin, unless ``--admin-token`` is
set to keep paths and metrics to that token's holder.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tokenfeed.errors import DatasetNotFound, InvalidDatasetName, StoreError
from tokenfeed_server import __version__
from tokenfeed_server.http.models import (
    BrokenDatasetView,
    CacheView,
    ConfigView,
    DatasetView,
    ErrorBody,
    Health,
    JobView,
    LimitsView,
    Readiness,
    StatusView,
)
from tokenfeed_server.dataplane.auth import Tenant, Tenants, token_digest
from tokenfeed_server.config import ServerConfig
from tokenfeed_server.http.console import add_console
from tokenfeed_server.http.console.apidocs import add_api_docs
from tokenfeed_server.dataplane import DataPlane
from tokenfeed_server.store import Dataset, Store, summary

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
        self.started = time.time()
        #: digest of --admin-token on an open server (an authenticated one keeps it in tenants)
        self.open_admin_sha256 = (
            token_digest(config.admin_token) if tenants is None and config.admin_token else None
        )
        root = str(store.root)
        # Longest first, so that the resolved form is not half-replaced by the given one.
        self._store_paths = sorted({root, str(Path(root).resolve())}, key=len, reverse=True)

    def redact(self, message: str) -> str:
        """``message`` with the store's path replaced, for callers who are not the admin."""
        for path in self._store_paths:
            message = message.replace(path, "<store>")
        return message


class Viewer:
    """Who is asking over HTTP, and so what the answer may show.

    ``admin``: everything, store paths and ``/metrics`` included. ``sees_all``: every job
    and dataset by name (the admin, or anyone on an open server). A ``tenant``: its own
    jobs and the datasets its patterns match. Neither: an anonymous caller of an
    authenticated server, who gets only what is open to all.
    """

    def __init__(self, tenant: Tenant | None, *, admin: bool, sees_all: bool = False) -> None:
        self.tenant = tenant
        self.admin = admin
        self.sees_all = admin or sees_all

    def sees_tenant(self, name: str) -> bool:
        """True if the caller may see the jobs of tenant ``name``."""
        return self.sees_all or (self.tenant is not None and self.tenant.name == name)

    def sees_dataset(self, name: str) -> bool:
        """True if the caller may learn that dataset ``name`` exists."""
        return self.sees_all or (self.tenant is not None and self.tenant.may_read(name))


_bearer = HTTPBearer(auto_error=False)
_WANT_BEARER = {"WWW-Authenticate": "Bearer"}


def _caller(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Viewer:
    """Identify the caller; an unknown token on an authenticated server is a 401."""
    state: ServerState = request.app.state.tokenfeed
    token = credentials.credentials if credentials is not None else None
    tenants = state.tenants
    if tenants is None:
        # An open server is single-user (loopback, or --insecure on purpose): everyone is
        # the admin, unless an admin token was set to keep paths and metrics to its holder.
        admin = state.open_admin_sha256 is None or (
            token is not None and hmac.compare_digest(token_digest(token), state.open_admin_sha256)
        )
        return Viewer(None, admin=admin, sees_all=True)
    if token is None:
        return Viewer(None, admin=False)
    if tenants.is_admin(token):
        return Viewer(None, admin=True)
    tenant = tenants.authenticate(token)
    if tenant is None:
        raise HTTPException(401, "unknown token", headers=_WANT_BEARER)
    return Viewer(tenant, admin=False)


def _reader(who: Annotated[Viewer, Depends(_caller)]) -> Viewer:
    """A caller allowed to read jobs and datasets: the admin, a tenant, or anyone if open."""
    if who.tenant is None and not who.sees_all:
        raise HTTPException(401, "send 'Authorization: Bearer <token>'", headers=_WANT_BEARER)
    return who


def _scraper(request: Request, who: Annotated[Viewer, Depends(_caller)]) -> Viewer:
    """A caller allowed to scrape /metrics, whose labels name every tenant and dataset."""
    state: ServerState = request.app.state.tokenfeed
    if who.admin:
        return who
    if who.tenant is None:
        raise HTTPException(
            401, "/metrics wants 'Authorization: Bearer <admin token>'", headers=_WANT_BEARER
        )
    tenants = state.tenants
    assert tenants is not None  # a tenant was authenticated
    if state.config.tenants_file is None and tenants.admin_token_sha256 is None:
        return who  # one shared token and no admin: its holder already sees every job
    hint = (
        ""
        if tenants.admin_token_sha256 is not None
        else "; none is configured: set admin_token_sha256 in the tenants file or --admin-token"
    )
    raise HTTPException(403, f"/metrics wants the admin token, not a tenant's{hint}")


Caller = Annotated[Viewer, Depends(_caller)]
Reader = Annotated[Viewer, Depends(_reader)]
Scraper = Annotated[Viewer, Depends(_scraper)]

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "Not a valid dataset name."},
    401: {"model": ErrorBody, "description": "No token, or one the server does not know."},
    403: {"model": ErrorBody, "description": "A valid token without the needed right."},
    404: {"model": ErrorBody, "description": "No such dataset for this caller."},
    409: {"model": ErrorBody, "description": "The dataset exists but is broken."},
}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: _ERRORS[code] for code in codes}


def _json_errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """Errors of a route whose own answer is not JSON (FastAPI would document them with
    the route's media type): spelled out as JSON."""
    schema = {"$ref": "#/components/schemas/ErrorBody"}  # registered by the routes above
    return {
        code: {
            "description": _ERRORS[code]["description"],
            "content": {"application/json": {"schema": schema}},
        }
        for code in codes
    }


def create_app(state: ServerState) -> FastAPI:
    """Build the FastAPI application over a running server's state."""
    # The docs pages are added by add_api_docs, from assets shipped in the package: the
    # defaults load Swagger UI and ReDoc from a CDN, blank on an offline cluster.
    app = FastAPI(title="tokenfeed-server", version=__version__, docs_url=None, redoc_url=None)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(state))
    app.state.tokenfeed = state

    @app.get("/healthz")
    def healthz() -> Health:
        """Alive: 200 while the process runs."""
        return Health(status="ok")

    @app.get("/readyz", responses={503: {"model": Readiness, "description": "Not ready yet."}})
    def readyz(response: Response) -> Readiness:
        """Ready: 200 once the store is open and the data socket is bound, else 503."""
        if not (state.ready and state.dataplane.alive):
            response.status_code = 503
            return Readiness(status="not ready")
        return Readiness(status="ready", zmq=state.dataplane.endpoint)

    @app.get("/v1/datasets", responses=_errors(401))
    def datasets(who: Reader) -> list[DatasetView | BrokenDatasetView]:
        """Summaries of the datasets the caller may read (broken ones with their error)."""
        out: list[DatasetView | BrokenDatasetView] = []
        for entry in state.store.summaries():
            if not who.sees_dataset(entry["name"]):
                continue
            if entry["ok"]:
                out.append(DatasetView.model_validate(entry))
            else:
                error = entry["error"] if who.admin else state.redact(entry["error"])
                out.append(BrokenDatasetView(name=entry["name"], ok=False, error=error))
        return out

    @app.get("/v1/datasets/{name}", responses=_errors(400, 401, 404, 409))
    def dataset(name: str, who: Reader) -> DatasetView:
        """Manifest summary of one dataset."""
        return DatasetView.model_validate(summary(_open_dataset(state, name, who)))

    @app.get(
        "/v1/datasets/{name}/tokenizer.json",
        response_class=Response,
        responses={
            200: {
                "description": "The Hugging Face `tokenizer.json` the dataset was prepared "
                "with, byte for byte (load it with `tokenizers.Tokenizer.from_str`).",
                "content": {"application/json": {"schema": {"type": "object"}}},
            },
            **_json_errors(400, 401, 404, 409),
        },
    )
    def tokenizer_file(name: str, who: Reader) -> Response:
        """The dataset's tokenizer file; a 404 for a byte-tokenized dataset says how to
        decode its ids instead."""
        ds = _open_dataset(state, name, who)
        info = ds.manifest.tokenizer
        if info.file is None:
            raise HTTPException(404, _no_tokenizer_file(name, info.kind, info.eos_id))
        try:
            data = ds.read_extra_file(info.file)
        except (OSError, ValueError) as exc:
            message = f"dataset {name!r}: cannot read its tokenizer file: {exc}"
            raise HTTPException(409, message if who.admin else state.redact(message)) from None
        digest = "blake2b-128:" + hashlib.blake2b(data, digest_size=16).hexdigest()
        if digest != info.file_hash:  # the manifest requires a hash with the file
            # The dataset was replaced between its opening and this read: the store's
            # watcher opens the new build shortly, and the client asks again.
            raise HTTPException(409, f"dataset {name!r} is being replaced; ask again in a second")
        return Response(
            data,
            media_type="application/json",
            headers={"ETag": f'"{digest}"', "X-Tokenfeed-Fingerprint": ds.fingerprint},
        )

    @app.get("/v1/jobs", responses=_errors(401))
    def jobs(who: Reader) -> list[JobView]:
        """Per job: dataset, plan inputs, workers, what was served (prefetched) and what the
        trainer consumed: positions, epochs and tokens/s of each."""
        return [
            JobView.model_validate(job)
            for job in state.dataplane.snapshot["jobs"]
            if who.sees_tenant(job["tenant"])
        ]

    @app.get("/v1/limits")
    def limits() -> LimitsView:
        """The limits every client is held to."""
        return LimitsView.model_validate(state.config.limits.as_dict())

    @app.get("/v1/status", responses=_errors(401))
    def status(who: Caller) -> StatusView:
        """Server instance, settings, connection count and counters (the store path: admin)."""
        snap = state.dataplane.snapshot
        config = dict(state.config.public_view())
        if not who.admin:
            config["store"] = None
            config["cache_dir"] = None
        cache = state.store.cache
        return StatusView(
            version=__version__,
            server=state.dataplane.instance,
            ready=state.ready,
            started=state.started,
            uptime_s=round(time.time() - state.started, 1),
            connections=snap["connections"],
            counters=snap["counters"],
            config=ConfigView.model_validate(config),
            cache=CacheView.model_validate(cache.stats()) if cache is not None else None,
        )

    @app.get("/metrics", response_class=PlainTextResponse, responses=_json_errors(401, 403))
    def metrics(who: Scraper) -> Response:
        """Prometheus text exposition; its labels name tenants and datasets, so it wants the
        admin token on an authenticated server (or the shared one when there is no admin)."""
        return Response(generate_latest(registry), media_type=PROMETHEUS_CONTENT_TYPE)

    add_console(app)
    add_api_docs(app)
    return app


def _open_dataset(state: ServerState, name: str, who: Viewer) -> Dataset:
    """The open dataset ``name``, or the HTTP error this caller may see."""
    # A tenant gets the same answer for a dataset it may not read and for one that does
    # not exist, and never the store's message (its path and every name in it).
    missing = f"no dataset {name!r}" + ("" if who.sees_all else " for this token")
    if not who.sees_dataset(name):
        raise HTTPException(404, missing)
    try:
        return state.store.get(name)
    except InvalidDatasetName as exc:
        raise HTTPException(400, str(exc)) from None
    except DatasetNotFound as exc:
        raise HTTPException(404, str(exc) if who.admin else missing) from None
    except StoreError as exc:
        raise HTTPException(409, str(exc) if who.admin else state.redact(str(exc))) from None


def _no_tokenizer_file(name: str, kind: str, eos_id: int) -> str:
    """The 404 of a dataset without a tokenizer file, with the way to decode it."""
    if kind == "byte":
        return (
            f"dataset {name!r} has no tokenizer file: it is byte-tokenized. Ids 0-255 are the "
            f"UTF-8 bytes of the text and id {eos_id} ends each document (tokenizer.eos_id at "
            f"/v1/datasets/{name}); decode with "
            "bytes(i for i in ids if i < 256).decode('utf-8', 'replace')"
        )
    return (
        f"dataset {name!r} has no tokenizer file (tokenizer kind {kind!r}, EOS id {eos_id}); "
        "use the tokenizer it was prepared with"
    )


class _SnapshotCollector(Collector):
    """Reads the data plane's snapshot at scrape time: zero cost on the hot path."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        snap = self.state.dataplane.snapshot
        # Not "job": Prometheus sets that label to the scrape target's job and would rename
        # ours to "exported_job"; "job_id" survives the scrape as it is.
        labels = ["job_id", "dataset", "tenant"]
        tokens = CounterMetricFamily("tokenfeed_tokens_served", "Tokens sent", labels=labels)
        batches = CounterMetricFamily("tokenfeed_batches_served", "Batches sent", labels=labels)
        retrans = CounterMetricFamily(
            "tokenfeed_retransmits", "Requests for data already sent", labels=labels
        )
        rate = GaugeMetricFamily(
            "tokenfeed_tokens_per_second", "Recent rate of tokens sent", labels=labels
        )
        workers = GaugeMetricFamily("tokenfeed_job_workers", "Attached workers", labels=labels)
        served = GaugeMetricFamily(
            "tokenfeed_served_position",
            "Furthest stream position sent (windows from the stream's start; prefetched)",
            labels=labels,
        )
        consumed = GaugeMetricFamily(
            "tokenfeed_consumed_position",
            "Stream position the trainer reported consumed (absent until it reports)",
            labels=labels,
        )
        consumed_rate = GaugeMetricFamily(
            "tokenfeed_consumed_tokens_per_second",
            "Recent rate of input tokens the trainer consumed (seq_len per window)",
            labels=labels,
        )
        for job in snap["jobs"]:
            values = [job["id"], job["dataset"], job["tenant"]]
            tokens.add_metric(values, job["tokens_served"])
            batches.add_metric(values, job["batches_served"])
            retrans.add_metric(values, job["retransmits"])
            rate.add_metric(values, job["tokens_per_s"])
            workers.add_metric(values, job["workers"])
            served.add_metric(values, job["position"])
            if job["consumed_position"] is not None:
                consumed.add_metric(values, job["consumed_position"])
                consumed_rate.add_metric(values, job["consumed_tokens_per_s"])
        yield from (tokens, batches, retrans, rate, workers, served, consumed, consumed_rate)
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
        cache = self.state.store.cache
        if cache is not None:
            yield from _cache_metrics(cache.stats())


def _cache_metrics(stats: dict[str, Any]) -> Iterator[Metric]:
    """The piece cache of an s3:// store, from :meth:`PieceCache.stats`."""
    gauges = {
        "capacity_bytes": "Most bytes the piece cache may hold",
        "size_bytes": "Bytes of verified pieces in the cache",
        "reserved_bytes": "Bytes held, being fetched or queued (never above the capacity)",
        "pieces": "Verified pieces in the cache",
        "fetching": "Pieces being fetched now",
        "wanted_pieces": "Pieces the prefetch plan wants",
    }
    for key, doc in gauges.items():
        yield GaugeMetricFamily(f"tokenfeed_cache_{key}", doc, value=stats[key])
    counters = {
        "hits": "Piece look-ups of reads that found the piece cached",
        "misses": "Piece look-ups of reads that waited for a fetch",
        "fetches": "Pieces fetched from object storage",
        "prefetches": "Pieces fetched ahead for the prefetch plan",
        "bytes_fetched": "Bytes fetched from object storage",
        "fetch_errors": "Failed GET attempts, each retried",
        "checksum_mismatches": "Fetched pieces that did not match the manifest",
        "unreadable": "Pieces given up on after the retries",
        "evictions": "Pieces evicted to make room",
    }
    for key, doc in counters.items():
        yield CounterMetricFamily(f"tokenfeed_cache_{key}", doc, value=stats[key])
    buckets = [(str(le), count) for le, count in stats["fetch_latency_buckets"]]
    buckets.append(("+Inf", stats["fetches"]))
    yield HistogramMetricFamily(
        "tokenfeed_cache_fetch_seconds",
        "Seconds per piece fetch (retries included)",
        buckets=buckets,
        sum_value=stats["fetch_latency_sum_s"],
    )
