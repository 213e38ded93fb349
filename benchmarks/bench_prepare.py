"""Prepare throughput: MB of text/s and tokens/s, byte tokenizer vs a trained BPE.

Corpus: this interpreter's standard library sources (the demo corpus), no download.
Each configuration runs several times into a fresh store; the table shows the median.
BPE time includes training on the corpus (that is what ``prepare --tokenizer bpe:N``
costs an operator). A last line gives what BPE training alone costs (time and peak RSS
in a fresh process) on ``--bpe-train-mb`` of text.

With ``--engine ray`` (or ``both``) the same corpus also goes through ``--engine ray`` on
a local Ray cluster of 1 and of 2 CPUs: MB/s, the driver's peak RSS and the largest peak
RSS of a Ray worker process (VmHWM), so the per-CPU figure says what a cluster gives.

    python benchmarks/bench_prepare.py            # ~30 MB corpus, 3 runs each
    python benchmarks/bench_prepare.py --quick    # CI smoke: ~2 MB, 1 run
    python benchmarks/bench_prepare.py --engine both --corpus-mb 10 --runs 1
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from tokenfeed_server.prepare import PrepareConfig, PrepareStats, demo_corpus_paths, prepare
from tokenfeed_server.prepare.corpus import iter_documents
from tokenfeed_server.prepare.tokenizer import train_bpe


def _run_once(
    paths: list[Path], tokenizer: str, workers: int, memory_mb: float, bpe_train_mb: float
) -> PrepareStats:
    store = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    try:
        stats = PrepareStats()
        config = PrepareConfig(
            inputs=tuple(paths),
            store=store,
            dataset="bench",
            tokenizer=tokenizer,
            workers=workers,
            memory_mb=memory_mb,
            bpe_train_mb=bpe_train_mb,
            progress=False,
        )
        start = time.perf_counter()
        prepare(config, stats)
        stats.seconds = time.perf_counter() - start
        return stats
    finally:
        shutil.rmtree(store, ignore_errors=True)


def _worker_peak_rss_mib() -> float:
    """The largest peak RSS (VmHWM) of this machine's Ray worker processes, in MiB."""
    peak = 0
    for proc in os.listdir("/proc"):
        if not proc.isdigit():
            continue
        try:
            with open(f"/proc/{proc}/cmdline", "rb") as f:
                cmdline = f.read()
            if b"default_worker.py" not in cmdline and not cmdline.startswith(b"ray::"):
                continue
            with open(f"/proc/{proc}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        peak = max(peak, int(line.split()[1]))
        except OSError:
            continue
    return peak / 1024


def _ray_once(
    paths: list[Path], tokenizer: str, cpus: int, memory_mb: float, bpe_train_mb: float
) -> tuple[float, int, float, float]:
    """One ray-engine run on a fresh local cluster of ``cpus``, in a fresh process.

    Returns seconds, text bytes, the driver's peak RSS and the largest worker's (MiB).
    """
    import ray

    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    store = Path(tempfile.mkdtemp(prefix="bench-prepare-ray-"))
    try:
        stats = PrepareStats()
        config = PrepareConfig(
            inputs=tuple(paths),
            store=store,
            dataset="bench",
            tokenizer=tokenizer,
            memory_mb=memory_mb,
            bpe_train_mb=bpe_train_mb,
            progress=False,
            engine="ray",
        )
        start = time.perf_counter()
        prepare(config, stats)
        seconds = time.perf_counter() - start
        workers = _worker_peak_rss_mib()
    finally:
        ray.shutdown()
        shutil.rmtree(store, ignore_errors=True)
    driver = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return seconds, stats.corpus.text_bytes, driver, workers


def _local_once_rss(
    paths: list[Path], tokenizer: str, memory_mb: float, bpe_train_mb: float
) -> tuple[float, int, float]:
    """One local-engine run in a fresh process: seconds, text bytes, peak RSS (MiB)."""
    stats = _run_once(paths, tokenizer, 1, memory_mb, bpe_train_mb)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return stats.seconds, stats.corpus.text_bytes, rss


def _compare_engines(
    paths: list[Path], tokenizers: list[str], runs: int, memory_mb: float, bpe_train_mb: float
) -> None:
    header = (
        f"{'tokenizer':<12} {'engine':<10} {'seconds':>8} {'MB/s':>8} "
        f"{'MB/s/CPU':>9} {'driver MiB':>11} {'worker MiB':>11}"
    )
    print(header)
    print("-" * len(header))
    spawn = multiprocessing.get_context("spawn")
    for spec in tokenizers:
        rows: list[tuple[str, float, int, float, float, int]] = []
        with spawn.Pool(1, maxtasksperchild=1) as pool:
            local = [
                pool.apply(_local_once_rss, (paths, spec, memory_mb, bpe_train_mb))
                for _ in range(runs)
            ]
        secs = statistics.median(r[0] for r in local)
        rows.append(("local", secs, local[0][1], max(r[2] for r in local), 0.0, 1))
        for cpus in (1, 2):
            with spawn.Pool(1, maxtasksperchild=1) as pool:
                got = [
                    pool.apply(_ray_once, (paths, spec, cpus, memory_mb, bpe_train_mb))
                    for _ in range(runs)
                ]
            secs = statistics.median(r[0] for r in got)
            rows.append(
                (f"ray x{cpus}", secs, got[0][1], max(r[2] for r in got), max(r[3] for r in got),
                 cpus)
            )  # fmt: skip
        for engine, secs, text, driver, worker, cpus in rows:
            rate = text / secs / 1e6
            shown_worker = f"{worker:>11.0f}" if worker else f"{'-':>11}"
            print(
                f"{spec:<12} {engine:<10} {secs:>8.2f} {rate:>8.2f} {rate / cpus:>9.2f} "
                f"{driver:>11.0f} {shown_worker}"
            )


def _train_only(paths: list[Path], vocab: int, train_mb: float) -> tuple[float, float]:
    """Seconds and peak RSS (MiB, Linux units) of training alone; run in a fresh process."""
    start = time.perf_counter()
    train_bpe(iter_documents(paths), vocab, max_bytes=int(train_mb * (1 << 20)), progress=False)
    return time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny corpus, one run (CI)")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--corpus-mb", type=float, default=None)
    parser.add_argument("--bpe-vocab", type=int, default=8192)
    parser.add_argument("--memory-mb", type=float, default=512)
    parser.add_argument("--bpe-train-mb", type=float, default=64)
    parser.add_argument(
        "--engine",
        choices=["local", "ray", "both"],
        default="local",
        help="local: the worker table; ray/both: also local vs ray on 1 and 2 CPUs",
    )
    args = parser.parse_args()
    runs = args.runs or (1 if args.quick else 3)
    corpus_mb = args.corpus_mb or (2 if args.quick else 30)
    paths = demo_corpus_paths(max_bytes=int(corpus_mb * (1 << 20)))
    size = sum(p.stat().st_size for p in paths)
    print(f"corpus: {len(paths)} stdlib files, {size / 1e6:.1f} MB; median of {runs} run(s)")
    if args.engine != "local":
        tokenizers = ["byte", f"bpe:{args.bpe_vocab}"]
        _compare_engines(paths, tokenizers, runs, args.memory_mb, args.bpe_train_mb)
        if args.engine == "ray":
            return
    configs = [
        ("byte", "byte", 1),
        ("byte", "byte", 2),
        (f"bpe:{args.bpe_vocab}", f"bpe:{args.bpe_vocab}", 1),
        (f"bpe:{args.bpe_vocab}", f"bpe:{args.bpe_vocab}", 2),
    ]
    header = (
        f"{'tokenizer':<12} {'workers':>7} {'seconds':>8} {'MB/s':>8} {'Mtok/s':>8} {'tokens':>12}"
    )
    print(header)
    print("-" * len(header))
    for label, spec, workers in configs:
        results = [
            _run_once(paths, spec, workers, args.memory_mb, args.bpe_train_mb) for _ in range(runs)
        ]
        secs = statistics.median(r.seconds for r in results)
        tokens = results[0].tokens
        text = results[0].corpus.text_bytes
        print(
            f"{label:<12} {workers:>7} {secs:>8.2f} {text / secs / 1e6:>8.1f} "
            f"{tokens / secs / 1e6:>8.2f} {tokens:>12,}"
        )
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        secs, rss = pool.apply(_train_only, (paths, args.bpe_vocab, args.bpe_train_mb))
    trained = min(size, args.bpe_train_mb * (1 << 20)) / 1e6
    print(f"bpe:{args.bpe_vocab} training alone on {trained:.1f} MB: {secs:.1f} s, "
          f"peak RSS {rss:.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
