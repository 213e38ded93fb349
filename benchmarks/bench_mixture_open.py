"""The data plane's busiest loop turn while jobs of a big 64-source mixture open and close.

A real ``tokenfeed-server serve`` process over 64 small datasets; a 64-source mixture
with four distinct weightings whose tables hold close to ``MAX_TABLE_ROWS`` rows (every
open of a job builds them again: the last job that read them freed them). One thread
opens a job of the mixture (a new run each time), reads one chunk and says bye,
``--opens`` times; another reads a single-dataset job all along and notes its slowest
request (what a trainer of another job waits). At the end the server's
``tokenfeed_loop_busiest_turn_seconds{window="since_start"}`` is read from ``/metrics``.
Target (issue 23): under 0.050 s. ``--new-seeds`` gives every job a seed of its own, so
its first order block is not cached yet (computed off the loop since issue 23's fix);
``--pause`` spaces the opens.

``--src DIR`` runs the server from another source tree. For a before/after figure
across a store format change run the whole script from that tree, so the store is
written in its format too (``git archive HEAD server client | tar -x -C /tmp/before``)::

    .venv/bin/python benchmarks/bench_mixture_open.py --opens 6
    PYTHONPATH=/tmp/before/server:/tmp/before/client \
        .venv/bin/python benchmarks/bench_mixture_open.py --opens 6
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import zmq

from tokenfeed import protocol
from tokenfeed_server.launch import ServerProcess
from tokenfeed_server.store import TokenizerInfo, write_dataset

SOURCES = 64
SEQ, BATCH = 64, 4


def big_schedule() -> list[list[int]]:
    """Four segments, 64 sources, periods that do not reduce (a weight 1 in each)."""
    rows = []
    for k in range(4):
        weights = [1040 - k] + [1040] * (SOURCES - 2) + [1]
        rows.append([k * 100_000, *weights])
    return rows


def make_store(root: Path) -> list[str]:
    names = [f"src{i:02d}" for i in range(SOURCES)]
    rng = np.random.default_rng(0)
    tok = TokenizerInfo(kind="byte", vocab_size=257, eos_id=256)
    for i, name in enumerate(names):
        docs = [rng.integers(0, 256, size=200, dtype=np.uint16) for _ in range(20)]
        write_dataset(root, name, docs, tokenizer=tok, shuffle_seed=i)
    return names


class Wire:
    def __init__(self, endpoint: str) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.req = 0

    def ask(self, msg: protocol.Message) -> tuple[protocol.Message, list[Any]]:
        self.sock.send(msg.header())
        if not self.sock.poll(60_000):
            raise RuntimeError(f"no answer to {msg.TYPE}")
        frames = self.sock.recv_multipart()
        return protocol.decode_header(frames[0]), frames[1:]

    def welcome(self, hello: protocol.Hello) -> protocol.Welcome:
        while True:  # a new server answers retryably while it builds the tables
            reply, _ = self.ask(hello)
            if isinstance(reply, protocol.Welcome):
                return reply
            if not (isinstance(reply, protocol.Err) and reply.retry):
                raise RuntimeError(str(reply))
            time.sleep(0.05)

    def get(self, job: str, pos: int) -> None:
        self.req += 1
        msg = protocol.Get(req=self.req, job=job, rank=0, pos=pos, count=1, stride=1)
        reply, _ = self.ask(msg)
        if not isinstance(reply, protocol.Chunk):
            raise RuntimeError(str(reply))


def hello(**kw: Any) -> protocol.Hello:
    args: dict[str, Any] = {
        "dataset": "", "seq_len": SEQ, "batch_size": BATCH, "seed": 1, "world_size": 1,
        "rank": 0, "worker": 0, "window": 4, "client": "bench",
    }  # fmt: skip
    args.update(kw)
    return protocol.Hello(**args)


def reader(endpoint: str, stop: threading.Event, out: dict[str, float]) -> None:
    """Reads a single-dataset job all along; notes its slowest request."""
    wire = Wire(endpoint)
    job = wire.welcome(hello(dataset="src00", client="reader")).job
    pos, slowest, n = 0, 0.0, 0
    while not stop.is_set():
        t0 = time.perf_counter()
        wire.get(job, pos)
        slowest = max(slowest, time.perf_counter() - t0)
        pos, n = (pos + BATCH) % 64, n + 1
    out.update(slowest_get_s=slowest, gets=n)


def busiest_turn(http: str) -> float:
    for line in httpx.get(http + "/metrics", timeout=10).text.splitlines():
        if line.startswith('tokenfeed_loop_busiest_turn_seconds{window="since_start"}'):
            return float(line.split()[-1])
    raise RuntimeError("no tokenfeed_loop_busiest_turn_seconds in /metrics")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opens", type=int, default=8, help="mixture jobs opened and closed")
    parser.add_argument("--src", type=Path, help="run the server from this source tree")
    parser.add_argument(
        "--pause",
        type=float,
        default=0.0,
        help="seconds between opens (over the 0.5 s housekeeping, every open builds the "
        "tables again: the last job freed them)",
    )
    parser.add_argument(
        "--new-seeds",
        action="store_true",
        help="a seed of its own per job (its first order block is not cached yet)",
    )
    args = parser.parse_args()
    env = dict(os.environ)
    if args.src is not None:
        env["PYTHONPATH"] = f"{args.src / 'server'}:{args.src / 'client'}"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "store"
        names = make_store(root)
        schedule = big_schedule()
        with ServerProcess(root, env=env, log_path=Path(tmp) / "server.log") as server:
            stop, seen = threading.Event(), dict[str, float]()
            thread = threading.Thread(target=reader, args=(server.zmq, stop, seen))
            thread.start()
            time.sleep(0.5)
            wire = Wire(server.zmq)
            opened = []
            for i in range(args.opens):
                t0 = time.perf_counter()
                seed = 100 + i if args.new_seeds else 1
                msg = hello(
                    sources=tuple(names), schedule=schedule, run=f"r{i}", client=f"m{i}", seed=seed
                )
                job = wire.welcome(msg).job
                wire.get(job, 0)
                wire.sock.send(protocol.Bye(consumed=BATCH).header())
                opened.append(time.perf_counter() - t0)
                time.sleep(args.pause)
            stop.set()
            thread.join()
            time.sleep(1.0)  # one more snapshot
            turn = busiest_turn(server.http)
    print(f"server source: {args.src or os.environ.get('PYTHONPATH') or 'this tree'}")
    print(f"mixture: {SOURCES} sources, table rows {sum(sum(r[1:]) for r in schedule)}")
    print(f"opens: {args.opens}, median open+read+bye {np.median(opened):.3f} s")
    print(f"other job: {seen.get('gets', 0)} gets, slowest {seen.get('slowest_get_s', 0):.3f} s")
    print(f"busiest loop turn: {turn * 1000:.1f} ms (target < 50 ms)")


if __name__ == "__main__":
    main()
