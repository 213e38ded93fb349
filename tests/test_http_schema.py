"""The HTTP API keeps the contract it publishes at /openapi.json, against running servers.

Two checks over servers that have real datasets (one broken), jobs and a tenants file:
schemathesis fuzzes every operation (no server error; every status code, content type
and body as declared), and every real answer, including the ones fuzzing rarely
reaches (a dataset that exists, a job list that is not empty), is validated against
the schema published for its status code.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from jsonschema import Draft202012Validator

from live_server import LiveServer, tenants_toml
from shard_data import BYTE
from tokenfeed_server.store import write_dataset

pytestmark = [pytest.mark.network, pytest.mark.slow]

TENANT = "schema-tenant-token-0123456789"
ADMIN = "schema-admin-token-9876543210"
CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,"
    "response_schema_conformance"
)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    docs = [np.arange(n, dtype=np.uint16) % 256 for n in range(200, 4200, 200)]
    for name in ("alpha", "beta", "broken"):
        write_dataset(root, name, docs, tokenizer=BYTE, shuffle_seed=0)
    shard = next((root / "broken").glob("shard-*.bin"))
    shard.write_bytes(shard.read_bytes()[:32])  # listed with ok=false and its error
    return root


@pytest.fixture(scope="module")
def open_server(store: Path) -> Iterator[LiveServer]:
    with LiveServer(store) as srv:
        srv.run_job("alpha", None)
        yield srv


@pytest.fixture(scope="module")
def tenants_server(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tenants = tmp_path_factory.mktemp("conf") / "tenants.toml"
    tenants.write_text(tenants_toml(ADMIN, {"t": (TENANT, ["alpha", "broken"])}))
    with LiveServer(store, extra=["--tenants", str(tenants)]) as srv:
        srv.run_job("alpha", TENANT)
        yield srv


def schemathesis(url: str, report: Path, *extra: str) -> dict[str, Any]:
    """Run ``st run`` on ``url``; return its JSON report (the test reads the verdict)."""
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or "st"
    args = ["--checks", CHECKS, "--max-examples", "15", "--seed", "1"]
    args += ["--report", "json", "--report-json-path", str(report)]
    result = subprocess.run(
        [st, "run", url, *args, *extra],
        cwd=tempfile.gettempdir(),  # schemathesis writes a .schemathesis/ folder there
        capture_output=True,
        check=False,
        text=True,
        timeout=170,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    data: dict[str, Any] = json.loads(report.read_text())
    return data


@pytest.mark.timeout(400)
@pytest.mark.parametrize("caller", ["open", "admin", "tenant"])
def test_schemathesis_finds_no_nonconforming_answer(
    caller: str, open_server: LiveServer, tenants_server: LiveServer, tmp_path: Path
) -> None:
    srv = open_server if caller == "open" else tenants_server
    token = {"open": None, "admin": ADMIN, "tenant": TENANT}[caller]
    headers = ["-H", f"Authorization: Bearer {token}"] if token else []
    report = schemathesis(srv.http + "/openapi.json", tmp_path / "report.json", *headers)
    assert report["complete"] and report["failures"] == [] and report["errors"] == []
    ops = report["operations"]
    assert ops["tested"] == ops["total"] >= 8, ops
    assert report["test_cases"]["without_checks"] == 0


@pytest.mark.timeout(120)
def test_every_real_answer_matches_its_published_schema(
    open_server: LiveServer, tenants_server: LiveServer
) -> None:
    spec = open_server.get("/openapi.json").json()
    calls: list[tuple[LiveServer, str, str | None, int]] = [
        (open_server, "/healthz", None, 200),
        (open_server, "/readyz", None, 200),
        (open_server, "/v1/datasets", None, 200),
        (open_server, "/v1/datasets/alpha", None, 200),
        (open_server, "/v1/datasets/broken", None, 409),
        (open_server, "/v1/datasets/missing", None, 404),
        (open_server, "/v1/datasets/.hidden", None, 400),
        (open_server, "/v1/jobs", None, 200),
        (open_server, "/v1/limits", None, 200),
        (open_server, "/v1/status", None, 200),
        (tenants_server, "/v1/jobs", None, 401),
        (tenants_server, "/v1/jobs", TENANT, 200),
        (tenants_server, "/v1/datasets", TENANT, 200),
        (tenants_server, "/v1/datasets/beta", TENANT, 404),
        (tenants_server, "/v1/status", TENANT, 200),
        (tenants_server, "/v1/status", ADMIN, 200),
        (tenants_server, "/metrics", TENANT, 403),
        (tenants_server, "/metrics", None, 401),
    ]
    for srv, path, token, code in calls:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        response = httpx.get(srv.http + path, headers=headers, timeout=10.0)
        assert response.status_code == code, (path, token, response.text)
        body = response.json()
        template = "/v1/datasets/{name}" if path.startswith("/v1/datasets/") else path
        declared = spec["paths"][template]["get"]["responses"][str(code)]
        schema = dict(declared["content"]["application/json"]["schema"])
        schema["components"] = spec["components"]  # so that "#/components/..." resolves
        errors = [e.message for e in Draft202012Validator(schema).iter_errors(body)]
        assert not errors, (path, code, errors)
        if path in ("/v1/jobs", "/v1/datasets") and code == 200:
            assert body, f"{path} is empty: the schema check above proved nothing"
