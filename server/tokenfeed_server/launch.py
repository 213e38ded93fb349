"""Run ``tokenfeed-server serve`` as a child process, wait for its ready line, stop it.

Public API, for programs that start a server of their own (a notebook, a single-box
training script, CI; here: the examples, benchmarks and tests)::

    from tokenfeed_server.launch import ServerProcess

    with ServerProcess(Path("/data/store")) as server:  # ports 0: any free ones
        train(endpoint=server.zmq)                       # e.g. "tcp://127.0.0.1:43817"

The wait is on the server's one-line JSON ``ready`` event on stdout (never a sleep),
bounded by a timeout; stopping sends SIGTERM, the server's clean-shutdown signal.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["ServerProcess"]


class ServerProcess:
    """One ``tokenfeed-server serve`` child; ``zmq`` and ``http`` are set once it is ready.

    Args:
        store: the store directory to serve.
        host, zmq_port, http_port: where to listen (port 0: any free port).
        extra: more ``serve`` flags (``--tenants``, limits, ...).
        command: the whole command line instead (as a container would run it).
        env: the child's environment (default: this process's).
        log_path: append the server's log (stderr) there; default: discard it.
        new_session: run in a session of its own, so that a Ctrl-C on the terminal
            reaches only the parent, which then stops the server with SIGTERM.
    """

    def __init__(
        self,
        store: Path | None = None,
        *,
        host: str = "127.0.0.1",
        zmq_port: int = 0,
        http_port: int = 0,
        extra: Sequence[str] = (),
        command: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        new_session: bool = False,
    ) -> None:
        if command is None:
            if store is None:
                raise ValueError("give a store or a whole command")
            command = [
                sys.executable, "-m", "tokenfeed_server.cli", "serve", "--store", str(store),
                "--host", host, "--zmq-port", str(zmq_port), "--http-port", str(http_port),
                *extra,
            ]  # fmt: skip
        self.store = store
        self.command = list(command)
        self.env = dict(os.environ if env is None else env)
        self.log_path = log_path
        self.new_session = new_session
        self.proc: subprocess.Popen[str] | None = None
        self.zmq = ""
        self.http = ""

    def start(self, timeout: float = 60.0) -> ServerProcess:
        """Start the server and return once it has printed its ready line."""
        log = open(self.log_path, "a") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                self.command,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=self.env,
                start_new_session=self.new_session,
            )
        finally:
            if log is not subprocess.DEVNULL:
                log.close()  # type: ignore[union-attr]  # the child has its own descriptor
        try:
            event = json.loads(self._ready_line(timeout))
        except BaseException:
            self.stop()
            raise
        if event.get("event") != "ready":
            self.stop()
            raise RuntimeError(f"unexpected first line from the server: {event}")
        self.zmq, self.http = str(event["zmq"]), str(event["http"])
        return self

    def _ready_line(self, timeout: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if sel.select(timeout=0.2):
                    line = self.proc.stdout.readline()
                    if line:
                        return line
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"the server exited with status {self.proc.returncode} before it was "
                        f"ready:\n{self.log_tail()}"
                    )
        raise TimeoutError(f"the server was not ready within {timeout:.0f}s:\n{self.log_tail()}")

    @property
    def zmq_port(self) -> int:
        """The bound data port."""
        return int(self.zmq.rsplit(":", 1)[1])

    @property
    def http_port(self) -> int:
        """The bound HTTP port."""
        return int(self.http.rsplit(":", 1)[1])

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the server's log (empty when it is discarded)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, wait (SIGKILL past ``timeout``); return the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._close_pipe()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: what a crash looks like to the clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._close_pipe()

    def _close_pipe(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
