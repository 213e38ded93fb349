"""What a running server costs, read from outside: for ``bench_scale.py``.

The figures the scale benchmark reports for every scenario: anonymous memory and open
files of the server process (``/proc``), its CPU time, the data plane's busiest loop
turn (``/metrics``), and a raw ZeroMQ driver that holds thousands of connections in one
context (a :class:`~tokenfeed.transport.client.FeedClient` makes a context, so an IO
thread, per connection: fine for a trainer, not for 4,096 connections in one process).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import zmq

from tokenfeed import protocol
from tokenfeed.protocol import decode_header

_TICK = os.sysconf("SC_CLK_TCK")


def anon_mb(pid: int) -> float:
    """Anonymous resident memory of ``pid`` in MB (the page cache is not counted)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no Anonymous line in /proc/{pid}/smaps_rollup")


def open_files(pid: int) -> int:
    """Descriptors ``pid`` holds open (files, sockets, pipes)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds ``pid`` has used (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def busiest_turn_s(http: str) -> float:
    """The data plane loop's busiest turn since start, from ``/metrics``."""
    text = httpx.get(f"{http}/metrics", timeout=30).text
    found = re.search(r'tokenfeed_loop_busiest_turn_seconds\{window="since_start"\} (\S+)', text)
    if found is None:
        raise RuntimeError("/metrics has no tokenfeed_loop_busiest_turn_seconds")
    return float(found.group(1))


def wait_listed(http: str, names: Sequence[str], timeout: float = 600) -> float:
    """Seconds until ``/v1/datasets`` lists every one of ``names`` (polled every 10 ms)."""
    t0 = time.perf_counter()
    want = set(names)
    while time.perf_counter() - t0 < timeout:
        try:
            got = httpx.get(f"{http}/v1/datasets", timeout=timeout).json()
        except httpx.TransportError:
            time.sleep(0.01)
            continue
        if want <= {d["name"] for d in got}:
            return time.perf_counter() - t0
        time.sleep(0.01)
    raise TimeoutError(f"{len(want)} datasets not listed in {timeout} s")


@dataclass
class Conn:
    """One raw connection of :class:`Driver`: its job, worker and what it asked."""

    sock: zmq.Socket[bytes]
    spec: protocol.JobSpec
    worker: int
    workers: int
    job: str = ""
    max_count: int = 1
    asked: int = 0
    outstanding: int = 0


@dataclass
class Driver:
    """Many DEALER connections in one context, speaking the wire protocol directly."""

    endpoint: str
    ctx: zmq.Context[zmq.Socket[bytes]] = field(default_factory=zmq.Context)
    conns: list[Conn] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ctx.set(zmq.MAX_SOCKETS, 65536)

    def attach(self, spec: protocol.JobSpec, workers: int, timeout: float = 120) -> None:
        """Open ``workers`` connections to the job of ``spec`` and say hello on each
        (again after a retryable refusal, e.g. a mixture whose tables are being built)."""
        fresh = []
        for w in range(workers):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoint)
            conn = Conn(sock, spec, w, workers)
            self.conns.append(conn)  # closed by close() whatever happens next
            fresh.append(conn)
            sock.send(self._hello(spec, w).header())
        end = time.monotonic() + timeout
        for conn in fresh:
            while True:
                msg = self._recv(conn, max(0.1, end - time.monotonic()))
                if isinstance(msg, protocol.Welcome):
                    conn.job = msg.job
                    break
                if not (isinstance(msg, protocol.Err) and msg.retry):
                    raise RuntimeError(f"hello answered {msg!r}")
                time.sleep(0.05)
                conn.sock.send(self._hello(spec, conn.worker).header())

    def _hello(self, spec: protocol.JobSpec, worker: int) -> protocol.Hello:
        return protocol.Hello(
            dataset=spec.dataset, seq_len=spec.seq_len, batch_size=spec.batch_size,
            seed=spec.seed, world_size=1, rank=0, worker=worker, window=4,
            client=f"scale-{id(spec):x}-{worker}", sources=spec.sources,
            schedule=spec.schedule, shuffle=spec.shuffle,
        )  # fmt: skip

    def _recv(self, conn: Conn, timeout: float) -> protocol.Message:
        if not conn.sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no answer in {timeout} s")
        frames = conn.sock.recv_multipart(copy=False)
        return decode_header(frames[0].buffer)

    def ask(self, conn: Conn) -> None:
        """Ask for ``conn``'s next batch (its worker's batches interleave the job's)."""
        g = conn.spec.batch_size
        pos = (conn.worker + conn.asked * conn.workers) * g
        get = protocol.Get(req=conn.asked, job=conn.job, rank=0, pos=pos, count=1, stride=1)
        conn.sock.send(get.header())
        conn.asked += 1
        conn.outstanding += 1

    def pump(self, batches: int, timeout: float = 300) -> int:
        """Keep one request in flight on every connection until ``batches`` answers
        arrived; the answers received."""
        poller = zmq.Poller()
        by_sock = {}
        for conn in self.conns:
            poller.register(conn.sock, zmq.POLLIN)
            by_sock[conn.sock] = conn
        got = 0
        inflight = sum(conn.outstanding for conn in self.conns)
        end = time.monotonic() + timeout
        for conn in self.conns:
            if conn.outstanding == 0 and inflight < batches:
                self.ask(conn)
                inflight += 1
        while got < batches:
            if time.monotonic() > end:
                raise TimeoutError(f"{got} of {batches} batches in {timeout} s")
            for sock, _ in poller.poll(1000):
                conn = by_sock[sock]
                frames = sock.recv_multipart(copy=False)
                msg = decode_header(frames[0].buffer)
                if not isinstance(msg, protocol.Chunk):
                    raise RuntimeError(f"request answered {msg!r}")
                conn.outstanding -= 1
                got += 1
                inflight -= 1
                if got + inflight < batches:
                    self.ask(conn)
                    inflight += 1
        return got

    def drain(self, timeout: float = 60) -> None:
        """Receive the answers still outstanding."""
        for conn in self.conns:
            while conn.outstanding:
                self._recv(conn, timeout)
                conn.outstanding -= 1

    def close(self) -> None:
        """Close every connection and the context."""
        for conn in self.conns:
            conn.sock.close(0)
        self.conns.clear()
        self.ctx.destroy(linger=0)
