"""Each dataset's health over HTTP: ``/readyz``, ``/v1/datasets`` and ``/metrics`` say the
same, for an empty store, one broken dataset beside a good one, and every one broken
(real server processes over local stores); and how a degraded or unavailable dataset is
shown, from the health record the piece cache keeps (fed here directly).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from live_server import LiveServer, tenants_toml
from shard_data import BYTE
from tokenfeed_server.http.dataset_health import DatasetHealthView
from tokenfeed_server.http.models import BrokenDatasetView, DatasetView
from tokenfeed_server.http.routes.datasets import view
from tokenfeed_server.store import write_dataset
from tokenfeed_server.store.health import StorageHealth

pytestmark = pytest.mark.network

TENANT = "health-tenant-token-0123456789ab"
ADMIN = "health-admin-token-0123456789abc"
DOCS = [np.arange(n, dtype=np.uint16) % 256 for n in range(100, 2100, 100)]


def _break(root: Path, name: str) -> None:
    shard = next((root / name).glob("shard-*.bin"))
    shard.write_bytes(shard.read_bytes()[:32])  # a truncated header: refused at start-up


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _statuses(srv: LiveServer, token: str | None = None) -> dict[tuple[str, str], float]:
    """The ``tokenfeed_dataset_status`` series: ``{(dataset, status): value}``."""
    text = srv.get("/metrics", headers=_bearer(token) if token else {}).text
    families = text_string_to_metric_families(text)
    [family] = [f for f in families if f.name == "tokenfeed_dataset_status"]
    return {(s.labels["dataset"], s.labels["status"]): s.value for s in family.samples}


def test_an_empty_store_is_ready(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    with LiveServer(tmp_path / "store") as srv:
        ready = srv.get("/readyz")
        assert ready.status_code == 200
        assert ready.json() == {
            "status": "ready", "zmq": srv.zmq, "reason": None, "not_serving": [],
            "not_serving_count": 0,
        }  # fmt: skip
        assert srv.get("/v1/datasets").json() == []
        metrics = {f.name: f for f in text_string_to_metric_families(srv.get("/metrics").text)}
        # a local store: the storage series exist, at zero
        errors = {s.labels["kind"]: s.value for s in metrics["tokenfeed_storage_errors"].samples}
        assert errors == {"unreachable": 0, "missing": 0, "damaged": 0, "exhausted": 0}
        assert metrics["tokenfeed_storage_retries"].samples[0].value == 0
        assert metrics["tokenfeed_storage_wait_seconds"].samples[0].value == 0


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A tenants server: ``good`` and ``broken`` (the tenant's), ``other-broken`` (not)."""
    root = tmp_path_factory.mktemp("store")
    for name in ("good", "broken", "other-broken"):
        write_dataset(root, name, DOCS, tokenizer=BYTE, shuffle_seed=0)
    _break(root, "broken")
    _break(root, "other-broken")
    tenants = tmp_path_factory.mktemp("conf") / "tenants.toml"
    tenants.write_text(tenants_toml(ADMIN, {"t": (TENANT, ["good", "broken"])}))
    with LiveServer(root, extra=["--tenants", str(tenants)]) as srv:
        yield srv


def test_ready_while_one_serves_naming_those_that_do_not(mixed: LiveServer) -> None:
    admin = mixed.get("/readyz", headers=_bearer(ADMIN))
    assert admin.status_code == 200 and admin.json()["status"] == "ready"
    assert admin.json()["not_serving"] == ["broken", "other-broken"]
    assert admin.json()["not_serving_count"] == 2
    # names only to who may see them; a probe without a token (or a wrong one) gets the count
    tenant = mixed.get("/readyz", headers=_bearer(TENANT)).json()
    assert tenant["not_serving"] == ["broken"] and tenant["not_serving_count"] == 2
    for headers in ({}, _bearer("not-a-token")):
        anonymous = mixed.get("/readyz", headers=headers)
        assert anonymous.status_code == 200
        assert anonymous.json()["not_serving"] == [] and anonymous.json()["not_serving_count"] == 2


def test_datasets_show_status_error_and_since(mixed: LiveServer) -> None:
    listed = {d["name"]: d for d in mixed.get("/v1/datasets", headers=_bearer(ADMIN)).json()}
    good, broken = listed["good"], listed["broken"]
    assert good["ok"] is True and good["status"] == "ok"
    assert good["error"] is None and good["since"] is None and good["objects"] == []
    assert broken["ok"] is False and broken["status"] == "unavailable"
    assert "truncated" in broken["error"] and broken["objects"] == []
    assert broken["since"] is not None
    assert mixed.get("/v1/datasets/good", headers=_bearer(ADMIN)).json() == good
    # the tenant's view: its datasets only, the store's path left out
    mine = mixed.get("/v1/datasets", headers=_bearer(TENANT)).json()
    assert [d["name"] for d in mine] == ["broken", "good"]
    assert "<store>" in mine[0]["error"]
    statuses = _statuses(mixed, ADMIN)
    assert statuses[("good", "ok")] == 1 and statuses[("good", "unavailable")] == 0
    assert statuses[("broken", "unavailable")] == 1 and statuses[("broken", "ok")] == 0


def test_not_ready_when_every_dataset_is_broken(tmp_path: Path) -> None:
    root = tmp_path / "store"
    for name in ("a", "b"):
        write_dataset(root, name, DOCS, tokenizer=BYTE, shuffle_seed=0)
        _break(root, name)
    with LiveServer(root) as srv:
        answer = srv.get("/readyz")
        assert answer.status_code == 503
        body = answer.json()
        assert body["status"] == "not ready" and body["zmq"] is None
        assert body["not_serving"] == ["a", "b"] and body["not_serving_count"] == 2
        assert "no dataset serves" in body["reason"]
        assert srv.get("/healthz").status_code == 200  # alive all the same
        assert _statuses(srv)[("a", "unavailable")] == 1


# -- degraded and unavailable, from the health record -------------------------------------


class _Store:
    """What :class:`DatasetHealthView` reads of a Store: summaries, get, the cache."""

    def __init__(self, health: StorageHealth) -> None:
        self.cache = SimpleNamespace(health=health)
        self.objects = SimpleNamespace(url=lambda: "s3://b/p")

    def summaries(self) -> list[dict[str, Any]]:
        summary = {
            "ok": True, "fingerprint": "f" * 32, "tokens": 10, "documents": 1,
            "dtype": "uint16", "shards": 2,
            "tokenizer": {"kind": "byte", "vocab_size": 257, "eos_id": 256, "hash": "h"},
            "shuffle_seed": 0, "format_version": 2, "created": "2026-01-01T00:00:00+00:00",
        }  # fmt: skip
        return [
            {**summary, "name": "web", "version": "f" * 32, "versions_in_use": ["e" * 32]},
            {**summary, "name": "code"},
            {**summary, "name": "books"},
        ]

    def get(self, name: str) -> None:
        raise AssertionError(f"{name} is open: no open error to look at")


def test_a_degraded_dataset_serves_an_unavailable_one_names_its_objects() -> None:
    health = StorageHealth(clock=lambda: 1000.0)
    health.retrying("code", "connection refused")
    url = "s3://b/p/web/shard-1.bin"
    health.failed("web", "missing", f"{url}: not in the bucket", url)
    entries = {e.name: e for e in DatasetHealthView(_Store(health)).entries()}  # type: ignore[arg-type]
    admin = SimpleNamespace(admin=True)
    state = SimpleNamespace(redact=lambda text: text.replace("s3://b/p", "<store>"))
    web = view(entries["web"], state, admin)  # type: ignore[arg-type]
    assert isinstance(web, DatasetView)
    assert (web.ok, web.status, web.since) == (False, "unavailable", 1000.0)
    assert [(o.url, o.kind) for o in web.objects] == [(url, "missing")]
    assert web.version == "f" * 32 and web.versions_in_use == ["e" * 32]
    assert web.fix is not None and web.fix.startswith(
        "repair it with tokenfeed-server inspect web --store s3://b/p --verify --repair"
    )
    code = view(entries["code"], state, admin)  # type: ignore[arg-type]
    assert (code.ok, code.status, code.error) == (True, "degraded", "connection refused")
    assert code.fix is None  # nothing to repair: storage is retried
    books = view(entries["books"], state, admin)  # type: ignore[arg-type]
    assert (books.ok, books.status, books.error, books.objects) == (True, "ok", None, [])
    tenant = view(entries["web"], state, SimpleNamespace(admin=False))  # type: ignore[arg-type]
    assert tenant.objects[0].url == "<store>/web/shard-1.bin"
    assert tenant.fix is not None and "--store <store> " in tenant.fix
    assert "<store>" in (tenant.error or "")
    health.fetched("web", url)
    assert DatasetHealthView(_Store(health)).entry("web").status == "ok"  # type: ignore[arg-type, union-attr]
    assert not isinstance(web, BrokenDatasetView)
