"""What security costs: one client's throughput with no auth, a PLAIN token, and CURVE.

Each mode runs its own server process on loopback; the modes run in alternation, several
rounds, and the table gives the median and min-max of tokens/s with the ratio to the open
server. The client is the bare :class:`tokenfeed.transport.client.FeedClient` (no torch), so the
figure is the wire's, not the DataLoader's.

    .venv/bin/python benchmarks/bench_security.py            # full run
    .venv/bin/python benchmarks/bench_security.py --quick    # seconds, for CI
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tokenfeed.protocol import JobSpec
from tokenfeed.transport.client import ClientOptions, FeedClient, Request
from tokenfeed_server.launch import ServerProcess
from tokenfeed_server.store import TokenizerInfo, write_dataset

TOKEN = "bench-token-0123456789abcdef"


def make_store(root: Path, tokens: int) -> None:
    rng = np.random.default_rng(0)
    docs = (rng.integers(0, 50_000, size=1 << 20, dtype=np.uint16) for _ in range(tokens >> 20))
    write_dataset(
        root,
        "bench",
        docs,
        shuffle_seed=0,
        tokenizer=TokenizerInfo(kind="synthetic", vocab_size=50_257, eos_id=50_256),
    )


def pull(endpoint: str, options: ClientOptions, batches: int) -> float:
    """Tokens per second for ``batches`` batches of 8 x 2048."""
    job = JobSpec("bench", 2048, 8, 0, 1)
    with FeedClient(endpoint, job, rank=0, worker=0, options=options) as client:
        count = client.hello().max_count
        requests = [
            Request(pos=i * 8, count=min(count, batches - i)) for i in range(0, batches, count)
        ]
        t0 = time.perf_counter()
        tokens = sum(chunk.tokens.size for chunk in client.stream(requests))
        return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rounds, batches = (2, 200) if args.quick else (5, 3000)
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp)
        make_store(store, (8 if args.quick else 64) << 20)
        tenants = store / "tenants.toml"
        tenants.write_text(f'[[tenant]]\nname = "b"\ntoken = "{TOKEN}"\ndatasets = ["*"]\n')
        keys = store / "keys"
        subprocess.run(
            [sys.executable, "-m", "tokenfeed_server.cli", "keygen", str(keys)],
            check=True,
            capture_output=True,
        )
        public = (keys / "server.key.pub").read_text().strip()
        (store / "token").write_text(TOKEN)
        client = subprocess.run(  # the key the operator issues to the tenant
            [sys.executable, "-m", "tokenfeed_server.cli", "client-key", "--curve-secret-key",
             str(keys / "server.key"), "--token-file", str(store / "token")],
            check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        modes = {
            "open": ([], ClientOptions()),
            "plain token": (["--tenants", str(tenants)], ClientOptions(token=TOKEN)),
            "curve": (
                ["--tenants", str(tenants), "--curve-secret-key", str(keys / "server.key")],
                ClientOptions(token=TOKEN, server_public_key=public, client_secret_key=client),
            ),
        }
        servers = {
            name: ServerProcess(store, extra=extra).start() for name, (extra, _) in modes.items()
        }
        results: dict[str, list[float]] = {name: [] for name in modes}
        try:
            for _ in range(rounds):  # alternate, so drift hits every mode alike
                for name, (_, options) in modes.items():
                    results[name].append(pull(servers[name].zmq, options, batches))
        finally:
            for server in servers.values():
                server.stop()
    base = statistics.median(results["open"])
    print(f"{'mode':<12} {'Mtok/s median':>14} {'min-max':>16} {'vs open':>8}")
    for name, values in results.items():
        med = statistics.median(values)
        print(
            f"{name:<12} {med / 1e6:>14.1f} {min(values) / 1e6:>7.1f}-{max(values) / 1e6:<8.1f}"
            f" {med / base:>7.2f}x"
        )


if __name__ == "__main__":
    main()
