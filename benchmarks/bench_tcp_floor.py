"""The floor of the TCP path: what a server must spend per token to read random rows from
the page cache and send them over loopback TCP, with no scheduling, no protocol, no Python
per row.

Issue 25's target for the TCP path is server CPU per Gtok at most 1.3x this floor. The
floor process reads random 2,049-token uint16 rows with the same C helper the server uses
(``tokenfeed_server.store.rows``), 4 MiB per chunk as the server's chunks, and sends each
chunk with one zero-copy ZeroMQ send to a receiver process that drops it. Four rows: the
reads alone (with the C helper, and with the ``os.preadv`` fallback), the send alone (one
buffer sent again and again), and both. CPU is the sending process's (its ZeroMQ IO
thread included); medians of ``--runs``.

    .venv/bin/python benchmarks/bench_tcp_floor.py [--gtok 0.5] [--runs 3]

Compare with the ``server`` column of ``tokenfeed tcp nw=0`` in ``bench_loaders.py``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

from tokenfeed_server.store import rows as row_reader

SEQ = 2049  # tokens per row, as the loader benchmark's seq_len 2048 + 1
ROW_BYTES = SEQ * 2
ROWS_PER_CHUNK = 1024  # 4 MiB chunks, as the server's default --chunk-bytes

RECEIVER = """
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.PULL)
s.setsockopt(zmq.RCVHWM, 8)
port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
while s.recv(copy=False).bytes[:4] != b"stop":
    pass
"""


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread: ZeroMQ's IO thread too
    return r.ru_utime + r.ru_stime


def one_run(data: Path, chunks: int, read: bool, send: bool, portable: bool = False) -> float:
    """CPU seconds per Gtok of ``chunks`` chunks read and/or sent."""
    rx = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
    assert rx.stdout is not None
    port = int(rx.stdout.readline())
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 8)
    sock.connect(f"tcp://127.0.0.1:{port}")
    fd = os.open(data, os.O_RDONLY)
    n_rows = os.fstat(fd).st_size // ROW_BYTES - 1
    rng = np.random.default_rng(0)
    bufs = [np.empty((ROWS_PER_CHUNK, SEQ), dtype=np.uint16) for _ in range(16)]
    offsets = [
        (rng.integers(0, n_rows, ROWS_PER_CHUNK) * ROW_BYTES).tolist() for _ in range(chunks)
    ]
    try:
        cpu0 = _cpu()
        for i in range(chunks):
            buf = bufs[i % len(bufs)]
            if read:
                reader = row_reader._portable if portable else row_reader.read_rows
                got = reader(fd, zip(buf), offsets[i])
                assert got == buf.nbytes, got
            if send:
                sock.send(buf, copy=False)
        sock.send(b"stop")
        rx.wait(timeout=120)
        cpu = _cpu() - cpu0
    finally:
        os.close(fd)
        sock.close(linger=0)
        ctx.term()
        rx.kill()
    return cpu / (chunks * ROWS_PER_CHUNK * SEQ) * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gtok", type=float, default=0.5, help="tokens per run, in billions")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--data-mb", type=int, default=1024, help="the file rows are read from")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "tokens.bin"
        with open(data, "wb") as f:  # random tokens; read once so they are in the page cache
            rng = np.random.default_rng(1)
            for _ in range(args.data_mb // 64):
                f.write(rng.integers(0, 2**16, 32 << 20, dtype=np.uint16).tobytes())
        data.read_bytes()
        chunks = int(args.gtok * 1e9 / (ROWS_PER_CHUNK * SEQ))
        cases = {
            "read": (True, False, False),
            "read, os.preadv per row (the fallback)": (True, False, True),
            "send": (False, True, False),
            "read + send": (True, True, False),
        }
        results: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.runs):  # interleaved
            for name, (read, send, portable) in cases.items():
                results[name].append(one_run(data, chunks, read, send, portable))
                time.sleep(0.2)
    print(f"# rows read by: {row_reader.read_path()}; load {os.getloadavg()[0]:.2f}")
    print("| path | CPU s/Gtok (median) | runs |")
    print("| --- | --- | --- |")
    for name, values in results.items():
        runs = ", ".join(f"{v:.2f}" for v in values)
        print(f"| {name} | {statistics.median(values):.2f} | {runs} |")


if __name__ == "__main__":
    main()
