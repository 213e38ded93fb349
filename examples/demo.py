"""tokenfeed end to end on one machine: prepare, serve, train, stop.

1. Prepares the demo dataset (this Python's standard library sources, byte tokenizer)
   into ./demo-store, unless it is already there.
2. Starts ``tokenfeed-server serve`` on free loopback ports and waits for its ready line.
3. Trains the small GPT of ``train_gpt.py`` through ``TokenFeedLoader`` for a few hundred
   steps, printing the loss and tokens/s.
4. Stops the server with SIGTERM and checks that it exited cleanly.

    python examples/demo.py                   # or scripts/demo, which installs first
    python examples/demo.py --steps 600 --layers 4 --num-workers 0

Flags it does not know go to ``train_gpt.py``. Ctrl-C stops training and the server.
"""

from __future__ import annotations

import argparse
import json
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import train_gpt  # the script next to this one (its directory is on sys.path)

DATASET = "demo"


def server_cmd(*args: str) -> list[str]:
    # The module, not the console script: works whatever PATH says, with this interpreter.
    return [sys.executable, "-m", "tokenfeed_server.cli", *args]


def prepare_if_missing(store: Path, tokenizer: str) -> None:
    if (store / DATASET / "manifest.json").exists():
        print(f"[demo] dataset {DATASET!r} already in {store}", flush=True)
        return
    print(f"[demo] preparing {DATASET!r} in {store} from the standard library...", flush=True)
    cmd = server_cmd("prepare", "--demo", "--store", str(store), "--dataset", DATASET)
    done = subprocess.run([*cmd, "--tokenizer", tokenizer, "--no-progress"], check=False)
    if done.returncode != 0:
        raise SystemExit("[demo] prepare failed (see above)")


class Server:
    """``tokenfeed-server serve`` as a child process, stopped by SIGTERM."""

    def __init__(self, store: Path, log_path: Path) -> None:
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [
                    *server_cmd("serve", "--store", str(store), "--host", "127.0.0.1"),
                    *("--zmq-port", "0", "--http-port", "0"),
                ],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                # Own session: Ctrl-C reaches only us, and we stop the server with SIGTERM,
                # its clean-shutdown signal, instead of it dying mid-reply.
                start_new_session=True,
            )
        self.zmq, self.http = self._wait_ready(timeout=60.0)

    def _wait_ready(self, timeout: float) -> tuple[str, str]:
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sel.select(timeout=0.2):
                line = self.proc.stdout.readline()
                if line:
                    event = json.loads(line)
                    if event.get("event") == "ready":
                        return str(event["zmq"]), str(event["http"])
            if self.proc.poll() is not None:
                break
        self.stop()
        raise SystemExit(f"[demo] the server did not get ready; its log:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", type=Path, default=Path("demo-store"), help="[./demo-store]")
    parser.add_argument(
        "--tokenizer", default="byte", help="byte (seconds; default) or bpe:VOCAB (slower)"
    )
    args, train_args = parser.parse_known_args(argv)
    started = time.perf_counter()
    prepare_if_missing(args.store, args.tokenizer)

    with tempfile.TemporaryDirectory(prefix="tokenfeed-demo-") as tmp:
        server = Server(args.store, Path(tmp) / "server.log")
        print(f"[demo] server ready: data {server.zmq}, HTTP {server.http}/v1/jobs", flush=True)
        status = 0
        try:
            train_gpt.main(["--endpoint", server.zmq, "--dataset", DATASET, *train_args])
        except KeyboardInterrupt:
            print("\n[demo] interrupted", flush=True)
            status = 130
        finally:
            code = server.stop()
            print(f"[demo] server stopped (exit status {code})", flush=True)
            if code != 0:
                print(server.log_tail(), file=sys.stderr)
                status = status or 1
    print(f"[demo] done in {time.perf_counter() - started:.0f}s", flush=True)
    return status


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    # SIGTERM (a `kill`, a CI timeout) unwinds like Ctrl-C, so the server is always stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # during prepare: the child stops on the same Ctrl-C
        print("\n[demo] interrupted", file=sys.stderr)
        sys.exit(130)
