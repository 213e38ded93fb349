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


def _run_bench(script: str, *args: str, timeout: float) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.timeout(300)
def test_mixture_bench_quick_measures_every_row_and_the_loader_pair() -> None:
    math_out = _run_bench("bench_mixture.py", "--quick", timeout=280)
    rates = [
        float(line.split("|")[3])
        for line in math_out.splitlines()
        if line.startswith("| locate") or line.startswith("| Plan.windows")
    ]
    assert len(rates) == 6 and all(r > 0 for r in rates), math_out
    loader_out = _run_bench("bench_mixture.py", "--loader", "--quick", timeout=280)
    assert "mixture / single" in loader_out, loader_out


@pytest.mark.timeout(300)
def test_block_shuffle_bench_quick_prints_both_tables() -> None:
    out = _run_bench("bench_block_shuffle.py", "--quick", timeout=280)
    assert "| global" in out and "| block" in out, out


@pytest.mark.timeout(420)
def test_s3_bench_quick_writes_every_measurement_and_ratio(tmp_path: Path) -> None:
    _run_bench("bench_s3.py", "--quick", "--out", str(tmp_path), timeout=400)
    result = json.loads((tmp_path / "bench_s3_quick.json").read_text())
    for label, m in result["measurements"].items():
        assert m["tokens_per_s"] > 0, label
    assert set(result["ratios"]) and all(v > 0 for v in result["ratios"].values())
