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
        "ram_batch nw=0",
        "memmap_pack16 nw=0",
        "ram per-sample nw=0",
        "memmap per-sample nw=0",
        "tokenfeed nw=2",
        "memmap_pack16 nw=2",
        "ram per-sample nw=2",
        "memmap per-sample nw=2",
        "tokenfeed x4",
        "ram_batch x4",
        "memmap_pack16 x4",
    ):
        s = systems[name]
        assert s["tokens_per_s"] > 0, name
        assert s["trainer_anon_mb"] > 0 and s["total_anon_mb"] >= s["trainer_anon_mb"], name
        assert s["total_cpu_s_per_gtok"] >= s["trainer_cpu_s_per_gtok"] > 0, name
        assert s["page_cache_mb"] > 0, name  # every system has read the store
    for name in ("tokenfeed nw=0", "tokenfeed nw=2", "tokenfeed x4"):
        assert systems[name]["server_cpu_s_per_gtok"] > 0 and systems[name]["server_anon_mb"] > 0
    for name in ("ram_batch x4", "memmap_pack16 x4"):  # four trainers' memory, summed
        assert systems[name]["total_anon_mb"] > 3 * systems[name]["trainer_anon_mb"], name
    for peer in ("litdata nw=0", "litdata nw=2", "streaming nw=0", "streaming nw=2"):
        s = systems[peer]
        assert "skipped" in s or s["tokens_per_s"] > 0, peer  # optional extra
    meta = result["meta"]
    assert len(meta["load_start"]["loadavg"]) == 3 and meta["cpus"] > 0
    assert "load average" in (out / "bench_loaders_quick.md").read_text()
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


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("system", "workers"), [("ram_batch", 0), ("memmap_pack", 0), ("memmap_pack", 2)]
)
def test_batched_baselines_serve_every_window_once_in_a_seeded_order(
    tmp_path: Path, system: str, workers: int
) -> None:
    # The careful baselines must do the work tokenfeed does (a global-shuffle pass, every
    # window once, int64 x/y shifted by one), or the comparison would flatter them.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import numpy as np

    from bench_loaders import make_store
    from systems import BUILDERS, shard_region, window_starts

    store = make_store(tmp_path, 1 << 19)
    path, n = shard_region(str(store), "bench")
    tokens = np.fromfile(path, dtype=np.uint16, count=n, offset=64)
    L, B = 64, 4
    passes = (n - 1) // L // B
    spec = {
        "system": system, "store": str(store), "dataset": "bench", "seq_len": L,
        "batch_size": B, "batches": passes, "seed": 3, "num_workers": workers,
        "prefetch": 2, "batches_per_item": 5,
    }  # fmt: skip
    batches = list(BUILDERS[system](spec))
    assert len(batches) == passes
    x = np.concatenate([b["input_ids"].numpy() for b in batches])
    y = np.concatenate([b["labels"].numpy() for b in batches])
    assert x.dtype == y.dtype == np.int64 and x.shape == (passes * B, L)
    starts = window_starts(n, L, 3)[: passes * B]
    assert len(set(starts.tolist())) == len(starts)  # no window twice
    assert not np.array_equal(starts, np.sort(starts))  # shuffled, not in file order
    want = tokens[starts[:, None] + np.arange(L + 1)].astype(np.int64)
    np.testing.assert_array_equal(x, want[:, :-1])
    np.testing.assert_array_equal(y, want[:, 1:])
