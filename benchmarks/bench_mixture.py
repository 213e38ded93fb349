"""How fast a mixture turns stream positions into (source, source position) and windows.

Section ``--math`` (the default): :meth:`Mixture.locate` on blocks of consecutive stream
positions (like a global batch), for a 3-source mixture with a small period (7:2:1, W = 10)
and the largest allowed one (W = 65536), a schedule whose blocks straddle segment
boundaries (the general path), and ``locate`` followed by each source's own
``Plan.windows`` (the whole order of a mixture row), next to ``Plan.windows`` of one
dataset. Positions start far down the stream: the cost must not depend on the position.

    .venv/bin/python benchmarks/bench_mixture.py           # full run
    .venv/bin/python benchmarks/bench_mixture.py --quick   # a few seconds, for CI
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from tokenfeed import mixture as mixture_module
from tokenfeed.mixture import Mixture, source_seed
from tokenfeed.plan import Plan

SEED = 1234
#: Source sizes in tokens for the locate + windows rows (a big web set, smaller others).
SOURCE_TOKENS = {"web": 10**12, "code": 10**10, "math": 10**8}
SEQ_LEN = 2048


def measure(fn: Callable[[], object], repeats: int) -> tuple[float, int]:
    """Median seconds of ``fn`` over ``repeats`` runs, and its tracemalloc peak (bytes)."""
    fn()  # warm-up (also builds the period tables)
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


def table_build_seconds(mix: Mixture) -> float:
    """Time to build ``mix``'s period tables from scratch (once per process and weights)."""
    mixture_module._period_table.cache_clear()  # tables are shared per weight vector
    fresh = Mixture.of(mix.to_state())
    t0 = time.perf_counter()
    fresh.locate(np.zeros(1, dtype=np.int64))
    return time.perf_counter() - t0


def bench_math(args: argparse.Namespace) -> None:
    """The mixture math's rate in rows/s on blocks of ``args.batch`` positions."""
    batches = 20 if args.quick else 200
    repeats = 3 if args.quick else 7
    b = args.batch
    far = 10**12 + 12345  # deep into the run, no multiple of any period

    small = Mixture({"web": 0.7, "code": 0.2, "math": 0.1})  # 7:2:1, W = 10
    large = Mixture({"web": 32768, "code": 16385, "math": 16383})  # W = 65536
    # A new segment every b - 1 positions: every block crosses a boundary (general path).
    cut = b - 1
    sched = Mixture(
        [
            (k * cut, {"web": 7, "code": 2, "math": 1} if k % 2 == 0 else {"web": 1, "math": 3})
            for k in range(batches * b // cut + 2)
        ]
    )
    plans = {
        name: Plan(n, seq_len=SEQ_LEN, batch_size=b, seed=source_seed(SEED, name))
        for name, n in SOURCE_TOKENS.items()
    }

    rows: list[tuple[str, str, float, int, float]] = []

    def bench_locate(label: str, mix: Mixture, start: int, with_windows: bool = False) -> None:
        blocks = [
            np.arange(start + i * b, start + (i + 1) * b, dtype=np.int64) for i in range(batches)
        ]
        source_plans = [plans[name] for name in mix.names]

        def run() -> None:
            for block in blocks:
                src, pos = mix.locate(block)
                if with_windows:
                    for s, plan in enumerate(source_plans):
                        plan.windows(pos[src == s])

        sec, peak = measure(run, repeats)
        build = table_build_seconds(mix)
        rows.append((label, _periods(mix), batches * b / sec, peak, build))

    def bench_plan_only() -> None:
        plan = plans["web"]
        blocks = [np.arange(far + i * b, far + (i + 1) * b, dtype=np.int64) for i in range(batches)]

        def run() -> None:
            for block in blocks:
                plan.windows(block)

        sec, peak = measure(run, repeats)
        rows.append(("Plan.windows, one dataset", "-", batches * b / sec, peak, 0.0))

    bench_locate("locate", small, far)
    bench_locate("locate", large, far)
    bench_locate("locate, every block 2 segments", sched, 0)
    bench_locate("locate + Plan.windows", small, far, with_windows=True)
    bench_locate("locate + Plan.windows", large, far, with_windows=True)
    bench_plan_only()

    print(f"block = {b} positions, {batches} blocks x median of {repeats} runs, one core\n")
    head = ("what", "periods W", "M rows/s", "peak mem", "table build")
    print("| {:<30} | {:<12} | {:>9} | {:>10} | {:>11} |".format(*head))
    print(f"| {'-' * 30} | {'-' * 12} | {'-' * 9}:| {'-' * 10}:| {'-' * 11}:|")
    for label, periods, rate, peak, build in rows:
        build_s = f"{build * 1e3:.1f} ms" if build else "-"
        print(
            f"| {label:<30} | {periods:<12} | {rate / 1e6:>9.1f} | "
            f"{peak / 2**20:>6.2f} MiB | {build_s:>11} |"
        )


def _periods(mix: Mixture) -> str:
    ws = sorted({sum(w) for _, w in mix.segments})
    return "/".join(str(w) for w in ws)


#: Sections by name: ``--<name>`` runs it; none given runs ``math``.
SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {"math": bench_math}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--math", action="store_true", help="the mixture math's rate (default)")
    ap.add_argument("--quick", action="store_true", help="fewer blocks and repeats (CI)")
    ap.add_argument("--batch", type=int, default=8192, help="positions per vectorized call")
    args = ap.parse_args(argv)
    chosen = [name for name in SECTIONS if getattr(args, name, False)] or ["math"]
    for name in chosen:
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
