"""Prepare throughput: MB of text/s and tokens/s, byte tokenizer vs a trained BPE.

Corpus: this interpreter's standard library sources (the demo corpus), no download.
Each configuration runs several times into a fresh store; the table shows the median.
BPE time includes training on the corpus (that is what ``prepare --tokenizer bpe:N``
costs an operator). A last line gives what BPE training alone costs (time and peak RSS
in a fresh process) on ``--bpe-train-mb`` of text.

    python benchmarks/bench_prepare.py            # ~30 MB corpus, 3 runs each
    python benchmarks/bench_prepare.py --quick    # CI smoke: ~2 MB, 1 run
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from tokenfeed_server.corpus import iter_documents
from tokenfeed_server.prepare import PrepareConfig, PrepareStats, demo_corpus_paths, prepare
from tokenfeed_server.tokenizer import train_bpe


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
    args = parser.parse_args()
    runs = args.runs or (1 if args.quick else 3)
    corpus_mb = args.corpus_mb or (2 if args.quick else 30)
    paths = demo_corpus_paths(max_bytes=int(corpus_mb * (1 << 20)))
    size = sum(p.stat().st_size for p in paths)
    print(f"corpus: {len(paths)} stdlib files, {size / 1e6:.1f} MB; median of {runs} run(s)")
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
