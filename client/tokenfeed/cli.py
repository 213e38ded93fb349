"""``tokenfeed``: the trainer side's command line.

``tokenfeed batches --endpoint tcp://HOST:7400 --state CHECKPOINT --step N`` shows what
step ``N`` of a run saw (see :mod:`tokenfeed.lookback`): the dataset build, then every
rank's rows with their window, epoch, source and text (decoded with the dataset's own
tokenizer, fetched from ``--http``). ``--json`` prints it all, token ids included.
Bad input exits with status 2 and one line saying what to do; a refusal of the server
(a build no longer kept, a forbidden dataset) exits with 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tokenfeed.errors import ConfigError, TokenFeedError

__all__ = ["main"]

#: the file TokenFeedTrainer writes into each checkpoint folder
_STATE_FILE = "tokenfeed_loader.json"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenfeed", description="tokenfeed, trainer side")
    sub = parser.add_subparsers(dest="command", required=True)
    look = sub.add_parser("batches", help="show what a step of a run saw")
    look.add_argument(
        "--endpoint",
        default=os.environ.get("TOKENFEED_ENDPOINT"),
        help="the server's data endpoint, tcp://HOST:7400 (env TOKENFEED_ENDPOINT)",
    )
    look.add_argument(
        "--state",
        required=True,
        type=Path,
        help=f"the run's saved state: a JSON file, or a checkpoint folder holding {_STATE_FILE}",
    )
    where = look.add_mutually_exclusive_group(required=True)
    where.add_argument("--step", type=int, help="the step (0-based global batch) to show")
    where.add_argument("--position", type=int, help="or the stream position to show")
    look.add_argument(
        "--rank",
        type=int,
        action="append",
        help="only this rank's rows (repeat for several; default: every rank)",
    )
    look.add_argument(
        "--http",
        help="the server's HTTP URL, to decode rows with the "
        "dataset's tokenizer (e.g. http://HOST:7401); without it, token ids",
    )
    look.add_argument(
        "--token",
        default=os.environ.get("TOKENFEED_TOKEN"),
        help="tenant token (env TOKENFEED_TOKEN)",
    )
    look.add_argument("--chars", type=int, default=240, help="text shown per row (default 240)")
    look.add_argument("--json", action="store_true", help="print JSON, token ids included")
    return parser  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (2: bad input, 1: refused)."""
    args = _parser().parse_args(argv)
    try:
        return _batches(args)
    except ConfigError as exc:
        print(f"tokenfeed: error: {exc}", file=sys.stderr)
        return 2
    except TokenFeedError as exc:
        print(f"tokenfeed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `tokenfeed batches ... | head`: the reader had enough
        # stdout to /dev/null, so the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _batches(args: argparse.Namespace) -> int:
    from tokenfeed.lookback import look_at_step

    if not args.endpoint:
        raise ConfigError("give --endpoint tcp://HOST:7400 (or set TOKENFEED_ENDPOINT)")
    state = load_state(args.state)
    decode = _decoder(args.http, args.token) if args.http else None
    view = look_at_step(
        args.endpoint, state, args.step, position=args.position, ranks=args.rank,
        token=args.token, decode=decode,
    )  # fmt: skip
    if args.json:
        print(json.dumps(view.to_json()))
        return 0
    step = f"step {view.step}" if view.step >= 0 else "the batch"
    builds = ", ".join(f"{name} version {fp}" for name, fp in view.versions.items())
    print(f"{step}: stream position {view.position} (global batch {view.global_batch}); {builds}")
    for row in view.rows:
        shown = row.text if row.text is not None else " ".join(map(str, row.tokens[:48]))
        shown = json.dumps(shown[: max(0, args.chars)], ensure_ascii=False)
        print(f"rank {row.rank} row {row.row} {row.dataset} window {row.window} "
              f"epoch {row.epoch}: {shown}")  # fmt: skip
    return 0


def load_state(path: Path) -> dict[str, Any]:
    """A saved loader state: a JSON file, or the one in a checkpoint folder."""
    file = path / _STATE_FILE if path.is_dir() else path
    try:
        state = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{file} does not exist: give the state's JSON file or its checkpoint folder"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{file} is not a readable JSON state: {exc}") from None
    if not isinstance(state, dict):
        raise ConfigError(f"{file} holds no state object (a JSON object was expected)")
    return state


def _decoder(http: str, token: str | None) -> Callable[[str, list[int]], str]:
    """``decode(dataset, ids)`` with each dataset's own tokenizer, fetched once."""
    from tokenfeed.tokenizer import NoTokenizerFile, decode_bytes, fetch_tokenizer

    cache: dict[str, Any] = {}

    def decode(dataset: str, ids: list[int]) -> str:
        if dataset not in cache:
            try:
                cache[dataset] = fetch_tokenizer(http, dataset, token)
            except NoTokenizerFile:
                cache[dataset] = None
            except ImportError:
                raise ConfigError(
                    "decoding needs the tokenizers package: pip install tokenizers"
                ) from None
        tokenizer = cache[dataset]
        return decode_bytes(ids) if tokenizer is None else str(tokenizer.decode(ids))

    return decode


if __name__ == "__main__":
    sys.exit(main())
