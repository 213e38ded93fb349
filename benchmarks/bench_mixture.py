"""How fast a mixture turns stream positions into (source, source position) and windows.

Section ``--math`` (the default): :meth:`Mixture.locate` on blocks of consecutive stream
positions (like a global batch), for a 3-source mixture with a small period (7:2:1, W = 10)
and the largest allowed one (W = 65536), a schedule whose blocks straddle segment
boundaries (the general path), and ``locate`` followed by each source's own
``Plan.windows`` (the whole order of a mixture row), next to ``Plan.windows`` of one
dataset. Positions start far down the stream: the cost must not depend on the position.

Section ``--loader``: a 3-source mixture's ``TokenFeedLoader`` throughput against one
dataset's, in one run, through one real server process: the same total size, token
distribution, ``seq_len``, batch size and workers, so the mixing is the only difference.
Runs alternate (single, mixture, then mixture, single, ...) after an uncounted warm-up of
each; medians of ``--runs``. Steady-state tokens/s after each loader's first batch, the
median of the per-pair ratios (robust to a shared machine's drift), and the server's CPU
seconds per billion tokens. Target: the mixture at least 0.9x.

    .venv/bin/python benchmarks/bench_mixture.py           # full run
    .venv/bin/python benchmarks/bench_mixture.py --quick   # a few seconds, for CI
    .venv/bin/python benchmarks/bench_mixture.py --loader --runs 5 --loader-workers 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench_plan import measure  # the warm-up call also builds the period tables
from tokenfeed.mixture import Mixture, source_seed
from tokenfeed.order.swrr import period_table
from tokenfeed.plan import Plan

SEED = 1234
#: Source sizes in tokens for the locate + windows rows (a big web set, smaller others).
SOURCE_TOKENS = {"web": 10**12, "code": 10**10, "math": 10**8}
SEQ_LEN = 2048


def table_build_seconds(mix: Mixture) -> float:
    """Time to build ``mix``'s period tables from scratch (once per process and weights)."""
    period_table.cache_clear()  # tables are shared per weight vector
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


# -- --loader: a mixture's loader throughput against one dataset's ---------------------
# Server, store and torch imports stay inside these functions: --math does not pay them.

LOADER_SEQ, LOADER_BATCH = 2048, 8
LOADER_WEIGHTS = {"web": 5, "code": 3, "math": 2}


def _loader_store(root: Path, tokens_per_source: int) -> Path:
    """Three sources and one single dataset of their combined size, one tokenizer, the
    same token distribution: the only difference left between the two is the mixing."""
    from tokenfeed_server.store import TokenizerInfo, write_dataset

    tokenizer = TokenizerInfo(kind="byte", vocab_size=50257, eos_id=50256)
    rng = np.random.default_rng(0)

    def documents(n_tokens: int) -> Iterator[np.ndarray]:
        left = n_tokens
        while left > 0:
            size = int(min(left, rng.integers(64, 4096)))
            yield rng.integers(0, 50256, size=size, dtype=np.uint16)
            left -= size + 1  # each document gets an EOS

    for name in LOADER_WEIGHTS:
        write_dataset(root, name, documents(tokens_per_source), tokenizer=tokenizer,
                      shuffle_seed=0)  # fmt: skip
    write_dataset(root, "single", documents(len(LOADER_WEIGHTS) * tokens_per_source),
                  tokenizer=tokenizer, shuffle_seed=0)  # fmt: skip
    return root


def _loader_run(
    endpoint: str, dataset: Any, batches: int, workers: int, server: psutil.Process
) -> tuple[float, float]:
    """One fresh TokenFeedLoader: steady-state tokens/s (after its first batch) and the
    server's CPU seconds per billion tokens meanwhile."""
    from tokenfeed import TokenFeedDataset, TokenFeedLoader

    ds = TokenFeedDataset(endpoint, dataset, seq_len=LOADER_SEQ, batch_size=LOADER_BATCH,
                          rank=0, world_size=1, samples=(batches + 1) * LOADER_BATCH)  # fmt: skip
    loader = TokenFeedLoader(ds, num_workers=workers, pin_memory=False)
    it = iter(loader)
    next(it)  # connected, workers up: time the steady state only
    cpu0 = sum(server.cpu_times()[:2])
    start = time.perf_counter()
    n = sum(1 for _ in it)
    elapsed = time.perf_counter() - start
    cpu = sum(server.cpu_times()[:2]) - cpu0
    assert n == batches, (n, batches)
    tokens = n * LOADER_BATCH * LOADER_SEQ
    return tokens / elapsed, cpu / tokens * 1e9


def loader_benchmark(
    runs: int, batches: int, workers: int, tokens_per_source: int
) -> dict[str, Any]:
    """The mixture's loader throughput against one dataset's, alternated in one run (one
    server, same store sizes and token distribution); medians of ``runs``. Target: the
    mixture at least 0.9x. Each run pairs one of each back to back, so the per-pair ratio
    is robust to a shared machine's drift; both medians are reported."""
    from tokenfeed_server.launch import ServerProcess

    what: dict[str, Any] = {"single": "single", "mixture": dict(LOADER_WEIGHTS)}
    rates: dict[str, list[float]] = {"single": [], "mixture": []}
    cpu: dict[str, list[float]] = {"single": [], "mixture": []}
    with tempfile.TemporaryDirectory(prefix="bench-mixture-") as tmp:
        store = _loader_store(Path(tmp), tokens_per_source)
        srv = ServerProcess(store).start()
        try:
            assert srv.proc is not None
            server = psutil.Process(srv.proc.pid)
            for dataset in what.values():  # warm-up, not counted: page and block caches
                _loader_run(srv.zmq, dataset, batches, workers, server)
            for r in range(runs):
                # alternate which goes first, so drift on a shared box hits both alike
                for label in ("single", "mixture") if r % 2 == 0 else ("mixture", "single"):
                    rate, seconds = _loader_run(srv.zmq, what[label], batches, workers, server)
                    rates[label].append(rate)
                    cpu[label].append(seconds)
        finally:
            srv.stop()
    pairs = [m / s for m, s in zip(rates["mixture"], rates["single"], strict=True)]
    single, mixture = (statistics.median(rates[k]) for k in ("single", "mixture"))
    return {
        "seq_len": LOADER_SEQ,
        "batch_size": LOADER_BATCH,
        "num_workers": workers,
        "batches": batches,
        "runs": runs,
        "tokens_per_source": tokens_per_source,
        "weights": LOADER_WEIGHTS,
        "tokens_per_s": rates,
        "server_cpu_s_per_gtok": cpu,
        "single_median": single,
        "mixture_median": mixture,
        "ratio_of_medians": mixture / single,
        "median_pair_ratio": statistics.median(pairs),
        # None when a run is too short for the server's CPU clock (10 ms ticks) to move
        "server_cpu_ratio": _ratio(
            statistics.median(cpu["mixture"]), statistics.median(cpu["single"])
        ),
        "target": 0.9,
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def bench_loader(args: argparse.Namespace) -> None:
    """Print the loader section's table (see the module docstring)."""
    tokens = 1_000_000 if args.quick else 4_000_000
    batches = 500 if args.quick else args.loader_batches
    runs = 1 if args.quick else args.runs
    print(f"\nloader: 3-source mixture {LOADER_WEIGHTS} vs one dataset of the same size "
          f"({len(LOADER_WEIGHTS) * tokens:,} tokens each), seq_len {LOADER_SEQ}, "
          f"batch {LOADER_BATCH}, num_workers {args.loader_workers}, {batches} batches a "
          f"run, median of {runs} alternated runs\n")  # fmt: skip
    out = loader_benchmark(runs, batches, args.loader_workers, tokens)
    rates, cpu = out["tokens_per_s"], out["server_cpu_s_per_gtok"]
    print("| what     | M tokens/s (median) | runs (M tokens/s)      | server CPU s / G tokens |")
    print("| -------- | ------------------: | ---------------------- | ----------------------: |")
    for label in ("single", "mixture"):
        runs_s = ", ".join(f"{r / 1e6:.0f}" for r in rates[label])
        print(f"| {label:<8} | {statistics.median(rates[label]) / 1e6:>19.1f} | {runs_s:<22} | "
              f"{statistics.median(cpu[label]):>23.2f} |")  # fmt: skip
    verdict = "meets" if out["median_pair_ratio"] >= out["target"] else "MISSES"
    cpu_ratio = out["server_cpu_ratio"]
    cpu_text = "not measurable (too short)" if cpu_ratio is None else f"{cpu_ratio:.2f}x"
    print(f"\nmixture / single: {out['median_pair_ratio']:.2f}x (median of per-pair ratios; "
          f"ratio of medians {out['ratio_of_medians']:.2f}x), {verdict} the target of "
          f"{out['target']}x; server CPU per token {cpu_text}")  # fmt: skip


#: Sections by name: ``--<name>`` runs it; none given runs ``math``.
SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "math": bench_math,
    "loader": bench_loader,
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--math", action="store_true", help="the mixture math's rate (default)")
    ap.add_argument("--quick", action="store_true", help="fewer blocks and repeats (CI)")
    ap.add_argument("--batch", type=int, default=8192, help="positions per vectorized call")
    ap.add_argument("--loader", action="store_true", help="a mixture's loader vs one dataset")
    ap.add_argument("--runs", type=int, default=5, help="loader: alternated runs (median)")
    ap.add_argument("--loader-batches", type=int, default=5000, help="loader: batches a run")
    ap.add_argument("--loader-workers", type=int, default=0, help="loader: num_workers")
    args = ap.parse_args(argv)
    chosen = [name for name in SECTIONS if getattr(args, name, False)] or ["math"]
    for name in chosen:
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
