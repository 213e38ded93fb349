"""A store in object storage against the same dataset on local disk, in one run.

    .venv/bin/python benchmarks/bench_s3.py            # full run (~2 min a run on 2 cores)
    .venv/bin/python benchmarks/bench_s3.py --quick    # smoke test (under a minute)

Writes one seeded synthetic dataset (Zipf token ids, many small shards, format version 2
with per-piece checksums) into a local store and publishes the very same files into a
real S3 protocol server started here (moto's server mode, a separate process on loopback;
what ``prepare --store s3://...`` does after writing its scratch store). Then, per run,
each trainer a fresh process reading ``--batches`` timed batches (``--paced-batches`` when
it simulates a training step) of ``--batch-size`` x ``--seq-len`` tokens after
``--warmup`` batches, against a fresh server (and an empty cache) each time:

* **steady tokens/s** (global shuffle): the local store, and the S3 store with a cache
  large enough for the dataset, warmed (the warm-up batches, then until the cache's
  prefetch is idle). Target: S3 >= 0.9x local.
* **steady tokens/s** (block shuffle, a cache a third of the dataset): the trainer reads
  as fast as it can, so the S3 server must fetch as fast as the trainer eats.
* **time to first batch, cold**: from ``iter()`` to the first batch, the server already
  up, its cache empty (local: the store in the page cache).
* **p99 wait per batch with latency**: every request to the object store delayed by
  ``--delay-ms`` (benchmarks/latency_proxy.py between the server and moto:
  ``AWS_ENDPOINT_URL`` points at the proxy), block shuffle, a cache a third of the
  dataset, and a trainer that computes ``--step-ms`` per batch (a sleep: a trainer that
  does nothing but load is throughput, measured above). Target: p99 <= 2x local.

Pieces are 1 MiB by default, what ``prepare`` writes (so a row of 4 KiB crosses a piece
boundary as rarely as in production); shards are small (512 KiB), so that a dataset of a
size moto serves in seconds has many regions. The default dataset (24 Mi tokens, 50 MB)
is sized so that a cache of a third of it holds about seven of the block shuffle's
blocks: the prefetch wants the block being served and the next one within three quarters
of the cache, so a cache of fewer than about three
blocks cannot have the next block in before it is read (the README says so).

Medians over ``--runs`` (systems alternate within a run, so drift hits all alike).
Writes ``results/bench_s3.json`` (``bench_s3_quick.json`` with ``--quick``) and the last
measurement's server log beside it; the results directory is where every benchmark here
writes, and is not committed. A trainer that fails prints the server's log tail.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))  # the moto server helper the tests use
sys.path.insert(0, str(HERE))

VOCAB, EOS = 50257, 50256
BUCKET, PREFIX, NAME = "bench", "stores/s3", "bench"


# -- the dataset ----------------------------------------------------------------------


def make_local(root: Path, n_tokens: int, shard_tokens: int, piece_bytes: int) -> Path:
    """A seeded synthetic dataset ``bench`` of about ``n_tokens`` tokens in ``root``."""
    from bench_loaders import zipf_documents, zipf_table
    from tokenfeed_server.store import TokenizerInfo, write_dataset

    rng = np.random.default_rng(0)
    table = zipf_table()

    write_dataset(
        root,
        NAME,
        zipf_documents(n_tokens, rng, table, block=1 << 22),
        tokenizer=TokenizerInfo(kind="synthetic", vocab_size=VOCAB, eos_id=EOS),
        shuffle_seed=0,
        shard_tokens=shard_tokens,
        piece_bytes=piece_bytes,
    )
    return root


def publish(local: Path, env: dict[str, str]) -> int:
    """Upload the local dataset to s3://BUCKET/PREFIX/NAME; return its bytes."""
    from tokenfeed_server.store.objects import ObjectStore, S3Location
    from tokenfeed_server.store.publish import publish_dataset

    saved = dict(os.environ)
    os.environ.update(env)  # the standard AWS chain reads the endpoint from here
    try:
        publish_dataset(local / NAME, ObjectStore(S3Location(BUCKET, PREFIX)), NAME)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return sum(p.stat().st_size for p in (local / NAME).glob("*.bin"))


# -- processes ------------------------------------------------------------------------


def start_server(
    store: str, log: Path, env: dict[str, str], cache_dir: Path | None, cache_size: int
) -> Any:
    """A ready ``tokenfeed-server serve`` on ``store`` (with a cache for an s3:// one)."""
    from tokenfeed_server.launch import ServerProcess

    cmd = [
        sys.executable, "-m", "tokenfeed_server.cli", "serve", "--store", store,
        "--host", "127.0.0.1", "--zmq-port", "0", "--http-port", "0",
    ]  # fmt: skip
    if cache_dir is not None:
        cmd += ["--cache-dir", str(cache_dir), "--cache-size", str(cache_size)]
    return ServerProcess(command=cmd, env=env, log_path=log).start(timeout=60)


class Proxy:
    """``latency_proxy.py`` as a process of its own (not in this process's GIL)."""

    def __init__(self, upstream: str, delay_ms: float, log: Path) -> None:
        host, port = upstream.removeprefix("http://").rsplit(":", 1)
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "latency_proxy.py"), "--upstream",
                 f"{host}:{port}", "--delay-ms", str(delay_ms)],
                stdout=subprocess.PIPE, stderr=err, text=True,
            )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the latency proxy did not start (status {self.proc.wait(10)})")
        self.endpoint = str(json.loads(line)["endpoint"])

    def stop(self) -> dict[str, Any]:
        """Stop it; return what went through (requests delayed, bytes each way)."""
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        with contextlib.suppress(ValueError, IndexError):
            return dict(json.loads(self.log.read_text().strip().splitlines()[-1]))
        return {}


def run_trainer(spec: dict[str, Any], server: Any) -> dict[str, Any]:
    """One trainer in a fresh process; its JSON result (on failure: why, and the server's
    log tail)."""
    cmd = [sys.executable, str(HERE / "bench_s3.py"), "--child", json.dumps(spec)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(
            f"trainer {spec['label']} failed ({done.returncode}):\n{done.stderr[-3000:]}\n"
            f"server log ({server.log_path}):\n{server.log_tail(40)}"
        )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# -- the trainer (child process) ------------------------------------------------------


def cache_status(url: str | None) -> dict[str, Any] | None:
    """The server's cache object from /v1/status (None: no URL, or a local store)."""
    if not url:
        return None
    import httpx

    cache = httpx.get(url + "/v1/status", timeout=10).json().get("cache")
    return dict(cache) if isinstance(cache, dict) else None


def wait_prefetch_idle(url: str, timeout: float) -> float:
    """Wait (bounded) until the cache fetches nothing; return the seconds waited."""
    t0 = time.perf_counter()
    quiet = 0
    while time.perf_counter() - t0 < timeout:
        cache = cache_status(url) or {}
        busy = cache.get("fetching", 0) or cache.get("admission_queue", 0)
        quiet = 0 if busy else quiet + 1
        if quiet >= 3:  # three snapshots in a row (refreshed a few times a second)
            break
        time.sleep(0.2)
    return time.perf_counter() - t0


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Draw warm-up then timed batches; time them (waits exclude the simulated step)."""
    import torch

    from tokenfeed import TokenFeedDataset, TokenFeedLoader

    torch.set_num_threads(1)
    total = spec["warmup"] + spec["batches"]
    kwargs: dict[str, Any] = {}
    if spec["shuffle"] != "global":
        kwargs["shuffle"] = spec["shuffle"]
    ds = TokenFeedDataset(
        spec["endpoint"],
        NAME,
        seq_len=spec["seq_len"],
        batch_size=spec["batch_size"],
        seed=spec["seed"],
        rank=0,
        world_size=1,
        samples=total * spec["batch_size"],
        deadline=120.0,
        **kwargs,
    )
    loader = TokenFeedLoader(ds, num_workers=spec["num_workers"], pin_memory=False, prefetch=4)
    step = spec["step_ms"] / 1000.0
    waits: list[float] = []
    t0 = time.perf_counter()
    it = iter(loader)
    prev = t0
    timed_start = timed_end = 0.0
    cache_before: dict[str, Any] | None = None
    idle_wait = 0.0
    tokens = 0
    for n, batch in enumerate(it, 1):
        now = time.perf_counter()
        waits.append(now - prev)
        if n > spec["warmup"]:
            tokens += batch["input_ids"].numel()
        if n == spec["warmup"]:
            if spec.get("warm_until_idle"):
                idle_wait = wait_prefetch_idle(spec["status_url"], 120.0)
            cache_before = cache_status(spec["status_url"])
            timed_start = time.perf_counter()
        if n == total:
            timed_end = time.perf_counter()
            break
        if step:
            time.sleep(step)  # the training step
        prev = time.perf_counter()
    cache_after = cache_status(spec["status_url"])
    del it
    timed = waits[spec["warmup"] :]
    out: dict[str, Any] = {
        "label": spec["label"],
        "batches": len(waits),
        "ttfb_s": waits[0],
        "tokens_per_s": tokens / (timed_end - timed_start) if timed_end > timed_start else 0.0,
        "wait_p50_s": float(np.percentile(timed, 50)),
        "wait_p99_s": float(np.percentile(timed, 99)),
        "wait_max_s": max(timed),
        "warm_idle_wait_s": idle_wait,
    }
    if cache_before is not None and cache_after is not None:
        out["cache_timed"] = {
            k: cache_after.get(k, 0) - cache_before.get(k, 0)
            for k in ("hits", "misses", "fetches", "prefetches", "bytes_fetched", "evictions")
            if isinstance(cache_after.get(k), int)
        }
        out["cache_end"] = {
            k: cache_after.get(k)
            for k in ("capacity_bytes", "size_bytes", "fetch_latency_p50_s", "fetch_latency_p99_s")
        }
    return out


# -- the measurements -----------------------------------------------------------------


def measurements(args: argparse.Namespace, dataset_bytes: int) -> list[dict[str, Any]]:
    """What one run measures: label, store kind, shuffle, cache size, latency, pacing."""
    third = max(1, dataset_bytes // 3)
    fits = dataset_bytes + dataset_bytes // 4
    return [
        {"label": "local global", "store": "local", "shuffle": "global", "step_ms": 0},
        {"label": "s3 global (cache fits)", "store": "s3", "shuffle": "global",
         "cache": fits, "step_ms": 0, "warm_until_idle": True},
        {"label": "local block", "store": "local", "shuffle": "block", "step_ms": 0},
        {"label": "s3 block (cache 1/3)", "store": "s3", "shuffle": "block",
         "cache": third, "step_ms": 0},
        {"label": "local block paced", "store": "local", "shuffle": "block",
         "step_ms": args.step_ms, "batches": args.paced_batches},
        {"label": f"s3+{args.delay_ms:g}ms block paced (cache 1/3)", "store": "s3",
         "shuffle": "block", "cache": third, "step_ms": args.step_ms, "delay": True,
         "batches": args.paced_batches},
    ]  # fmt: skip


def measure(
    m: dict[str, Any], args: argparse.Namespace, local: Path, s3: Any, work: Path, seed: int
) -> dict[str, Any]:
    log = args.out / f"{args.name}.server.log"
    log.write_text("")  # this measurement's server only
    cache_dir = work / "cache"
    shutil.rmtree(cache_dir, ignore_errors=True)  # cold: an empty cache every time
    proxy: Proxy | None = None
    with contextlib.ExitStack() as stack:
        if m["store"] == "local":
            server = start_server(str(local), log, dict(os.environ), None, 0)
        else:
            env = s3.env()
            if m.get("delay"):
                proxy = Proxy(s3.endpoint, args.delay_ms, work / "proxy.log")
                stack.callback(proxy.stop)
                env["AWS_ENDPOINT_URL"] = proxy.endpoint
            server = start_server(f"s3://{BUCKET}/{PREFIX}", log, env, cache_dir, m["cache"])
        stack.callback(server.stop)
        spec = {
            **{k: v for k, v in m.items() if k != "batches"},
            "endpoint": server.zmq,
            "status_url": server.http if m["store"] == "s3" else None,
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "seed": seed,
            "warmup": args.warmup,
            "batches": m.get("batches", args.batches),
            "num_workers": args.num_workers,
        }
        result = run_trainer(spec, server)
    if proxy is not None:
        result["proxy"] = proxy.stop()  # stopped already: this reads its last report
    return result


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": runs}
    for key in ("tokens_per_s", "ttfb_s", "wait_p50_s", "wait_p99_s", "wait_max_s"):
        out[key] = statistics.median(r[key] for r in runs)
    return out


def ratios(summary: dict[str, dict[str, Any]], delay_ms: float) -> dict[str, float]:
    def get(label: str, key: str) -> float:
        return float(summary[label][key])

    paced = f"s3+{delay_ms:g}ms block paced (cache 1/3)"
    return {
        "steady_tokens_per_s_global_s3_over_local": get("s3 global (cache fits)", "tokens_per_s")
        / get("local global", "tokens_per_s"),
        "steady_tokens_per_s_block_s3_over_local": get("s3 block (cache 1/3)", "tokens_per_s")
        / get("local block", "tokens_per_s"),
        "ttfb_cold_global_s3_over_local": get("s3 global (cache fits)", "ttfb_s")
        / get("local global", "ttfb_s"),
        "ttfb_cold_block_s3_over_local": get("s3 block (cache 1/3)", "ttfb_s")
        / get("local block", "ttfb_s"),
        "p99_wait_block_latency_s3_over_local": get(paced, "wait_p99_s")
        / get("local block paced", "wait_p99_s"),
    }


def table(summary: dict[str, dict[str, Any]]) -> str:
    head = f"{'measurement':<36}{'Mtok/s':>9}{'TTFB ms':>9}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"
    lines = [head]
    for label, s in summary.items():
        lines.append(
            f"{label:<36}{s['tokens_per_s'] / 1e6:>9.2f}{s['ttfb_s'] * 1e3:>9.1f}"
            f"{s['wait_p50_s'] * 1e3:>9.2f}{s['wait_p99_s'] * 1e3:>9.2f}"
            f"{s['wait_max_s'] * 1e3:>9.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny dataset, few batches (smoke)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24 << 20, help="dataset size in tokens")
    ap.add_argument("--shard-tokens", type=int, default=1 << 18)
    ap.add_argument("--piece-bytes", type=int, default=1 << 20, help="1 MiB: what prepare writes")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=50, help="batches before timing")
    ap.add_argument("--batches", type=int, default=6000, help="timed batches (throughput)")
    ap.add_argument("--paced-batches", type=int, default=300, help="timed batches (paced)")
    ap.add_argument("--num-workers", type=int, default=0, help="DataLoader workers")
    ap.add_argument("--delay-ms", type=float, default=50.0, help="added per object request")
    ap.add_argument("--step-ms", type=float, default=10.0, help="simulated training step")
    ap.add_argument(
        "--only", help="comma-separated measurement labels to run (default: all; ratios need pairs)"
    )
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))), flush=True)
        return
    if args.quick:
        args.runs, args.tokens, args.shard_tokens, args.piece_bytes = 1, 2 << 20, 64 << 10, 32 << 10
        args.seq_len, args.warmup, args.batches, args.step_ms = 512, 10, 200, 5.0
        args.paced_batches = 60
    from s3_server import S3Server

    args.out.mkdir(parents=True, exist_ok=True)
    name = args.name = "bench_s3_quick" if args.quick else "bench_s3"
    t_start = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp,
        S3Server(log_path=Path(tmp) / "moto.log") as s3,
    ):
        work = Path(tmp)
        local = make_local(work / "local", args.tokens, args.shard_tokens, args.piece_bytes)
        s3.make_bucket(BUCKET)
        dataset_bytes = publish(local, s3.env())
        print(f"# dataset: {dataset_bytes / 1e6:.1f} MB locally and in s3://{BUCKET}/{PREFIX}")
        plan = measurements(args, dataset_bytes)
        if args.only:
            wanted = {label.strip() for label in args.only.split(",")}
            plan = [m for m in plan if m["label"] in wanted]
        runs: dict[str, list[dict[str, Any]]] = {m["label"]: [] for m in plan}
        for r in range(args.runs):
            for m in plan:
                result = measure(m, args, local, s3, work, seed=r)
                runs[m["label"]].append(result)
                print(
                    f"# run {r} {m['label']}: {result['tokens_per_s'] / 1e6:.2f} Mtok/s, "
                    f"TTFB {result['ttfb_s'] * 1e3:.0f} ms, "
                    f"p99 {result['wait_p99_s'] * 1e3:.1f} ms",
                    flush=True,
                )
    summary = {label: summarize(rs) for label, rs in runs.items()}
    rat = ratios(summary, args.delay_ms) if not args.only else {}
    text = table(summary)
    print(text)
    print()
    for key, value in rat.items():
        print(f"{key:<44}{value:>8.2f}x")
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "runs": args.runs,
        "tokens": args.tokens,
        "dataset_bytes": dataset_bytes,
        "shard_tokens": args.shard_tokens,
        "piece_bytes": args.piece_bytes,
        "batch": [args.batch_size, args.seq_len],
        "warmup": args.warmup,
        "batches": args.batches,
        "paced_batches": args.paced_batches,
        "num_workers": args.num_workers,
        "delay_ms": args.delay_ms,
        "step_ms": args.step_ms,
        "cpus": os.cpu_count(),
        "seconds": time.perf_counter() - t_start,
        "targets": {"steady_tokens_per_s_ratio": ">= 0.9", "p99_wait_ratio": "<= 2"},
    }
    result = {"meta": meta, "measurements": summary, "ratios": rat, "table": text}
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out / name}.json", flush=True)


if __name__ == "__main__":
    main()
