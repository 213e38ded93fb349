"""tokenfeed against what a trainer would otherwise use, side by side, in one run.

    .venv/bin/python benchmarks/bench_loaders.py            # full run (~10 min on 2 cores)
    .venv/bin/python benchmarks/bench_loaders.py --quick    # smoke test (tiny store)

Generates a seeded synthetic store of Zipf-distributed token ids (one shard, so that the
memmap baselines can map it the nanoGPT way; cached under benchmarks/results/stores),
starts one tokenfeed server on it, then runs every system in alternation, each run in a
fresh trainer process: draw ``--batches`` batches of 8 x 2048 tokens and time them.

Per system: tokens/s (median, min-max over runs; steady state, after the first batch),
CPU seconds per billion tokens in the trainer's process tree (workers included) and in
the server, peak PSS of the trainer's processes and of the server (sampled every 100 ms;
PSS counts shared pages once), time to first batch (from ``iter()``, the server already
up), p50/p99 wait per batch. Ratios are against the nanoGPT-style memmap DataLoader with
the same number of workers. Writes ``results/bench_loaders.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from tokenfeed_server.launch import ServerProcess

HERE = Path(__file__).resolve().parent
SEQ_LEN, BATCH, VOCAB, EOS = 2048, 8, 50257, 50256


# -- the store -------------------------------------------------------------------------


def zipf_table(a: float = 1.1, size: int = 1 << 16) -> np.ndarray:
    """Token id for each of ``size`` equal-probability quantiles of a Zipf law over the vocab.

    Indexing it with uniform uint16 draws samples the (quantised) Zipf law at memory speed,
    so a multi-GB store is written in seconds rather than the minutes ``rng.zipf`` takes.
    """
    ranks = np.arange(1, VOCAB, dtype=np.float64)  # EOS is kept out of the body
    cdf = np.cumsum(ranks**-a)
    cdf /= cdf[-1]
    quantiles = (np.arange(size) + 0.5) / size
    return np.searchsorted(cdf, quantiles).astype(np.uint16)


def zipf_documents(
    n_tokens: int, rng: np.random.Generator, table: np.ndarray, *, block: int
) -> Iterator[np.ndarray]:
    """Documents of 64-4096 Zipf-distributed tokens (ids drawn through ``table``), about
    ``n_tokens`` in all counting one EOS each, drawn ``block`` tokens at a time."""
    left = n_tokens
    while left > 0:
        ids = table[rng.integers(0, 1 << 16, size=min(left, block), dtype=np.uint16)]
        lengths = rng.integers(64, 4096, size=len(ids) // 64 + 1)
        cuts = np.cumsum(lengths)
        cuts = cuts[cuts < len(ids)]
        yield from np.split(ids, cuts)
        left -= len(ids) + len(cuts) + 1  # documents each get an EOS


def make_store(root: Path, n_tokens: int, seed: int = 0) -> Path:
    """A cached one-shard store of about ``n_tokens`` tokens named ``bench``."""
    store = root / f"zipf-{n_tokens}-s{seed}"
    if (store / "bench" / "manifest.json").exists():
        return store
    from tokenfeed_server.store import TokenizerInfo, write_dataset

    rng = np.random.default_rng(seed)
    table = zipf_table()
    t0 = time.perf_counter()

    write_dataset(
        store,
        "bench",
        zipf_documents(n_tokens, rng, table, block=1 << 24),
        tokenizer=TokenizerInfo(kind="synthetic", vocab_size=VOCAB, eos_id=EOS),
        shuffle_seed=seed,
        shard_tokens=n_tokens + (1 << 20),
    )
    print(f"# wrote store {store} in {time.perf_counter() - t0:.1f}s", flush=True)
    return store


# -- processes and sampling ------------------------------------------------------------


class Server(ServerProcess):
    """A ``tokenfeed-server serve`` process (awaited on its ready line) and its CPU time."""

    def __init__(self, store: Path, log: Path) -> None:
        super().__init__(store, log_path=log)
        self.start()
        assert self.proc is not None
        self.ps = psutil.Process(self.proc.pid)

    def cpu(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system


def tree_pss(procs: list[psutil.Process]) -> int:
    """Summed PSS of ``procs`` and all their descendants (0 for those already gone)."""
    total = 0
    for p in procs:
        try:
            family = [p, *p.children(recursive=True)]
        except psutil.Error:
            continue
        for q in family:
            with contextlib.suppress(psutil.Error):  # a worker may exit between the calls
                total += q.memory_full_info().pss
    return total


class PeakSampler(threading.Thread):
    """Peak PSS of the trainer trees and of the server, every ``interval`` seconds."""

    def __init__(self, trainers: list[psutil.Process], server: psutil.Process | None) -> None:
        super().__init__(daemon=True)
        self.trainers, self.server = trainers, server
        self.trainer_peak = self.server_peak = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.1):
            self.trainer_peak = max(self.trainer_peak, tree_pss(self.trainers))
            if self.server is not None:
                self.server_peak = max(self.server_peak, tree_pss([self.server]))


def run_once(spec: dict[str, Any], clients: int, server: Server | None) -> dict[str, Any]:
    """One run of one system with ``clients`` concurrent trainer processes."""
    cmd = [sys.executable, str(HERE / "bench_loaders.py"), "--child", json.dumps(spec)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(clients)
    ]
    for p in procs:  # every trainer has imported and built its loader
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line:
            p.wait()
            raise SystemExit(f"{spec['system']} trainer failed before loading (rc {p.returncode})")
    sampler = PeakSampler([psutil.Process(p.pid) for p in procs], server and server.ps)
    server_cpu0 = server.cpu() if server else 0.0
    sampler.start()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [p.communicate(timeout=900)[0] for p in procs]
    sampler.done.set()
    sampler.join()
    server_cpu = (server.cpu() - server_cpu0) if server else 0.0
    results = []
    for p, out in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"{spec['system']} trainer exited with {p.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    tokens = sum(r["tokens"] for r in results)
    if clients == 1:
        rate = results[0]["tokens_per_s"]
    else:  # aggregate: all tokens over the span from the first start to the last end
        span = max(r["wall_end"] for r in results) - min(r["wall_start"] for r in results)
        rate = tokens / span
    giga = tokens / 1e9
    return {
        "tokens_per_s": rate,
        "trainer_cpu_s_per_gtok": sum(r["trainer_cpu_s"] for r in results) / giga,
        "server_cpu_s_per_gtok": server_cpu / giga,
        "trainer_pss_mb": sampler.trainer_peak / 2**20,
        "server_pss_mb": sampler.server_peak / 2**20,
        "ttfb_ms": max(r["ttfb_s"] for r in results) * 1e3,
        "wait_p50_ms": max(r["wait_p50_s"] for r in results) * 1e3,
        "wait_p99_ms": max(r["wait_p99_s"] for r in results) * 1e3,
    }


# -- the systems -----------------------------------------------------------------------


def peers_available() -> dict[str, str | None]:
    """Optional peers: None when importable, else why they are skipped."""
    import importlib.util

    out: dict[str, str | None] = {}
    for name, module in (("litdata", "litdata"), ("streaming", "streaming")):
        found = importlib.util.find_spec(module) is not None
        out[name] = (
            None if found else f"not installed (pip install -r {HERE.name}/requirements-bench.txt)"
        )
    return out


def prepare_peer(system: str, store: Path) -> Path:
    """Convert the store's shard into the peer's own format (cached beside the store)."""
    from systems import litdata_chunk, shard_region

    out = store / f"{system}-format"
    if (out / "index.json").exists():  # both formats finish by writing their index
        return out
    shutil.rmtree(out, ignore_errors=True)  # a conversion that died half-way
    path, n = shard_region(str(store), "bench")
    tokens = np.memmap(path, dtype=np.uint16, mode="r", offset=64, shape=(n,))
    rows = (n - 1) // SEQ_LEN
    if system == "streaming":
        from streaming import MDSWriter

        with MDSWriter(out=str(out), columns={"tokens": "ndarray:uint16"}) as w:
            for i in range(rows):
                w.write({"tokens": np.array(tokens[i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN + 1])})
    else:
        from litdata import optimize
        from litdata.streaming.item_loader import TokensLoader

        optimize(
            fn=functools.partial(litdata_chunk, path=str(path), n=n),
            inputs=list(range((n + (1 << 24) - 1) >> 24)),
            output_dir=str(out),
            chunk_size=(SEQ_LEN + 1) * 1024,
            item_loader=TokensLoader(),
            num_workers=1,
        )
    return out


def system_list(args: argparse.Namespace) -> list[tuple[str, dict[str, Any], int]]:
    """(label, spec, concurrent clients) for every system, in run order."""
    out: list[tuple[str, dict[str, Any], int]] = []
    for nw in (0, 2):
        k = args.batches_per_item if nw else 1
        out.append(
            (
                f"tokenfeed nw={nw}",
                {"system": "tokenfeed", "num_workers": nw, "batches_per_item": k},
                1,
            )
        )
        out.append((f"memmap nw={nw}", {"system": "memmap", "num_workers": nw}, 1))
        out.append((f"ram nw={nw}", {"system": "ram", "num_workers": nw}, 1))
        for peer in ("litdata", "streaming"):
            out.append((f"{peer} nw={nw}", {"system": peer, "num_workers": nw}, 1))
    for system in ("tokenfeed", "memmap", "ram", "litdata"):
        out.append((f"{system} 4 clients nw=0", {"system": system, "num_workers": 0}, 4))
    return out


# -- report ----------------------------------------------------------------------------

COLUMNS = [
    ("tokens_per_s", "Mtok/s", 1e-6),
    ("trainer_cpu_s_per_gtok", "trainer CPU s/Gtok", 1),
    ("server_cpu_s_per_gtok", "server CPU s/Gtok", 1),
    ("trainer_pss_mb", "trainer PSS MB", 1),
    ("server_pss_mb", "server PSS MB", 1),
    ("ttfb_ms", "TTFB ms", 1),
    ("wait_p50_ms", "p50 ms", 1),
    ("wait_p99_ms", "p99 ms", 1),
]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": runs}
    for key, _, _ in COLUMNS:
        values = [r[key] for r in runs]
        peak = key.endswith("pss_mb")  # memory: the worst run; the rest: the median
        out[key] = max(values) if peak else statistics.median(values)
    rates = [r["tokens_per_s"] for r in runs]
    out["tokens_per_s_min"], out["tokens_per_s_max"] = min(rates), max(rates)
    return out


def baseline_of(label: str) -> str:
    return "memmap 4 clients nw=0" if "4 clients" in label else f"memmap nw={label[-1]}"


def table(summary: dict[str, dict[str, Any]]) -> str:
    head = f"{'system':<26}{'Mtok/s (min-max)':>20}{'x memmap':>9}"
    head += "".join(f"{name:>19}" if "CPU" in name else f"{name:>15}" for _, name, _ in COLUMNS[1:])
    head += f"{'CPU x memmap':>13}"
    lines = [head]
    for label, s in summary.items():
        if "skipped" in s:
            lines.append(f"{label:<26}  skipped: {s['skipped']}")
            continue
        base = summary.get(baseline_of(label), {})
        rate = s["tokens_per_s"]
        ratio = rate / base["tokens_per_s"] if "tokens_per_s" in base else float("nan")
        cpu_ratio = (
            s["trainer_cpu_s_per_gtok"] / base["trainer_cpu_s_per_gtok"]
            if "trainer_cpu_s_per_gtok" in base
            else float("nan")
        )
        lo, hi = s["tokens_per_s_min"] / 1e6, s["tokens_per_s_max"] / 1e6
        span = f"{rate / 1e6:.1f} ({lo:.1f}-{hi:.1f})"
        row = f"{label:<26}{span:>20}{ratio:>8.2f}x"
        for key, name, scale in COLUMNS[1:]:
            width = 19 if "CPU" in name else 15
            row += f"{s[key] * scale:>{width}.1f}"
        row += f"{cpu_ratio:>12.2f}x"
        lines.append(row)
    return "\n".join(lines)


def chart(summary: dict[str, dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib not installed: no chart", flush=True)
        return
    done = {k: v for k, v in summary.items() if "skipped" not in v}
    labels = list(done)
    fig, axes = plt.subplots(1, 3, figsize=(18, 0.45 * len(labels) + 2), sharey=True)
    y = np.arange(len(labels))
    colors = ["tab:green" if k.startswith("tokenfeed") else "tab:gray" for k in labels]
    rates = np.array([done[k]["tokens_per_s"] for k in labels]) / 1e6
    err = np.array(
        [
            [rates[i] - done[k]["tokens_per_s_min"] / 1e6 for i, k in enumerate(labels)],
            [done[k]["tokens_per_s_max"] / 1e6 - rates[i] for i, k in enumerate(labels)],
        ]
    )
    axes[0].barh(y, rates, xerr=err, color=colors)
    axes[0].set_xlabel("M tokens/s (median, min-max)")
    axes[1].barh(y, [done[k]["trainer_cpu_s_per_gtok"] for k in labels], color=colors)
    axes[1].set_xlabel("trainer CPU s per G tokens")
    axes[2].barh(
        y, [done[k]["trainer_pss_mb"] + done[k]["server_pss_mb"] for k in labels], color=colors
    )
    axes[2].set_xlabel("peak PSS MB, trainers + server")
    axes[0].set_yticks(y, labels)
    axes[0].invert_yaxis()
    fig.suptitle(f"batches of {BATCH} x {SEQ_LEN} tokens; green: tokenfeed")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# -- main ------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny store, few batches (CI smoke)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batches", type=int, default=1500)
    ap.add_argument("--store-gb", type=float, default=0.5)
    ap.add_argument("--big-gb", type=float, default=4.0, help="store for the memory figure")
    ap.add_argument("--batches-per-item", type=int, default=16, help="tokenfeed nw>0")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--stores", type=Path, default=HERE / "results" / "stores")
    ap.add_argument("--only", help="comma-separated substrings of the systems to run")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        from systems import run_child

        print(json.dumps(run_child(json.loads(args.child))), flush=True)
        return
    if args.quick:
        args.runs, args.batches, args.store_gb, args.big_gb = 1, 20, 0.004, 0.008
    args.out.mkdir(parents=True, exist_ok=True)
    name = "bench_loaders_quick" if args.quick else "bench_loaders"
    small = make_store(args.stores, int(args.store_gb * 2**30) // 2)
    big = make_store(args.stores, int(args.big_gb * 2**30) // 2) if args.big_gb else None
    base = {
        "seq_len": SEQ_LEN,
        "batch_size": BATCH,
        "batches": args.batches,
        "prefetch": 4,
        "dataset": "bench",
        "barrier": True,
    }
    missing = peers_available()
    summary: dict[str, dict[str, Any]] = {}
    runs: dict[str, list[dict[str, Any]]] = {}
    systems = []
    for label, own, clients in system_list(args):
        if args.only and not any(word in label for word in args.only.split(",")):
            continue
        why = missing.get(own["system"])
        if why:
            summary[label] = {"skipped": why}
            continue
        spec = {**base, **own, "store": str(small)}
        if spec["system"] in ("litdata", "streaming"):
            spec["peer_dir"] = str(prepare_peer(spec["system"], small))
        systems.append((label, spec, clients))
        runs[label] = []
    log = args.out / f"{name}.server.log"
    for r in range(args.runs):  # alternate, so that drift hits every system alike
        for label, spec, clients in systems:
            # The server runs only while tokenfeed does: an idle server mapping the store
            # would share (and so halve) the page-cache PSS the baselines are charged.
            server = Server(small, log) if spec["system"] == "tokenfeed" else None
            try:
                endpoint = server.zmq if server else ""
                result = run_once({**spec, "seed": r, "endpoint": endpoint}, clients, server)
            finally:
                if server:
                    server.stop()
            runs[label].append(result)
            print(f"# run {r} {label}: {result['tokens_per_s'] / 1e6:.1f} Mtok/s", flush=True)
    order = [label for label, _, _ in system_list(args) if label in runs or label in summary]
    summary = {label: summary.get(label) or summarize(runs[label]) for label in order}

    # Trainer memory does not grow with the store: the same trainers on a larger one.
    memory: dict[str, Any] = {"small_store_gb": args.store_gb, "big_store_gb": args.big_gb}
    for nw in (0, 2) if big else ():
        big_server = Server(big, args.out / f"{name}.server.log")
        try:
            spec = {
                **base,
                "system": "tokenfeed",
                "num_workers": nw,
                "seed": 0,
                "batches_per_item": args.batches_per_item if nw else 1,
                "store": str(big),
                "endpoint": big_server.zmq,
                "barrier": True,
            }
            res = run_once(spec, 1, big_server)
            memory[f"tokenfeed nw={nw}"] = {
                "trainer_pss_mb_small": summary.get(f"tokenfeed nw={nw}", {}).get("trainer_pss_mb"),
                "trainer_pss_mb_big": res["trainer_pss_mb"],
            }
        finally:
            big_server.stop()

    text = table(summary)
    print(text)
    print(f"\ntrainer peak PSS, {args.store_gb:g} GB store vs {args.big_gb:g} GB store:")
    for key, m in memory.items():
        if isinstance(m, dict):
            small_mb, big_mb = m["trainer_pss_mb_small"] or 0, m["trainer_pss_mb_big"]
            print(f"  {key}: {small_mb:.0f} MB vs {big_mb:.0f} MB")
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "batch": [BATCH, SEQ_LEN],
        "batches_per_run": args.batches,
        "runs": args.runs,
        "cpus": os.cpu_count(),
        "store_tokens": int(args.store_gb * 2**30) // 2,
    }
    result = {"meta": meta, "systems": summary, "memory_vs_store_size": memory, "table": text}
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    chart(summary, args.out / f"{name}.png")
    print(f"\nwrote {args.out / name}.json and .png", flush=True)


if __name__ == "__main__":
    main()
