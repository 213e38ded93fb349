"""What the loader benchmark measures from outside the trainers: CPU, memory, page cache, load.

CPU is counted for every process that does loading work: the trainer (its own time plus its
reaped DataLoader workers, from ``getrusage`` inside it) and the server (all its threads
and any children, from ``psutil``). Memory is each process's anonymous memory (the
``Anonymous`` line of ``/proc/PID/smaps_rollup``: heap, arrays, Python objects), summed
over a trainer and its workers and sampled for the peak. The page cache that memory maps
and ``pread`` go through is shared by every reader on the box and reclaimable, so it is
reported apart (the store's resident bytes, from ``mincore``) rather than charged as PSS
to whoever touched it first.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psutil

from systems import descendants_cpu
from tokenfeed_server.launch import ServerProcess

HERE = Path(__file__).resolve().parent


class Server(ServerProcess):
    """A ``tokenfeed-server serve`` process (awaited on its ready line) and its CPU time."""

    def __init__(self, store: Path, log: Path) -> None:
        super().__init__(store, log_path=log)
        self.start()
        assert self.proc is not None
        self.ps = psutil.Process(self.proc.pid)

    def cpu(self) -> float:
        """CPU seconds of the server, its threads and its children (live or reaped)."""
        t = self.ps.cpu_times()
        return (
            t.user + t.system + t.children_user + t.children_system + descendants_cpu(self.ps.pid)
        )


def anon_bytes(pid: int) -> int:
    """Anonymous memory of one process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Anonymous:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_anon(proc: psutil.Process) -> int:
    """Anonymous memory of ``proc`` and all its descendants (DataLoader workers)."""
    try:
        family = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    return sum(anon_bytes(p.pid) for p in family)


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
    ]  # fmt: skip
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def page_cache_bytes(paths: list[Path]) -> int:
    """Bytes of ``paths`` resident in the page cache now (``mincore`` on a fresh mapping,
    which reads residency without faulting anything in)."""
    libc = _libc()
    total = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        with open(path, "rb") as f:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {path}")
            try:
                pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {path}")
                total += sum(b & 1 for b in bytes(vec)) * mmap.PAGESIZE
            finally:
                libc.munmap(addr, size)
    return total


def warm_page_cache(paths: list[Path], block: int = 1 << 23) -> int:
    """Read every byte of ``paths`` (unmeasured), then return how many are resident.

    Each run draws a new seed's windows, so without this a run measured when the store
    is partly out of the page cache reads that seed's windows from disk, while the next
    system on the same seed finds them cached: on a cold store the first system of each
    round ran at a fifth of the rate and twice the CPU per token. Reading the files
    first makes every run start on a fully cached store (or shows that it cannot).
    """
    buf = bytearray(block)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return page_cache_bytes(paths)


def machine_load() -> dict[str, Any]:
    """The box's load averages and core counts, to print beside every result."""
    one, five, fifteen = os.getloadavg()
    return {
        "loadavg": [round(one, 2), round(five, 2), round(fifteen, 2)],
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
    }


class PeakSampler(threading.Thread):
    """Peak anonymous memory of each trainer tree and of the server, every ``interval`` s."""

    def __init__(
        self, trainers: list[psutil.Process], server: psutil.Process | None, interval: float = 0.2
    ) -> None:
        super().__init__(daemon=True)
        self.trainers, self.server, self.interval = trainers, server, interval
        self.trainer_peaks = [0] * len(trainers)
        self.total_peak = self.server_peak = 0
        self.done = threading.Event()

    def sample(self) -> None:
        """One sample of every process."""
        now = [tree_anon(p) for p in self.trainers]
        self.trainer_peaks = [max(a, b) for a, b in zip(self.trainer_peaks, now, strict=True)]
        server = tree_anon(self.server) if self.server is not None else 0
        self.server_peak = max(self.server_peak, server)
        self.total_peak = max(self.total_peak, sum(now) + server)

    def run(self) -> None:
        self.sample()
        while not self.done.wait(self.interval):
            self.sample()


def _start_trainers(spec: dict[str, Any], clients: int) -> list[subprocess.Popen[str]]:
    cmd = [sys.executable, str(HERE / "bench_loaders.py"), "--child", json.dumps(spec)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(clients)
    ]
    for p in procs:  # every trainer has imported and built its loader
        assert p.stdout is not None
        if not p.stdout.readline():
            p.wait()
            raise SystemExit(f"{spec['system']} trainer failed before loading (rc {p.returncode})")
    return procs


def run_once(
    spec: dict[str, Any], clients: int, server: Server | None, cached: list[Path]
) -> dict[str, Any]:
    """One run of one system with ``clients`` concurrent trainer processes; ``cached``: the
    files it reads, whose page-cache residency is reported after the run."""
    procs = _start_trainers(spec, clients)
    sampler = PeakSampler([psutil.Process(p.pid) for p in procs], server and server.ps)
    server_cpu0 = server.cpu() if server else 0.0
    load0 = os.getloadavg()[0]
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
    giga, mb = tokens / 1e9, 2**20
    trainer_cpu = sum(r["trainer_cpu_s"] for r in results) / giga
    return {
        "tokens_per_s": rate,
        "trainer_cpu_s_per_gtok": trainer_cpu,
        "server_cpu_s_per_gtok": server_cpu / giga,
        "total_cpu_s_per_gtok": trainer_cpu + server_cpu / giga,
        "trainer_anon_mb": max(sampler.trainer_peaks) / mb,
        "server_anon_mb": sampler.server_peak / mb,
        "total_anon_mb": sampler.total_peak / mb,
        "page_cache_mb": page_cache_bytes(cached) / mb,
        "ttfb_ms": max(r["ttfb_s"] for r in results) * 1e3,
        "wait_p50_ms": max(r["wait_p50_s"] for r in results) * 1e3,
        "wait_p99_ms": max(r["wait_p99_s"] for r in results) * 1e3,
        "load1_start": round(load0, 2),
        "load1_end": round(os.getloadavg()[0], 2),
    }
