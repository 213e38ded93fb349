"""Soak: a server under a churn of trainers for minutes, sampled for growth.

    .venv/bin/python benchmarks/soak.py --minutes 60     # the issue's soak
    .venv/bin/python benchmarks/soak.py --minutes 3      # a smoke run

Two servers: one with two tenants and three local datasets, one serving a dataset from a
real S3 protocol server (moto's server mode, a separate process) through a cache a third
of its size. Against them, a churn of trainers (each a fresh process: ``num_workers`` 0
and 2, global and block shuffle, a scheduled two-source mixture, resumes from a saved
state, a third of them SIGKILLed mid-run), 2-4 alive at a time, while a dashboard thread
polls the HTTP API. Every ``--sample-s`` seconds it records, per server: RSS and USS,
open files, threads, metric series (sample lines of ``/metrics``), jobs, and the
server's own memory by owner (``/v1/status``'s ``memory``).

At the end every trainer has left and the servers forgot the jobs (``--job-ttl-s``): the
"after" sample is taken then. Reported per server: the RSS slope after warm-up (least
squares over the samples past ``--warmup`` of the run, extrapolated to MB per day), the
after/baseline ratios, and every clean trainer's correctness (each window of its slice
exactly once: no duplicate window ids per source within the epoch, the exact count).
Writes ``results/soak.json``. Targets (issue 28): slope <= 50 MB/day, RSS after within
1.1x of the post-warm-up baseline, memory-by-owner, fds, threads and series back to
baseline, zero correctness problems.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))  # the moto server helper the tests use

TOKENS = {"alice": "alice-soak-token-0123456789", "bob": "bob-soak-token-9876543210ab"}
ADMIN = "admin-soak-token-abcdefghijklmn"
LOCAL = ("web", "code", "math")
BUCKET, PREFIX, REMOTE = "soak", "store", "remote"
_RESULT = "soak-result "  # the child's one line for the parent (its log shares the file)


# -- the data -------------------------------------------------------------------------


def write_local(root: Path, name: str, seed: int, n_docs: int = 800) -> None:
    """A seeded byte-token dataset ``name`` (a few hundred KB) in store ``root``."""
    from tokenfeed_server.store import TokenizerInfo, write_dataset

    rng = np.random.default_rng(seed)
    docs = [
        rng.integers(0, 256, size=int(n), dtype=np.uint16) for n in rng.integers(50, 4000, n_docs)
    ]
    tok = TokenizerInfo(kind="byte", vocab_size=257, eos_id=256)
    write_dataset(
        root,
        name,
        docs,
        tokenizer=tok,
        shuffle_seed=seed,
        shard_tokens=1 << 18,
        piece_bytes=1 << 16,
    )


def tenants_file(root: Path) -> Path:
    from tokenfeed_server.dataplane.auth import token_digest

    lines = [f'admin_token_sha256 = "{token_digest(ADMIN)}"']
    for name, token in TOKENS.items():
        lines += [
            "[[tenant]]",
            f'name = "{name}"',
            f'token = "{token}"',
            f"datasets = {list(LOCAL)!r}",
        ]
    path = root / "tenants.toml"
    path.write_text("\n".join(lines).replace("'", '"') + "\n")
    return path


def publish_remote(scratch: Path, env: dict[str, str]) -> int:
    """Write dataset ``remote`` and upload it to s3://BUCKET/PREFIX; return its bytes."""
    from tokenfeed_server.store.objects import ObjectStore, S3Location
    from tokenfeed_server.store.publish import publish_dataset

    write_local(scratch, REMOTE, seed=7, n_docs=1500)
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        publish_dataset(scratch / REMOTE, ObjectStore(S3Location(BUCKET, PREFIX)), REMOTE)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return sum(p.stat().st_size for p in (scratch / REMOTE).glob("*.bin"))


# -- the trainers ---------------------------------------------------------------------


def trainer_specs(rng: random.Random, local_zmq: str, remote_zmq: str) -> dict[str, Any]:
    """One trainer's recipe, drawn at random (seeded): what it reads and how it ends."""
    remote = rng.random() < 0.25
    mixture = not remote and rng.random() < 0.25
    tenant = rng.choice(sorted(TOKENS))
    spec: dict[str, Any] = {
        "endpoint": remote_zmq if remote else local_zmq,
        "token": None if remote else TOKENS[tenant],
        "dataset": REMOTE if remote else rng.choice(LOCAL),
        "mixture": mixture,
        "seq_len": rng.choice([127, 255, 511, 1023]),
        "batch_size": rng.choice([2, 4, 8]),
        "seed": rng.randrange(1 << 30),
        "workers": rng.choice([0, 2]),
        "shuffle": "block" if remote or rng.random() < 0.3 else "global",
        "batches": rng.randrange(20, 80),
        "resume_at": None,
        "kill": rng.random() < 1 / 3,
    }
    if not spec["kill"] and rng.random() < 0.3:
        spec["resume_at"] = spec["batches"] // 2
    return spec


def child(spec: dict[str, Any]) -> None:
    """Run one trainer; print one JSON line: batches and any correctness problems."""
    from tokenfeed import Mixture, TokenFeedDataset, TokenFeedLoader

    def make() -> TokenFeedLoader:
        data: Any = spec["dataset"]
        if spec["mixture"]:
            data = Mixture(
                [(0, {"web": 3, "code": 1}), (64 * spec["batch_size"], {"web": 1, "code": 1})]
            )
        ds = TokenFeedDataset(
            spec["endpoint"], data, seq_len=spec["seq_len"], batch_size=spec["batch_size"],
            seed=spec["seed"], rank=0, world_size=1, token=spec["token"], shuffle=spec["shuffle"],
            samples=spec["batches"] * spec["batch_size"], deadline=60.0,
        )  # fmt: skip
        return TokenFeedLoader(ds, num_workers=spec["workers"])

    seen: dict[tuple[int, int], int] = {}
    batches = 0
    loader = make()
    it = iter(loader)
    for batch in it:
        _record(seen, batch)
        batches += 1
        if spec["resume_at"] is not None and batches == spec["resume_at"]:
            state = loader.state_dict()
            del it, loader
            loader = make()
            loader.load_state_dict(state)
            it = iter(loader)
    dupes = sum(1 for n in seen.values() if n > 1)
    summary = {"batches": batches, "rows": sum(seen.values()), "duplicates": dupes}
    print(_RESULT + json.dumps(summary), flush=True)


def _record(seen: dict[tuple[int, int], int], batch: dict[str, Any]) -> None:
    windows = batch["window_ids"].reshape(-1).tolist()
    sources = batch["source"].reshape(-1).tolist() if "source" in batch else [0] * len(windows)
    epochs = batch["epoch"].reshape(-1).tolist()
    for s, w, e in zip(sources, windows, epochs, strict=True):
        key = (s, w * 1000 + e)
        seen[key] = seen.get(key, 0) + 1


class Churn:
    """Start trainers (2-4 alive), kill the ones drawn to die, check the clean ones."""

    def __init__(self, local_zmq: str, remote_zmq: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.endpoints = (local_zmq, remote_zmq)
        self.alive: list[tuple[subprocess.Popen[str], dict[str, Any], float]] = []
        self.started = self.killed = self.clean = self.failed = 0
        self.problems: list[str] = []
        self.rows = 0
        self.outputs: dict[int, Any] = {}

    def step(self) -> None:
        for proc, spec, born in list(self.alive):
            if spec["kill"] and proc.poll() is None and time.monotonic() - born > 2.0:
                _kill_group(proc)
            if proc.poll() is not None:
                self.alive.remove((proc, spec, born))
                self._finished(proc, spec)
        want = self.rng.randint(2, 4)
        while len(self.alive) < want:
            spec = trainer_specs(self.rng, *self.endpoints)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            # Output to files, not pipes: a chatty child must never block on a full pipe,
            # and its DataLoader workers (killed with it, as a group) hold no pipe open.
            out = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in _finished)
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env,
                start_new_session=True,
            )  # fmt: skip
            self.outputs[proc.pid] = out
            self.alive.append((proc, spec, time.monotonic()))
            self.started += 1

    def _finished(self, proc: subprocess.Popen[str], spec: dict[str, Any]) -> None:
        with self.outputs.pop(proc.pid) as f:
            f.seek(0)
            out = err = f.read()
        _kill_group(proc)  # any DataLoader worker it left behind
        if spec["kill"] and proc.returncode == -signal.SIGKILL:
            self.killed += 1
            return
        if proc.returncode != 0:
            self.failed += 1
            self.problems.append(f"trainer exited {proc.returncode}: {err.strip()[-400:]}")
            return
        lines = [line for line in out.splitlines() if line.startswith(_RESULT)]
        if not lines:
            self.failed += 1
            self.problems.append(f"trainer printed no result: {out.strip()[-400:]}")
            return
        result = json.loads(lines[-1].removeprefix(_RESULT))
        self.clean += 1
        self.rows += int(result["rows"])
        if result["batches"] != spec["batches"] or result["duplicates"]:
            self.problems.append(f"{spec}: got {result}")

    def drain(self, timeout: float = 120.0) -> None:
        for proc, spec, _ in self.alive:
            if spec["kill"]:
                _kill_group(proc)
        end = time.monotonic() + timeout
        while self.alive and time.monotonic() < end:
            self.step_finish_only()
            time.sleep(0.2)

    def step_finish_only(self) -> None:
        for proc, spec, born in list(self.alive):
            if proc.poll() is not None:
                self.alive.remove((proc, spec, born))
                self._finished(proc, spec)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL a trainer and its DataLoader workers (its own session: one process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


# -- sampling -------------------------------------------------------------------------


def sample(name: str, server: Any, t0: float) -> dict[str, Any]:
    """One reading of a server process: OS figures and its own."""
    assert server.proc is not None
    proc = psutil.Process(server.proc.pid)
    headers = {"Authorization": f"Bearer {ADMIN}"} if name == "local" else {}
    status = httpx.get(server.http + "/v1/status", headers=headers, timeout=10).json()
    metrics = httpx.get(server.http + "/metrics", headers=headers, timeout=10).text
    jobs = httpx.get(server.http + "/v1/jobs", headers=headers, timeout=10).json()
    return {
        "t": round(time.monotonic() - t0, 1),
        "rss_mb": proc.memory_info().rss / 1e6,
        "uss_mb": proc.memory_full_info().uss / 1e6,
        "fds": proc.num_fds(),
        "threads": proc.num_threads(),
        "series": sum(1 for line in metrics.splitlines() if line and not line.startswith("#")),
        "jobs": len(jobs),
        "memory": status.get("memory", {}),
    }


def dashboard(servers: dict[str, Any], stop: threading.Event) -> None:
    """What an operator's page does: poll every view twice a second."""
    while not stop.is_set():
        for name, server in servers.items():
            headers = {"Authorization": f"Bearer {ADMIN}"} if name == "local" else {}
            for path in ("/v1/status", "/v1/jobs", "/v1/datasets", "/metrics"):
                with contextlib.suppress(httpx.HTTPError):
                    httpx.get(server.http + path, headers=headers, timeout=5)
        stop.wait(0.5)


def slope_mb_per_day(points: list[dict[str, Any]]) -> float:
    """Least-squares slope of RSS over time, in MB per day."""
    if len(points) < 3:
        return float("nan")
    t = np.array([p["t"] for p in points])
    y = np.array([p["rss_mb"] for p in points])
    return float(np.polyfit(t, y, 1)[0] * 86400)


def report(
    name: str, samples: list[dict[str, Any]], after: dict[str, Any], warmup: float
) -> dict[str, Any]:
    steady = samples[int(len(samples) * warmup) :]
    base = steady[0]
    out = {
        "slope_mb_per_day": round(slope_mb_per_day(steady), 1),
        "rss_baseline_mb": round(base["rss_mb"], 1),
        "rss_peak_mb": round(max(s["rss_mb"] for s in samples), 1),
        "rss_after_mb": round(after["rss_mb"], 1),
        "rss_after_ratio": round(after["rss_mb"] / base["rss_mb"], 3),
        "fds": [base["fds"], after["fds"]],
        "threads": [base["threads"], after["threads"]],
        "series": [base["series"], after["series"]],
        "jobs_after": after["jobs"],
        "memory_baseline": base["memory"],
        "memory_after": after["memory"],
    }
    print(
        f"[{name}] slope {out['slope_mb_per_day']} MB/day (target <= 50); RSS baseline "
        f"{out['rss_baseline_mb']} MB, peak {out['rss_peak_mb']}, after {out['rss_after_mb']} "
        f"({out['rss_after_ratio']}x, target <= 1.1); fds {out['fds']}, threads "
        f"{out['threads']}, series {out['series']}, jobs after {out['jobs_after']}"
    )
    print(
        f"[{name}] memory by owner, baseline -> after: "
        + ", ".join(f"{k} {base['memory'].get(k)} -> {v}" for k, v in after["memory"].items())
    )
    return out


# -- main -----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    from s3_server import S3Server
    from tokenfeed_server.launch import ServerProcess

    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    store = tmp / "store"
    for i, name in enumerate(LOCAL):
        write_local(store, name, seed=i)
    serve = ["--job-ttl-s", str(args.job_ttl_s)]
    local = ServerProcess(store, extra=["--tenants", str(tenants_file(tmp)), *serve],
                          log_path=tmp / "local.log").start(60)  # fmt: skip
    s3 = S3Server(log_path=tmp / "moto.log").start(60)
    s3.make_bucket(BUCKET)
    env = s3.env(dict(os.environ))
    size = publish_remote(tmp / "scratch", env)
    cmd = [sys.executable, "-m", "tokenfeed_server.cli", "serve", "--store", f"s3://{BUCKET}/{PREFIX}",
           "--host", "127.0.0.1", "--zmq-port", "0", "--http-port", "0", "--cache-dir",
           str(tmp / "cache"), "--cache-size", str(max(size // 3, 1 << 20)), *serve]  # fmt: skip
    remote = ServerProcess(command=cmd, env=env, log_path=tmp / "remote.log").start(60)
    servers = {"local": local, "remote": remote}
    stop = threading.Event()
    poller = threading.Thread(target=dashboard, args=(servers, stop), daemon=True)
    poller.start()
    churn = Churn(local.zmq, remote.zmq, args.seed)
    samples: dict[str, list[dict[str, Any]]] = {n: [] for n in servers}
    t0 = time.monotonic()
    next_sample = t0
    try:
        while time.monotonic() - t0 < args.minutes * 60:
            churn.step()
            if time.monotonic() >= next_sample:
                for name, server in servers.items():
                    samples[name].append(sample(name, server, t0))
                next_sample += args.sample_s
            time.sleep(0.2)
        churn.drain()
        stop.set()
        # the servers forget the ended jobs, and release pools idle past --memory-idle-s
        time.sleep(max(args.job_ttl_s + 3.0, args.settle_s))
        after = {name: sample(name, server, t0) for name, server in servers.items()}
    finally:
        stop.set()
        for server in servers.values():
            server.stop()
        s3.stop()
    print(
        f"trainers: {churn.started} started, {churn.clean} clean, {churn.killed} killed, "
        f"{churn.failed} failed; rows checked {churn.rows}; problems {len(churn.problems)}"
    )
    for problem in churn.problems[:10]:
        print("  problem:", problem)
    result = {
        "minutes": args.minutes,
        "trainers": {
            "started": churn.started,
            "clean": churn.clean,
            "killed": churn.killed,
            "failed": churn.failed,
            "rows_checked": churn.rows,
        },
        "problems": churn.problems,
        "servers": {n: report(n, samples[n], after[n], args.warmup) for n in servers},
        "samples": samples,
    }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--sample-s", type=float, default=15.0)
    ap.add_argument("--warmup", type=float, default=0.25, help="fraction of the run before the fit")
    ap.add_argument("--job-ttl-s", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle-s", type=float, default=75.0, help="wait after the churn")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    result = run(args)
    out = ROOT / "results" / "soak.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    sys.exit(1 if result["problems"] else 0)


if __name__ == "__main__":
    main()
