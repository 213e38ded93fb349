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
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import train_gpt  # the script next to this one (its directory is on sys.path)
from tokenfeed_server.launch import ServerProcess

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
        # Its own session: Ctrl-C reaches only us, and we stop the server with SIGTERM,
        # its clean-shutdown signal, instead of it dying mid-reply.
        server = ServerProcess(args.store, log_path=Path(tmp) / "server.log", new_session=True)
        try:
            server.start()
        except (RuntimeError, TimeoutError) as exc:
            raise SystemExit(f"[demo] the server did not get ready: {exc}") from None
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
