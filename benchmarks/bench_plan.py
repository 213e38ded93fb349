"""How fast the plan turns stream positions into window ids, and what memory it needs.

Side by side with what a user would otherwise do: materialize a full numpy permutation of
the epoch (``np.random.default_rng(seed).permutation(W)``), which costs 8 bytes per window
and is impossible at 10**12 tokens.

    .venv/bin/python benchmarks/bench_plan.py           # full run
    .venv/bin/python benchmarks/bench_plan.py --quick   # a few seconds, for CI
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from tokenfeed.plan import Plan, default_block_sizes, permute


def measure(fn: Callable[[], object], repeats: int) -> tuple[float, int]:
    """Median seconds of ``fn`` over ``repeats`` runs, and its tracemalloc peak (bytes)."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    tracemalloc.start()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return statistics.median(times), peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer batches and repeats (CI)")
    ap.add_argument("--batch", type=int, default=4096, help="positions per vectorized call")
    args = ap.parse_args()
    batches = 20 if args.quick else 200
    repeats = 3 if args.quick else 7
    b = args.batch

    rows: list[tuple[str, str, int, float, int]] = []

    def bench_windows(label: str, plan: Plan, start: int) -> None:
        starts = [start + i * b for i in range(batches)]

        def run() -> None:
            for s in starts:
                plan.windows(np.arange(s, s + b, dtype=np.int64))

        sec, peak = measure(run, repeats)
        rows.append(
            (
                label,
                f"{plan.n_tokens:.0e} tok, L={plan.seq_len}",
                plan.n_windows,
                batches * b / sec,
                peak,
            )
        )

    def bench_permute(label: str, n: int) -> None:
        rng = np.random.default_rng(0)
        idx = [rng.integers(0, n, size=b, dtype=np.int64) for _ in range(batches)]

        def run() -> None:
            for x in idx:
                permute(x, n, 1234, 5)

        sec, peak = measure(run, repeats)
        rows.append((label, "", n, batches * b / sec, peak))

    for n_tokens in (10**6, 10**12):
        for seq_len in (1, 2048):
            plan = Plan(n_tokens=n_tokens, seq_len=seq_len, batch_size=b, seed=1234)
            # start mid-stream, epochs later: time must not depend on the position
            bench_windows("Plan.windows", plan, 37 * plan.n_windows + 11)
    # The block shuffle (regions of one 2**26-token shard's windows, 4 per block); see
    # bench_block_shuffle.py for block vs global side by side and the locality trade-off.
    for n_tokens in (10**12,):
        r, k = default_block_sizes([1 << 26] * (n_tokens >> 26), 2048)
        plan = Plan(
            n_tokens, 2048, b, seed=1234, shuffle="block", region_windows=r, block_regions=k
        )
        bench_windows("Plan.windows (block)", plan, 37 * plan.n_windows + 11)
    for n in (10**6, 10**12):
        bench_permute("permute", n)
    # Worst case for cycle-walking: the Feistel domain is almost 2x the window count.
    bench_permute("permute (worst walk)", 2**38 + 1)
    # A batch straddling an epoch boundary (per-element round keys).
    plan = Plan(n_tokens=10**6, seq_len=1, batch_size=b, seed=1234)
    w = plan.n_windows
    rows.append(("Plan.windows (straddle)", "1e+06 tok, L=1", w, 0.0, 0))

    def straddle() -> None:
        for i in range(batches):
            s = (i + 1) * w - b // 2
            plan.windows(np.arange(s, s + b, dtype=np.int64))

    sec, peak = measure(straddle, repeats)
    rows[-1] = (*rows[-1][:3], batches * b / sec, peak)

    # Baseline: a materialized numpy permutation of one epoch, amortized per window.
    for n in (10**6, 10**12):
        if n * 8 > 2**30:
            rows.append(("numpy permutation", "(baseline)", n, float("nan"), n * 8))
            continue

        def materialize(n: int = n) -> object:
            return np.random.default_rng(0).permutation(n)

        sec, peak = measure(materialize, repeats)
        rows.append(("numpy permutation", "(baseline)", n, n / sec, peak))

    print(f"batch = {b} positions, {batches} batches x median of {repeats} runs, one core\n")
    print(
        f"| {'what':<24} | {'dataset':<18} | {'windows':>16} | {'Mindex/s':>9} | {'peak mem':>12} |"
    )
    print(f"| {'-' * 24} | {'-' * 18} | {'-' * 16}:| {'-' * 9}:| {'-' * 12}:|")
    for label, ds, n, rate, peak in rows:
        mem = f"{peak / 2**20:.2f} MiB" if peak < 2**40 else f"{peak / 2**40:.0f} TiB"
        rate_s = "infeasible" if rate != rate else f"{rate / 1e6:.1f}"
        print(f"| {label:<24} | {ds:<18} | {n:>16,} | {rate_s:>9} | {mem:>12} |")


if __name__ == "__main__":
    main()
