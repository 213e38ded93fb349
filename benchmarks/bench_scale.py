"""Cost at scale: terabyte datasets, 150,000 shards, 1,000 datasets, 256 jobs, 4,096
connections, a 64-source mixture, each against one real ``tokenfeed-server serve``.

The datasets are sparse synthetic files of the real format (``synthetic_store.py``): a
20 TB dataset costs a few MB of disk, so listing, opening and serving it are measured at
the sizes people use. Every scenario starts a fresh server and reports, from outside:

* ``list_s``: from starting the server until ``/v1/datasets`` lists the datasets;
* ``first_batch_s``: hello plus the first global-shuffle batch (8 x 2048 tokens);
* ``anon_mb``: the server's anonymous resident memory after serving (page cache apart);
* ``open_files``: descriptors the server holds after serving;
* ``cpu_ms_per_batch``: server CPU per batch over a run of batches;
* ``busiest_turn_ms``: the data plane loop's busiest turn (``/metrics``).

Targets (issue 23, on a 2-core box): a 20 TB / 150,000-shard dataset listed in 2 s and
first batch in 2 s; anonymous memory at most 150 MB + 5 MB per TB of local data; open
files bounded by ``--max-open-shards``; 1,000 datasets listed in 1 s; 256 jobs and 4,096
connections at CPU per batch within 1.2x of one job's; no loop turn over 50 ms.

    .venv/bin/python benchmarks/bench_scale.py                 # everything (~10 min)
    .venv/bin/python benchmarks/bench_scale.py --only size     # the dataset sizes
    .venv/bin/python benchmarks/bench_scale.py --quick         # small sizes, for CI
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale_probe import Driver, anon_mb, busiest_turn_s, cpu_s, open_files, wait_listed
from synthetic_store import make_dataset
from tokenfeed.mixture import Mixture
from tokenfeed.protocol import JobSpec
from tokenfeed_server.launch import ServerProcess
from tokenfeed_server.store import TokenizerInfo, write_dataset

TB = 10**12
SEQ, BATCH = 2048, 8
SHARD_BYTES = 20 * TB // 150_000  # the 20 TB in 150,000 shards: ~133 MB each
Row = dict[str, Any]


def serve(
    store: Path, names: Sequence[str], extra: Sequence[str] = ()
) -> tuple[ServerProcess, float]:
    """A started server on ``store`` and the seconds until it listed ``names``."""
    t0 = time.perf_counter()
    srv = ServerProcess(store, extra=list(extra)).start(timeout=600)
    listed = wait_listed(srv.http, names) + (time.perf_counter() - t0)
    return srv, listed


def measure(
    srv: ServerProcess,
    drive: Callable[[Driver], int],
    setup: Callable[[Driver], int] | None = None,
) -> Row:
    """Run ``setup`` (attach and warm up; its CPU reported per connection it opened),
    then ``drive`` (returning batches served; its CPU is the per-batch figure), and read
    the server's figures while the connections are still open."""
    pid = srv.proc.pid
    driver = Driver(srv.zmq)
    try:
        extra: Row = {}
        if setup is not None:
            cpu0 = cpu_s(pid)
            setup(driver)
            extra["setup_cpu_ms_per_conn"] = round(
                1000 * (cpu_s(pid) - cpu0) / max(1, len(driver.conns)), 3
            )
        cpu0 = cpu_s(pid)
        batches = drive(driver)
        cpu = cpu_s(pid) - cpu0
        driver.drain()
        time.sleep(0.6)  # the snapshot behind /metrics refreshes every 0.5 s
        t0 = time.perf_counter()
        httpx.get(f"{srv.http}/v1/datasets", timeout=60).raise_for_status()
        row = {
            "list_call_s": round(time.perf_counter() - t0, 3),
            "anon_mb": round(anon_mb(pid), 1),
            "open_files": open_files(pid),
            "cpu_ms_per_batch": round(1000 * cpu / max(1, batches), 3),
            "busiest_turn_ms": round(1000 * busiest_turn_s(srv.http), 1),
            **extra,
        }
    finally:
        driver.close()
    return row


def first_batch(spec: JobSpec, batches: int) -> Callable[[Driver], int]:
    """Attach one connection, time hello plus the first batch, then pump ``batches``."""

    def drive(driver: Driver) -> int:
        t0 = time.perf_counter()
        driver.attach(spec, 1)
        driver.pump(1)
        drive.first_s = time.perf_counter() - t0  # type: ignore[attr-defined]
        return 1 + driver.pump(batches)

    return drive


def size_rows(root: Path, sizes_tb: Sequence[float], batches: int) -> list[Row]:
    """One local dataset per size, shards of the issue's ~133 MB."""
    rows = []
    for tb in sizes_tb:
        store = root / f"size-{tb}"
        shards = max(1, round(tb * TB / SHARD_BYTES))
        t0 = time.perf_counter()
        make_dataset(store, "big", shards=shards, apparent_bytes=int(tb * TB))
        made = time.perf_counter() - t0
        srv, listed = serve(store, ["big"])
        try:
            drive = first_batch(JobSpec("big", SEQ - 1, BATCH, 0, 1), batches)
            row = measure(srv, drive)
        finally:
            srv.stop()
        rows.append({
            "scenario": f"{tb:g} TB local", "shards": shards, "made_s": round(made, 1),
            "list_s": round(listed, 2), "first_batch_s": round(drive.first_s, 3),  # type: ignore[attr-defined]
            **row, "anon_target_mb": round(150 + 5 * tb),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def tiny_datasets(store: Path, n: int, prefix: str = "ds") -> list[str]:
    """``n`` small real datasets (written by the store writer) in ``store``."""
    rng = np.random.default_rng(0)
    names = [f"{prefix}-{i:04d}" for i in range(n)]
    tok = TokenizerInfo(kind="synthetic", vocab_size=50_257, eos_id=50_256)
    for i, name in enumerate(names):
        docs = [rng.integers(0, 50_000, 40_000, dtype=np.uint16) for _ in range(2)]
        write_dataset(store, name, docs, shuffle_seed=i, tokenizer=tok)
    return names


def many_datasets_row(root: Path, n: int) -> Row:
    """``n`` datasets in one store: seconds to list them all."""
    store = root / "many"
    names = tiny_datasets(store, n)
    srv, listed = serve(store, names)
    try:
        row = measure(srv, first_batch(JobSpec(names[-1], SEQ - 1, BATCH, 0, 1), 50))
    finally:
        srv.stop()
    return {"scenario": f"{n} datasets", "list_s": round(listed, 2), **row}


def jobs_rows(root: Path, jobs: int, conns: int, batches: int) -> list[Row]:
    """CPU per batch of one job on one connection, then of ``jobs`` jobs on ``conns``
    connections in all, on one dataset of ~1 GB apparent size."""
    store = root / "jobs"
    make_dataset(store, "web", shards=8, apparent_bytes=8 * SHARD_BYTES)
    rows = []
    for n_jobs, n_conns in ((1, 1), (jobs, conns)):
        caps = ["--max-jobs", str(max(256, jobs)), "--max-jobs-per-tenant", str(max(256, jobs)),
                "--max-connections", str(max(4096, conns)),
                "--max-connections-per-tenant", str(max(4096, conns))]  # fmt: skip
        srv, _ = serve(store, ["web"], extra=caps)
        per_job = max(1, n_conns // n_jobs)

        def setup(driver: Driver, n_jobs: int = n_jobs, per_job: int = per_job) -> int:
            for seed in range(n_jobs):
                driver.attach(JobSpec("web", SEQ - 1, BATCH, seed, 1), per_job)
            return driver.pump(min(batches, n_jobs * per_job))  # warm every job

        # Attaching 4,096 connections is a one-time cost, reported per connection apart;
        # the per-batch figure is the serving that follows (as for the one job).
        try:
            row = measure(srv, lambda driver: driver.pump(batches), setup)
        finally:
            srv.stop()
        rows.append({"scenario": f"{n_jobs} jobs, {n_jobs * per_job} conns", **row})
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["cpu_ms_per_batch"]
    rows[-1]["cpu_vs_one_job"] = round(rows[-1]["cpu_ms_per_batch"] / base, 2)
    return rows


def mixture_row(root: Path, sources: int, batches: int) -> Row:
    """A mixture of ``sources`` datasets: first batch and the loop's busiest turn."""
    store = root / "mix"
    names = tiny_datasets(store, sources, prefix="src")
    srv, listed = serve(store, names)
    # big period tables: weights summing to 64,256 per period (65,536 at most)
    weights = {name: 500 + 16 * i for i, name in enumerate(names)}
    mix = Mixture(weights)
    spec = JobSpec("", SEQ - 1, BATCH, 0, 1, sources=tuple(names), schedule=mix.to_wire())
    try:
        drive = first_batch(spec, batches)
        row = measure(srv, drive)
    finally:
        srv.stop()
    first = round(drive.first_s, 3)  # type: ignore[attr-defined]
    return {"scenario": f"{sources}-source mixture", "list_s": round(listed, 2),
            "first_batch_s": first, **row}  # fmt: skip


def table(rows: list[Row]) -> str:
    """The rows as a markdown table (every column any row has)."""
    cols: list[str] = []
    for row in rows:
        cols += [c for c in row if c not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in cols) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--only", default="", help="comma list of: size,datasets,jobs,mixture")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(","))) or {"size", "datasets", "jobs", "mixture"}
    quick = args.quick
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if "size" in only:
            rows += size_rows(
                root, (0.01, 0.1) if quick else (0.01, 1, 10, 20), 20 if quick else 200
            )
        if "datasets" in only:
            rows.append(many_datasets_row(root, 20 if quick else 1000))
            print(json.dumps(rows[-1]), flush=True)
        if "jobs" in only:
            rows += jobs_rows(
                root, 8 if quick else 256, 32 if quick else 4096, 200 if quick else 16384
            )
        if "mixture" in only:
            rows.append(mixture_row(root, 4 if quick else 64, 20 if quick else 200))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
