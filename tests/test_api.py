"""The HTTP API over real server processes: declared response models, and who sees what.

Four servers, one per way the API decides who is asking: open (single-user, loopback),
open with an admin token, one shared token, and a tenants file with an admin token.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from live_server import LiveServer, tenants_toml
from shard_data import BYTE
from tokenfeed_server.config import Limits, ServerConfig
from tokenfeed_server.http.models import ConfigView, LimitsView
from tokenfeed_server.store import write_dataset
from waiting import wait_until

pytestmark = pytest.mark.network

ALICE = "alice-api-token-0123456789abcdef"
BOB = "bob-api-token-fedcba9876543210"
ADMIN = "admin-api-token-zyxwvutsrqponml"
SHARED = "shared-api-token-000011112222333"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``alpha`` and ``alpha-2`` (alice's), ``beta-secret`` (bob's), ``alpha-broken``."""
    root = tmp_path_factory.mktemp("store")
    docs = [np.arange(n, dtype=np.uint16) % 256 for n in range(100, 2100, 100)]
    for name in ("alpha", "alpha-2", "beta-secret", "alpha-broken"):
        write_dataset(root, name, docs, tokenizer=BYTE, shuffle_seed=0)
    shard = next((root / "alpha-broken").glob("shard-*.bin"))
    shard.write_bytes(shard.read_bytes()[:32])  # a truncated header: refused at start-up
    return root


@pytest.fixture(scope="module")
def tenants(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = tmp_path_factory.mktemp("conf") / "tenants.toml"
    path.write_text(tenants_toml(ADMIN, {"alice": (ALICE, ["alpha*"]), "bob": (BOB, ["beta-*"])}))
    with LiveServer(store, extra=["--tenants", str(path)]) as srv:
        yield srv


@pytest.fixture(scope="module")
def open_server(store: Path) -> Iterator[LiveServer]:
    with LiveServer(store) as srv:
        yield srv


# -- the declared models ------------------------------------------------------------------


def test_openapi_declares_a_documented_model_for_every_json_answer(
    open_server: LiveServer,
) -> None:
    schema = open_server.get("/openapi.json").json()
    components = schema["components"]["schemas"]

    def model_names(node: dict[str, Any]) -> set[str]:
        """Names of the component models a schema node refers to, however nested."""
        if "$ref" in node:
            return {node["$ref"].rsplit("/", 1)[1]}
        found: set[str] = set()
        for key in ("items", "anyOf", "oneOf"):
            value = node.get(key)
            for child in value if isinstance(value, list) else [value] if value else []:
                found |= model_names(child)
        return found

    json_paths = [
        p for p in schema["paths"] if p.startswith("/v1/") or p in ("/healthz", "/readyz")
    ]
    assert len(json_paths) == 8, json_paths
    for path in json_paths:
        for code, answer in schema["paths"][path]["get"]["responses"].items():
            if code == "422":
                continue  # FastAPI's own, for malformed parameters
            if path.endswith("/tokenizer.json") and code == "200":
                continue  # the tokenizer file itself, passed through as stored
            node = answer["content"]["application/json"]["schema"]
            assert model_names(node), f"{path} {code} answers an undeclared {node}"
    # Every field of every model says what it is, nested models included.
    for name, model in components.items():
        if name in ("HTTPValidationError", "ValidationError"):
            continue
        for field, spec in model["properties"].items():
            assert spec.get("description"), f"{name}.{field} has no description"
    metrics = schema["paths"]["/metrics"]["get"]["responses"]
    assert "text/plain" in metrics["200"]["content"]
    for code in ("401", "403"):  # JSON, although the 200 is text
        assert set(metrics[code]["content"]) == {"application/json"}


def test_models_cover_every_published_setting_and_limit() -> None:
    # A setting added to public_view() or a limit added to Limits must be declared too,
    # or the API would drop it without a word.
    assert set(ConfigView.model_fields) == set(ServerConfig(store=Path("s")).public_view())
    assert set(LimitsView.model_fields) == set(Limits().as_dict())


def test_every_answer_validates_against_its_model(open_server: LiveServer, store: Path) -> None:
    open_server.run_job("alpha", None)
    listed = {d["name"]: d for d in open_server.get("/v1/datasets").json()}
    assert listed["alpha"]["ok"] is True and listed["alpha"]["tokenizer"]["eos_id"] == 256
    assert listed["alpha-broken"]["ok"] is False and "truncated" in listed["alpha-broken"]["error"]
    alpha = open_server.get("/v1/datasets/alpha").json()
    assert alpha == listed["alpha"]
    assert open_server.get("/v1/datasets/alpha-broken").status_code == 409
    assert open_server.get("/readyz").json()["zmq"] == open_server.zmq
    status = open_server.get("/v1/status").json()
    assert status["config"]["auth"] == "open"
    assert status["config"]["limits"] == open_server.get("/v1/limits").json()


# -- who sees what: a tenants file with an admin token --------------------------------------


def test_a_missing_dataset_tells_a_tenant_nothing_about_the_store(
    tenants: LiveServer, store: Path
) -> None:
    # "alpha-gone" matches alice's pattern, so it reaches the store, whose message names
    # the store's path and every dataset in it.
    missing = tenants.get("/v1/datasets/alpha-gone", headers=bearer(ALICE))
    forbidden = tenants.get("/v1/datasets/beta-secret", headers=bearer(ALICE))
    assert missing.status_code == forbidden.status_code == 404
    assert missing.json() == {"detail": "no dataset 'alpha-gone' for this token"}
    assert forbidden.json() == {"detail": "no dataset 'beta-secret' for this token"}
    admin = tenants.get("/v1/datasets/alpha-gone", headers=bearer(ADMIN))
    assert admin.status_code == 404
    assert str(store) in admin.json()["detail"] and "beta-secret" in admin.json()["detail"]


def test_a_long_hostile_name_is_not_echoed_in_full(tenants: LiveServer) -> None:
    for name in ("a" * 5000, "alpha-" + "x" * 5000, "bad\u202ename" * 400):
        answer = tenants.get(f"/v1/datasets/{name}", headers=bearer(ADMIN))
        assert answer.status_code in (400, 404)
        assert len(answer.text) < 400 and "\u202e" not in answer.json()["detail"]


def test_a_broken_dataset_shows_a_tenant_its_error_without_the_path(
    tenants: LiveServer, store: Path
) -> None:
    listed = {d["name"]: d for d in tenants.get("/v1/datasets", headers=bearer(ALICE)).json()}
    assert set(listed) == {"alpha", "alpha-2", "alpha-broken"}
    error = listed["alpha-broken"]["error"]
    assert "truncated" in error and "<store>" in error and str(store) not in error
    one = tenants.get("/v1/datasets/alpha-broken", headers=bearer(ALICE))
    assert one.status_code == 409 and str(store) not in one.text and "<store>" in one.text
    admin = {d["name"]: d for d in tenants.get("/v1/datasets", headers=bearer(ADMIN)).json()}
    assert str(store) in admin["alpha-broken"]["error"]


def test_status_shows_the_store_path_to_the_admin_only(tenants: LiveServer, store: Path) -> None:
    for headers in ({}, bearer(ALICE)):
        status = tenants.get("/v1/status", headers=headers)
        assert status.status_code == 200
        assert status.json()["config"]["store"] is None
        assert str(store) not in status.text
        # server-wide figures would let one tenant watch another's activity
        assert status.json()["counters"] is None and status.json()["connections"] is None
    assert tenants.get("/v1/status", headers=bearer("not-a-token")).status_code == 401
    admin = tenants.get("/v1/status", headers=bearer(ADMIN)).json()
    assert admin["config"]["store"] == str(store)
    assert admin["config"]["auth"] == "tenants"
    assert isinstance(admin["counters"], dict) and isinstance(admin["connections"], int)


def test_metrics_want_the_admin_token_and_health_stays_open(tenants: LiveServer) -> None:
    tenants.run_job("alpha", ALICE)
    # /v1/jobs and /metrics read the data plane's snapshot, refreshed a few times a
    # second: wait (bounded) until it holds the job, then compare the two.
    wait_until(lambda: tenants.get("/v1/jobs", headers=bearer(ADMIN)).json(), 20, "job in /v1/jobs")
    assert tenants.get("/metrics").status_code == 401
    assert tenants.get("/metrics", headers=bearer("not-a-token")).status_code == 401
    refused = tenants.get("/metrics", headers=bearer(ALICE))
    assert refused.status_code == 403 and "admin token" in refused.json()["detail"]
    scraped = tenants.get("/metrics", headers=bearer(ADMIN))
    assert scraped.status_code == 200
    parsed = {f.name: f for f in text_string_to_metric_families(scraped.text)}
    assert {"tokenfeed_tokens_served", "tokenfeed_ready"} <= parsed.keys()
    # per-job series are labelled job_id: Prometheus keeps "job" for the scrape target
    served = parsed["tokenfeed_tokens_served"].samples
    job_ids = {j["id"] for j in tenants.get("/v1/jobs", headers=bearer(ADMIN)).json()}
    assert served and {s.labels["job_id"] for s in served} == job_ids
    assert all("job" not in s.labels for s in served)
    for path in ("/healthz", "/readyz", "/v1/limits"):
        assert tenants.get(path).status_code == 200, path


def test_jobs_and_datasets_still_want_a_token(tenants: LiveServer) -> None:
    assert tenants.get("/v1/jobs").status_code == 401
    assert tenants.get("/v1/datasets").status_code == 401
    assert tenants.get("/v1/datasets/alpha").status_code == 401
    assert tenants.get("/v1/jobs", headers=bearer(BOB)).json() == []


# -- open servers and the shared token --------------------------------------------------


def test_an_open_server_is_single_user_and_shows_everything(
    open_server: LiveServer, store: Path
) -> None:
    assert open_server.get("/v1/status").json()["config"]["store"] == str(store)
    assert open_server.get("/metrics").status_code == 200
    missing = open_server.get("/v1/datasets/gone")
    assert missing.status_code == 404 and str(store) in missing.json()["detail"]


def test_an_admin_token_on_an_open_server_keeps_paths_and_metrics(store: Path) -> None:
    with LiveServer(store, extra=["--admin-token", ADMIN]) as srv:
        assert srv.get("/v1/status").json()["config"]["store"] is None
        assert srv.get("/metrics").status_code == 401
        missing = srv.get("/v1/datasets/gone")
        assert missing.status_code == 404 and str(store) not in missing.text
        assert {d["name"] for d in srv.get("/v1/datasets").json()} >= {"alpha", "beta-secret"}
        assert srv.get("/v1/status", headers=bearer(ADMIN)).json()["config"]["store"] == str(store)
        assert srv.get("/metrics", headers=bearer(ADMIN)).status_code == 200


def test_a_shared_token_without_an_admin_scrapes_metrics(store: Path) -> None:
    with LiveServer(store, extra=["--token", SHARED]) as srv:
        assert srv.get("/metrics").status_code == 401
        assert srv.get("/metrics", headers=bearer(SHARED)).status_code == 200
        assert srv.get("/v1/status", headers=bearer(SHARED)).json()["config"]["store"] is None


def test_metrics_show_the_loops_busiest_turn(open_server: LiveServer) -> None:
    open_server.run_job("alpha")

    def loop() -> dict[tuple[str, str], float]:
        text = open_server.get("/metrics").text
        return {
            (s.name, s.labels.get("window", "")): s.value
            for f in text_string_to_metric_families(text)
            if f.name.startswith("tokenfeed_loop")
            for s in f.samples
        }

    figures = wait_until(
        lambda: (m := loop()).get(("tokenfeed_loop_busy_seconds_total", ""), 0) > 0 and m,
        10, "loop busy time in /metrics",
    )  # fmt: skip
    busiest = figures[("tokenfeed_loop_busiest_turn_seconds", "since_start")]
    assert 0 < busiest <= figures[("tokenfeed_loop_busy_seconds_total", "")]
    assert 0 <= figures[("tokenfeed_loop_busiest_turn_seconds", "recent")] <= busiest
