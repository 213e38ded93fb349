"""Package boundaries: what each distribution may import."""

from __future__ import annotations

import subprocess
import sys

import pytest


def imported_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return {name.split(".")[0] for name in out.stdout.split()}


def test_import_tokenfeed_is_light() -> None:
    mods = imported_after(
        "import tokenfeed, tokenfeed.transport.client, tokenfeed.plan, tokenfeed.dtypes"
    )
    assert "torch" not in mods
    assert not {"fastapi", "uvicorn", "starlette"} & mods


@pytest.mark.parametrize(
    "module",
    ["cli", "server", "http.app", "dataplane.plane", "store", "prepare", "config"],
)
def test_server_never_imports_torch(module: str) -> None:
    mods = imported_after(f"import tokenfeed_server.{module}")
    assert "torch" not in mods


def test_torch_parts_are_lazy() -> None:
    mods = imported_after("import tokenfeed\ntokenfeed.TokenFeedDataset")
    assert "torch" in mods
