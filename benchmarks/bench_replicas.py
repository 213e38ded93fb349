"""Replicas: aggregate throughput of 4 trainers against 1 vs 2 servers, and the failover pause.

Throughput: four trainer processes (ranks 0-3 of one job, one connection each, spread
over the replicas by rank) read for a fixed time; the figure is the tokens all four
received per second. Failover: one trainer reads from two replicas, the one it started on
is SIGKILLed, and the pause is the longest wait for an answer after the kill; the whole run
is compared with an undisturbed one (it should take about ``request_timeout`` longer).

    .venv/bin/python benchmarks/bench_replicas.py            # 5 s per throughput run
    .venv/bin/python benchmarks/bench_replicas.py --quick    # 2 s

On a 2-core machine two replicas do not raise the aggregate: both servers and the four
trainers share the same two cores, and one server already keeps them busy (the data is
in the page cache, so a server is CPU-bound: encoding, copying, the ZeroMQ I/O thread).
Replicas add throughput when they bring their own CPUs and NICs: one per node.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from tokenfeed.protocol import JobSpec
from tokenfeed.transport.client import ClientOptions, FeedClient, Request
from tokenfeed_server.launch import ServerProcess
from tokenfeed_server.store import TokenizerInfo, write_dataset

SEQ, BATCH, TRAINERS = 512, 8, 4


def make_store(root: Path) -> Path:
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 50_000, size=4096, dtype=np.uint16) for _ in range(2000)]
    info = TokenizerInfo(kind="byte", vocab_size=50_001, eos_id=50_000)
    write_dataset(root, "alpha", docs, shuffle_seed=0, tokenizer=info)
    return root


def requests(world: int, count: int) -> Iterator[Request]:
    # endless: position i*count global batches, count batches per request
    step = 0
    while True:
        yield Request(pos=step * world * BATCH, count=count)
        step += count


def trainer(endpoints: Sequence[str], rank: int, seconds: float, out: mp.SimpleQueue[int]) -> None:
    job = JobSpec("alpha", SEQ, BATCH, 0, TRAINERS)
    tokens = 0
    with FeedClient(list(endpoints), job, rank=rank, worker=0) as client:
        end = time.monotonic() + seconds
        for answer in client.stream(requests(TRAINERS, 8)):
            tokens += answer.tokens.size
            if time.monotonic() >= end:
                break
    out.put(tokens)


def throughput(endpoints: Sequence[str], seconds: float) -> float:
    """Tokens per second received by all trainers together."""
    ctx = mp.get_context("fork")
    out: mp.SimpleQueue[int] = ctx.SimpleQueue()
    procs = [ctx.Process(target=trainer, args=(endpoints, r, seconds, out)) for r in range(4)]
    started = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=seconds + 120)
    elapsed = time.monotonic() - started
    return sum(out.get() for _ in procs) / elapsed


def failover(store: Path, request_timeout: float, n: int = 400) -> tuple[float, float, float]:
    """(pause from kill to next answer, disturbed run time, undisturbed run time)."""
    job = JobSpec("alpha", SEQ, BATCH, 0, 1)
    options = ClientOptions(request_timeout=request_timeout, deadline=60.0)
    servers = [ServerProcess(store).start() for _ in range(2)]
    try:
        endpoints = [s.zmq for s in servers]

        def read(kill_at: int | None) -> tuple[float, float]:
            # the pause: the longest wait for an answer after the kill (the first few
            # answers after it may already have been received)
            pause, killed = 0.0, False
            with FeedClient(endpoints, job, rank=0, worker=0, options=options) as client:
                started = last = time.monotonic()
                stream = client.stream(Request(pos=i * BATCH, count=1) for i in range(n))
                for i, _ in enumerate(stream):
                    now = time.monotonic()
                    if killed:
                        pause = max(pause, now - last)
                    if i == kill_at:
                        servers[0].kill()  # slot 0: the replica this client started on
                        killed = True
                    last = time.monotonic()
                return pause, time.monotonic() - started

        _, undisturbed = read(None)
        pause, disturbed = read(n // 4)
        return pause, disturbed, undisturbed
    finally:
        for s in servers:
            s.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 s per throughput run")
    ap.add_argument("--request-timeout", type=float, default=2.0)
    args = ap.parse_args()
    seconds = 2.0 if args.quick else 5.0
    with tempfile.TemporaryDirectory() as tmp:
        store = make_store(Path(tmp) / "store")
        print(f"{'replicas':<9} {'trainers':>8} {'aggregate Mtok/s':>17}")
        for n in (1, 2):
            servers = [ServerProcess(store).start() for _ in range(n)]
            try:
                rate = throughput([s.zmq for s in servers], seconds)
            finally:
                for s in servers:
                    s.stop()
            print(f"{n:<9} {TRAINERS:>8} {rate / 1e6:>17.1f}")
        pause, disturbed, undisturbed = failover(store, args.request_timeout)
        print(
            f"failover: longest wait for an answer after the SIGKILL {pause:.2f}s "
            f"(request_timeout {args.request_timeout:.1f}s); run {disturbed:.2f}s vs "
            f"{undisturbed:.2f}s undisturbed (+{disturbed - undisturbed:.2f}s)"
        )


if __name__ == "__main__":
    main()
