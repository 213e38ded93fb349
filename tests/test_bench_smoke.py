"""The loader benchmark's quick mode runs end to end (what CI runs; it asserts no speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.network]

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(420)  # about a minute here; a loaded CI machine must not fail it
def test_quick_mode_writes_every_system(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_loaders.py"),
            "--quick",
            "--out",
            str(out),
            "--stores",
            str(tmp_path / "stores"),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((out / "bench_loaders_quick.json").read_text())
    systems = result["systems"]
    for name in (
        "tokenfeed nw=0",
        "tokenfeed nw=2",
        "memmap nw=0",
        "memmap nw=2",
        "ram nw=0",
        "ram nw=2",
        "tokenfeed 4 clients nw=0",
        "memmap 4 clients nw=0",
        "ram 4 clients nw=0",
    ):
        assert systems[name]["tokens_per_s"] > 0, name
        assert systems[name]["trainer_pss_mb"] > 0, name
    for peer in ("litdata nw=0", "litdata nw=2", "streaming nw=0", "streaming nw=2"):
        s = systems[peer]
        assert "skipped" in s or s["tokens_per_s"] > 0, peer  # optional extra
    assert set(result["memory_vs_store_size"]) >= {"tokenfeed nw=0", "tokenfeed nw=2"}
    assert (out / "bench_loaders_quick.png").exists()
