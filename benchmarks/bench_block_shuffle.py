"""The block shuffle against the global one: what it costs to compute, what it buys in
locality, and what it gives up in mixing.

(a) ``Plan.windows`` rate, rows/s, on 8192-row blocks of consecutive positions (what the
    server's WindowBlocks cache computes), block vs global on the same dataset; target:
    block within 2x of global.
(b) The trade-off, on a dataset of 64 regions of 4096 windows with 1, 4 (the default)
    and 16 regions per block: how far apart in the stream two windows of one region land
    (median, p99, max over random pairs, epoch 0), and how many distinct regions (~
    shards) a stretch of 1000 or 8192 consecutive positions touches, in each mode.

    .venv/bin/python benchmarks/bench_block_shuffle.py            # ~20 s
    .venv/bin/python benchmarks/bench_block_shuffle.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from tokenfeed.plan import Plan, default_block_sizes

ROWS = 8192  # positions per windows() call, as the server's WindowBlocks


def timed(plan: Plan, blocks: list[np.ndarray]) -> float:
    """CPU seconds of ``plan.windows`` over ``blocks``: process time, not wall time, so
    that other processes sharing the cores do not count (numpy runs this on one core)."""
    t0 = time.process_time()
    for pos in blocks:
        plan.windows(pos)
    return time.process_time() - t0


def rates(glob: Plan, block: Plan, batches: int, repeats: int) -> tuple[float, float, float]:
    """Median rows/s of ``windows`` for each plan over ``batches`` consecutive 8192-row
    blocks from mid-stream (epoch 37: the time must not depend on the position), runs of
    the two interleaved; and the median of the per-run ratios block/global."""
    start = 37 * glob.n_windows + 11
    blocks = [np.arange(start + i * ROWS, start + (i + 1) * ROWS) for i in range(batches)]
    timed(glob, blocks[:3])  # warm-up
    timed(block, blocks[:3])
    g_rates, b_rates = [], []
    for _ in range(repeats):
        g_rates.append(batches * ROWS / timed(glob, blocks))
        b_rates.append(batches * ROWS / timed(block, blocks))
    ratio = statistics.median(b / g for b, g in zip(b_rates, g_rates, strict=True))
    return statistics.median(g_rates), statistics.median(b_rates), ratio


def spans_cost(plan: Plan, calls: int) -> tuple[float, float]:
    """Microseconds per ``block_spans(position, 2)`` call (the prefetcher's question): at
    random positions (a new block each time), and again at a position of the same block."""
    rng = np.random.default_rng(0)
    positions = rng.integers(0, 10**15, size=calls).tolist()
    t0 = time.process_time()
    for p in positions:
        plan.block_spans(p, 2)
    cold = (time.process_time() - t0) / calls * 1e6
    t0 = time.process_time()
    for i in range(calls):
        plan.block_spans(positions[0] + i % 2, 2)
    return cold, (time.process_time() - t0) / calls * 1e6


def speed_table(batches: int, repeats: int) -> None:
    shard_tokens = 1 << 26  # the writer's default shard size
    cases: list[tuple[str, int, int, int, int]] = []
    for n_tokens in (10**12, 10**9):
        shards = [shard_tokens] * (n_tokens // shard_tokens) + [n_tokens % shard_tokens]
        r, k = default_block_sizes([s for s in shards if s], 2048)
        cases.append((f"{n_tokens:.0e} tok, default sizes", n_tokens, 2048, r, k))
    cases.append(("1e+12 tok, small blocks", 10**12, 2048, 64, 4))
    cases.append(("1e+12 tok, 1-window blocks", 10**12, 2048, 1, 1))
    print(
        f"(a) Plan.windows on {ROWS}-row blocks: {batches} blocks, median of {repeats} "
        "interleaved runs, CPU time of one core\n"
    )
    print(
        f"| {'dataset':<28} | {'R (windows)':>11} | {'K':>3} | {'global Mrow/s':>13} "
        f"| {'block Mrow/s':>12} | {'block/global':>12} | {'block_spans us new/same':>23} |"
    )
    print(f"| {'-' * 28} | {'-' * 10}:| --:| {'-' * 12}:| {'-' * 11}:| {'-' * 11}:| {'-' * 22}:|")
    plans = [
        (
            Plan(n_tokens, seq_len, 1, seed=1234),
            Plan(n_tokens, seq_len, 1, seed=1234, shuffle="block", region_windows=r,
                 block_regions=k),
        )
        for _, n_tokens, seq_len, r, k in cases
    ]  # fmt: skip
    # Steady state, as in a long-running server: once a large (mmap-backed, below 32 MiB)
    # array has been freed, glibc raises its trim/mmap thresholds and stops handing the
    # heap's top back to the kernel after every call; before that, each call's 64 KiB
    # temporaries page-fault anew and a measurement runs up to ~2x slow, depending on
    # what ran before it.
    np.ones(1 << 20).sum()
    for glob, block in plans:  # and a warm-up pass over every case
        rates(glob, block, max(1, batches // 4), 1)
    for (label, _, _, r, k), (glob, block) in zip(cases, plans, strict=True):
        g_rate, b_rate, ratio = rates(glob, block, batches, repeats)
        cold, warm = spans_cost(block, 200)
        print(
            f"| {label:<28} | {r:>11,} | {k:>3} | {g_rate / 1e6:>13.2f} | {b_rate / 1e6:>12.2f} "
            f"| {ratio:>11.2f}x | {f'{cold:.0f} / {warm:.0f}':>23} |"
        )


def tradeoff_table(regions: int, region_windows: int, ks: list[int], pairs: int) -> None:
    seq_len = 16
    w = regions * region_windows
    n_tokens = w * seq_len + 1
    plans = {"global": Plan(n_tokens, seq_len, 1, seed=7)}
    for k in ks:
        plans[f"block, K={k}"] = Plan(
            n_tokens, seq_len, 1, seed=7, shuffle="block", region_windows=region_windows,
            block_regions=k,
        )  # fmt: skip
    rng = np.random.default_rng(0)
    # Random pairs of distinct windows of one region.
    region = rng.integers(0, regions, size=pairs)
    a = rng.integers(0, region_windows, size=pairs)
    b = (a + rng.integers(1, region_windows, size=pairs)) % region_windows
    wa, wb = region * region_windows + a, region * region_windows + b
    print(
        f"\n(b) {regions} regions x {region_windows:,} windows (W = {w:,}), epoch 0; stream "
        f"distance between two windows of one region ({pairs:,} random pairs); distinct "
        "regions in each stretch of 1000 (and 8192) consecutive positions\n"
    )
    print(
        f"| {'shuffle':<11} | {'distance median':>15} | {'p99':>9} | {'max':>9} "
        f"| {'regions/1000 mean':>17} | {'max':>4} | {'regions/8192 mean':>17} | {'max':>4} |"
    )
    print(
        f"| {'-' * 11} | {'-' * 14}:| {'-' * 8}:| {'-' * 8}:| {'-' * 16}:| ---:| {'-' * 16}:| ---:|"
    )
    for name, plan in plans.items():
        ids, _ = plan.windows(np.arange(w))
        where = np.empty(w, dtype=np.int64)
        where[ids] = np.arange(w)  # the stream position of every window
        dist = np.abs(where[wa] - where[wb])
        cells = []
        for stretch in (1000, 8192):
            parts = (ids[: w // stretch * stretch] // region_windows).reshape(-1, stretch)
            touched = np.array([np.unique(part).size for part in parts])
            cells.append(f"{touched.mean():>17.1f} | {int(touched.max()):>4}")
        print(
            f"| {name:<11} | {int(np.median(dist)):>15,} | {int(np.percentile(dist, 99)):>9,} "
            f"| {int(dist.max()):>9,} | {cells[0]} | {cells[1]} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer blocks and repeats")
    args = ap.parse_args()
    t0 = time.perf_counter()
    speed_table(batches=20 if args.quick else 100, repeats=3 if args.quick else 5)
    tradeoff_table(64, 4096, [1, 4, 16], pairs=100_000)
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
