"""``tokenfeed-server``: the operator's command line.

Each subcommand has an ``_add_<name>(subparsers)`` function that declares its arguments
and sets its handler; :func:`main` only parses and dispatches. Settings (flags and their
``TOKENFEED_*`` twins) are declared once in :mod:`tokenfeed_server.config`. Errors of the
tokenfeed tree print one line to stderr and exit 2; nothing reads the environment at import
time.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from tokenfeed.errors import ConfigError, TokenFeedError
from tokenfeed_server import config as settings
from tokenfeed_server.admin_cli import add_admin_commands

__all__ = ["main"]

EXIT_ERROR = 2
Handler = Callable[[argparse.Namespace], int]
Model = TypeVar("Model", bound=BaseModel)


def _settings(model: type[Model], args: argparse.Namespace) -> Model:
    """``model`` from flags > environment > defaults: the one place where a bad value of
    either becomes a ConfigError (one line naming the flag, its twin and the valid range)."""
    try:
        return settings.load(model, args)
    except ValidationError as exc:
        raise ConfigError(settings.explain(exc, model)) from None


# ---------------------------------------------------------------------------- prepare


def _add_prepare(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "prepare",
        help="tokenize a corpus into a pre-shuffled dataset in the store",
        description="Tokenize INPUT files/directories (.txt, .jsonl, .parquet, .gz/.zst) "
        "into a globally shuffled dataset, atomically. Every flag has an environment twin "
        "(shown in brackets); flags win.",
    )
    p.add_argument("inputs", nargs="*", type=Path, metavar="INPUT")
    p.add_argument("--demo", action="store_true", help="use this Python's stdlib sources")
    settings.add_arguments(p, settings.PrepareSettings)
    p.set_defaults(handler=_run_prepare)


def _run_prepare(args: argparse.Namespace) -> int:
    from tokenfeed_server.prepare import PrepareConfig, PrepareStats, demo_corpus_paths, prepare

    s = _settings(settings.PrepareSettings, args)
    if args.demo and args.inputs:
        raise TokenFeedError("give INPUT files or --demo, not both")
    inputs = tuple(demo_corpus_paths()) if args.demo else tuple(args.inputs)
    if not inputs:
        raise TokenFeedError("no INPUT given (or pass --demo for the built-in demo corpus)")
    config = PrepareConfig(
        inputs=inputs,
        store=s.store,
        dataset=s.dataset,
        tokenizer=s.tokenizer,
        seed=s.seed,
        text_field=s.text_field,
        skip_bad=s.skip_bad,
        overwrite=s.overwrite,
        memory_mb=s.memory_mb,
        workers=s.workers,
        shard_tokens=s.shard_tokens,
        eos_token=s.eos_token,
        progress=False if s.no_progress else None,
        bpe_train_mb=s.bpe_train_mb,
        engine=s.engine,
        ray_address=s.ray_address,
    )
    stats = PrepareStats()
    manifest = prepare(config, stats)
    c = stats.corpus
    print(
        f"prepared {config.store / manifest.name}: {manifest.documents:,} documents, "
        f"{manifest.total_tokens:,} tokens ({manifest.dtype}), {len(manifest.shards)} shard(s), "
        f"{c.text_bytes / 1e6:.1f} MB of text in {stats.seconds:.1f}s"
    )
    if c.bad_records:
        print(f"warning: skipped {c.bad_records} bad record(s)", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------- inspect


def _add_inspect(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="print a dataset's manifest summary and verify its checksums",
        description="Open DIR/NAME (validating every shard), print a summary, verify checksums.",
    )
    p.add_argument("path", type=Path, metavar="DIR/NAME")
    p.add_argument("--no-verify", action="store_true", help="skip the checksum pass")
    p.set_defaults(handler=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    from tokenfeed_server.store import open_dataset

    path: Path = args.path
    with open_dataset(path.parent, path.name) as ds:
        m = ds.manifest
        t = m.tokenizer
        print(f"dataset      {ds.name}  ({ds.path})")
        print(f"fingerprint  {ds.fingerprint}")
        print(f"created      {m.created}")
        print(f"tokenizer    {t.kind}  vocab {t.vocab_size}  eos {t.eos_id}  dtype {m.dtype}")
        print(f"tokens       {m.total_tokens:,}")
        print(f"documents    {m.documents:,}")
        print(f"shuffle seed {m.shuffle_seed}")
        print(f"shards       {len(m.shards)}")
        for s in m.shards:
            print(f"  {s.name}  {s.tokens:>14,} tokens  {s.documents:>10,} docs  {s.checksum}")
        if args.no_verify:
            print("checksums    not verified (--no-verify)")
        else:
            ds.verify_checksums()
            print("checksums    ok")
    return 0


# ---------------------------------------------------------------------------- serve


def _add_serve(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a store over ZeroMQ, with HTTP status",
        description="Serve every dataset of a store. Prints one JSON 'ready' line on stdout "
        "once the data and HTTP ports are bound; logs go to stderr; SIGTERM stops cleanly. "
        "Every flag has an environment twin (shown in brackets); flags win.",
    )
    settings.add_arguments(p, settings.ServerConfig)
    p.set_defaults(handler=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    config = _settings(settings.ServerConfig, args)  # refused before the heavy imports
    from tokenfeed_server.server import serve

    logging.getLogger().setLevel(config.log_level.upper())
    return serve(config)


# ---------------------------------------------------------------------------- keygen


def _add_keygen(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "keygen",
        help="write a CURVE key pair for encrypted serving",
        description="Write DIR/server.key (secret, mode 0600; give it to serve with "
        "--curve-secret-key) and DIR/server.key.pub (give it to clients).",
    )
    p.add_argument("directory", type=Path, metavar="DIR")
    p.set_defaults(handler=_run_keygen)


def _run_keygen(args: argparse.Namespace) -> int:
    from tokenfeed_server.security import keygen

    try:
        secret, public = keygen(args.directory)
    except FileExistsError:
        raise TokenFeedError(
            f"{args.directory / 'server.key'} exists; remove it or choose another DIR"
        ) from None
    print(f"secret key: {secret} (keep it private)")
    print(f"public key: {public}: {public.read_text().strip()}")
    return 0


# ---------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (one sub-parser per subcommand)."""
    parser = argparse.ArgumentParser(
        prog="tokenfeed-server", description="tokenfeed data server and store tools"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_prepare(subparsers)
    _add_inspect(subparsers)
    _add_serve(subparsers)
    _add_keygen(subparsers)
    add_admin_commands(subparsers)  # jobs, datasets, status: the HTTP API as tables
    return parser


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    # SIGTERM unwinds like Ctrl-C, so every finally (temp dirs, worker pools) runs.
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tokenfeed-server``; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    handler: Handler = args.handler
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return handler(args)
    except TokenFeedError as exc:
        print(f"tokenfeed-server {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"tokenfeed-server {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
