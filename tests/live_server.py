"""A real ``tokenfeed-server serve`` process for tests: started, awaited, stopped.

The test waits on the server's ``ready`` line (never a sleep); every wait has a timeout
so a broken server fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx


class LiveServer:
    """One server process on loopback with OS-assigned (or given) ports."""

    def __init__(
        self,
        store: Path,
        *,
        zmq_port: int = 0,
        http_port: int = 0,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.cmd = [
            sys.executable,
            "-m",
            "tokenfeed_server.cli",
            "serve",
            "--store",
            str(store),
            "--host",
            "127.0.0.1",
            "--zmq-port",
            str(zmq_port),
            "--http-port",
            str(http_port),
            *(extra or []),
        ]
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self.zmq = ""
        self.http = ""

    def start(self, timeout: float = 30.0) -> LiveServer:
        if self.log_path is None:
            self.proc = subprocess.Popen(
                self.cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=self.env
            )
        else:
            with open(self.log_path, "a") as log:  # the child keeps its own descriptor
                self.proc = subprocess.Popen(
                    self.cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=self.env
                )
        ready = self._read_line(timeout)
        event = json.loads(ready)
        assert event["event"] == "ready", ready
        self.zmq, self.http = event["zmq"], event["http"]
        return self

    def _read_line(self, timeout: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sel.select(timeout=0.2):
                line = self.proc.stdout.readline()
                if line:
                    return line
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.cmd}")
        raise TimeoutError(f"server not ready within {timeout}s: {self.cmd}")

    @property
    def zmq_port(self) -> int:
        return int(self.zmq.rsplit(":", 1)[1])

    @property
    def http_port(self) -> int:
        return int(self.http.rsplit(":", 1)[1])

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(self.http + path, timeout=10.0, **kwargs)

    def get_at(self, host: str, path: str) -> httpx.Response:
        """GET through another address of this server (for one bound to 0.0.0.0)."""
        return httpx.get(f"http://{host}:{self.http_port}{path}", timeout=10.0)

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait; returns the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
                raise
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop()
