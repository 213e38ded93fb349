"""Fair share on a real server: tokens served per tenant follow weights, not connections.

Alice (weight 1) reads with four connections; against her, one connection of Bob (weight
3) and, in a second run, one of Carol (weight 1), on a server whose egress is capped so
that the jobs compete; in a third, alice spreads over 16 jobs against Carol's one (the
share is per tenant: still 1.0, where per-job fair share gave Carol 1/16). The deficit
round robin itself is unit-tested without sockets (``tests/test_scheduler.py``); this
measures the whole path and prints the ratio, which should be near the weight ratio.

    .venv/bin/python benchmarks/bench_fairness.py            # 4 s per pair
    .venv/bin/python benchmarks/bench_fairness.py --quick    # 2 s per pair
"""

from __future__ import annotations

import argparse
import collections
import itertools
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from tokenfeed.protocol import JobSpec
from tokenfeed.transport.client import ClientOptions, FeedClient, Request
from tokenfeed_server.dataplane.auth import token_digest
from tokenfeed_server.launch import ServerProcess
from tokenfeed_server.store import TokenizerInfo, write_dataset

TOKENS = {"alice": "alice-token-0123456789abcdef", "bob": "bob-token-fedcba9876543210xyz"}
TOKENS["carol"] = "carol-token-abcdefghijklmnop"
ADMIN = "admin-token-zyxwvutsrqponmlkj"
WEIGHTS = {"alice": 1, "bob": 3, "carol": 1}


def make_store(root: Path) -> Path:
    rng = np.random.default_rng(1)
    docs = [
        rng.integers(0, 256, size=int(n), dtype=np.uint16) for n in rng.integers(100, 5000, 400)
    ]
    write_dataset(
        root,
        "alpha",
        docs,
        shuffle_seed=0,
        tokenizer=TokenizerInfo(kind="byte", vocab_size=257, eos_id=256),
    )
    tenants = root / "tenants.toml"
    lines = [f'admin_token_sha256 = "{token_digest(ADMIN)}"']
    for name, token in TOKENS.items():
        lines += ["[[tenant]]", f'name = "{name}"', f'token = "{token}"']
        lines += ['datasets = ["alpha"]', f"weight = {WEIGHTS[name]}"]
    tenants.write_text("\n".join(lines) + "\n")
    return tenants


def served_by_tenant(http: str) -> collections.Counter[str]:
    jobs = httpx.get(
        f"{http}/v1/jobs", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10
    ).json()
    out: collections.Counter[str] = collections.Counter()
    for job in jobs:
        out[job["tenant"]] += job["tokens_served"]
    return out


def share(srv: ServerProcess, other: str, seconds: float, alice_jobs: int = 1) -> float:
    """Tokens served to ``other`` per token served to alice while both are backlogged;
    alice reads with four connections to one job, or one connection to each of
    ``alice_jobs`` jobs (other seeds: the way a script that opens many jobs reads)."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def pull(tenant: str, worker: int, seed: int = 0) -> None:
        options = ClientOptions(token=TOKENS[tenant], window=8, deadline=30.0)
        job = JobSpec("alpha", 1023, 8, seed, 1)
        try:
            with FeedClient(srv.zmq, job, rank=0, worker=worker, options=options) as c:
                count = c.hello().max_count
                requests = (Request(pos=i * count * 8, count=count) for i in itertools.count())
                for _ in c.stream(requests):
                    if stop.is_set():
                        return
        except BaseException as exc:
            errors.append(exc)

    if alice_jobs == 1:
        threads = [threading.Thread(target=pull, args=("alice", w)) for w in range(4)]
    else:
        threads = [threading.Thread(target=pull, args=("alice", 0, s)) for s in range(alice_jobs)]
    threads.append(threading.Thread(target=pull, args=(other, 0)))
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)  # let both jobs build a backlog
        before = served_by_tenant(srv.http)
        time.sleep(seconds)
        after = served_by_tenant(srv.http)  # the snapshot is at most half a second old
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    if errors:
        raise errors[0]
    return (after[other] - before[other]) / max(1, after["alice"] - before["alice"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    seconds = 2.0 if args.quick else 4.0
    with tempfile.TemporaryDirectory() as tmp:
        tenants = make_store(Path(tmp))
        extra = ["--tenants", str(tenants), "--max-tokens-per-s", "8000000"]
        print(f"{'pair':<26} {'weights':>8} {'served ratio':>13}")
        for other, jobs in (("bob", 1), ("carol", 1), ("carol", 16)):
            srv = ServerProcess(Path(tmp), extra=extra).start()
            try:
                ratio = share(srv, other, seconds, alice_jobs=jobs)
            finally:
                srv.stop()
            expected = WEIGHTS[other] / WEIGHTS["alice"]
            pair = f"{other}/alice ({jobs} job{'s' if jobs > 1 else ''})"
            print(f"{pair:<26} {expected:>8.1f} {ratio:>13.3f}")


if __name__ == "__main__":
    main()
