"""The HTTP API's OpenAPI schema, exercised by schemathesis against a running server."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from live_server import LiveServer
from tokenfeed_server.auth import token_digest
from tokenfeed_server.store import TokenizerInfo, write_dataset

pytestmark = [pytest.mark.network, pytest.mark.slow]

TOKEN = "schema-tenant-token-0123456789"
CHECKS = "not_a_server_error,response_schema_conformance,content_type_conformance"


def schemathesis(url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or "st"
    return subprocess.run(
        [st, "run", url, "--max-examples", "25", "--checks", CHECKS, "--seed", "1", *extra],
        cwd=tempfile.gettempdir(),  # schemathesis writes a .schemathesis/ folder there
        capture_output=True,
        check=False,
        text=True,
        timeout=170,
    )


@pytest.mark.timeout(400)
def test_no_server_errors_open_and_with_tenants(tmp_path: Path) -> None:
    write_dataset(
        tmp_path / "store",
        "alpha",
        [np.arange(5000, dtype=np.uint16) % 256],
        tokenizer=TokenizerInfo(kind="byte", vocab_size=257, eos_id=256),
        shuffle_seed=0,
    )
    with LiveServer(tmp_path / "store") as srv:
        result = schemathesis(srv.http + "/openapi.json")
        assert result.returncode == 0, result.stdout[-3000:]
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        f'[[tenant]]\nname = "t"\ntoken_sha256 = "{token_digest(TOKEN)}"\ndatasets = ["alpha"]\n'
    )
    with LiveServer(tmp_path / "store", extra=["--tenants", str(tenants)]) as srv:
        result = schemathesis(srv.http + "/openapi.json", "-H", f"Authorization: Bearer {TOKEN}")
        assert result.returncode == 0, result.stdout[-3000:]
