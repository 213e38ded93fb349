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
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel, ValidationError

from tokenfeed.errors import ConfigError, TokenFeedError
from tokenfeed_server import config as settings
from tokenfeed_server.client_key_cli import add_client_key_command
from tokenfeed_server.http.admin_cli import add_admin_commands
from tokenfeed_server.inspect_cli import add_inspect_command

if TYPE_CHECKING:
    from tokenfeed_server.store.gc import GcReport, KeptVersion
    from tokenfeed_server.store.objects import ObjectStore

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
        description="Tokenize INPUT files/directories (.txt, .jsonl, .parquet, .gz/.zst; "
        "or s3://BUCKET/PREFIX, downloaded first) into a globally shuffled dataset, "
        "atomically. With --store s3://BUCKET/PREFIX the dataset is built in --scratch-dir "
        "and published: files under content-addressed names, the manifest last. AWS "
        "credentials, region and endpoint (AWS_ENDPOINT_URL) come from the standard AWS "
        "environment and config files. Every flag has an environment twin (shown in "
        "brackets); flags win.",
    )
    # strings, not Paths: Path("s3://b/k") would collapse to "s3:/b/k"
    p.add_argument("inputs", nargs="*", metavar="INPUT")
    p.add_argument("--demo", action="store_true", help="use this Python's stdlib sources")
    settings.add_arguments(p, settings.PrepareSettings)
    p.set_defaults(handler=_run_prepare)


def _run_prepare(args: argparse.Namespace) -> int:
    from tokenfeed_server.prepare import (
        PrepareConfig,
        PrepareStats,
        demo_corpus_paths,
        prepare,
        prepare_objects,
    )
    from tokenfeed_server.store.objects import S3Location, parse_store

    s = _settings(settings.PrepareSettings, args)
    if args.demo and args.inputs:
        raise TokenFeedError("give INPUT files or --demo, not both")
    store = parse_store(s.store)
    parsed = [parse_store(i) for i in args.inputs]
    local_inputs = tuple(demo_corpus_paths()) if args.demo else ()
    local_inputs += tuple(i for i in parsed if isinstance(i, Path))
    s3_inputs = [i for i in parsed if isinstance(i, S3Location)]
    if not local_inputs and not s3_inputs:
        raise TokenFeedError("no INPUT given (or pass --demo for the built-in demo corpus)")
    config = PrepareConfig(
        inputs=local_inputs,
        # a remote store is written in a scratch store first (prepare_objects picks it)
        store=store if isinstance(store, Path) else Path(),
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
    if isinstance(store, S3Location) or s3_inputs:
        remote = store if isinstance(store, S3Location) else None
        manifest = prepare_objects(
            config, store=remote, s3_inputs=s3_inputs, scratch_dir=s.scratch_dir, stats=stats
        )
    else:
        manifest = prepare(config, stats)
    where = store.url(manifest.name) if isinstance(store, S3Location) else store / manifest.name
    c = stats.corpus
    print(
        f"prepared {where}: {manifest.documents:,} documents, "
        f"{manifest.total_tokens:,} tokens ({manifest.dtype}), {len(manifest.shards)} shard(s), "
        f"{c.text_bytes / 1e6:.1f} MB of text in {stats.seconds:.1f}s"
    )
    if c.bad_records:
        print(f"warning: skipped {c.bad_records} bad record(s)", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------- gc


def _add_gc(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "gc",
        help="delete the dataset versions and objects no one uses any more",
        description="For each dataset of --store (or only --dataset), keep the current "
        "version, the newest --keep-versions, every version a running server's jobs hold "
        "(its lease under _tokenfeed/leases/, whatever --grace says) and every version that "
        "stopped being current less than --grace seconds ago; delete the other versions and "
        "every object no kept version names (once it and the current manifest are older than "
        "--grace). s3://BUCKET/PREFIX: objects; a local store: the older builds under "
        "_tokenfeed/versions/ and dead writers' temp directories. Servers started with "
        "--read-only-store write no lease: for them only --grace protects what they read. "
        "Every flag has an environment twin (shown in brackets); flags win.",
    )
    settings.add_arguments(p, settings.GcSettings)
    p.set_defaults(handler=_run_gc)


def _run_gc(args: argparse.Namespace) -> int:
    from tokenfeed_server.store.gc import gc_local, gc_objects
    from tokenfeed_server.store.objects import ObjectStore, parse_store

    s = _settings(settings.GcSettings, args)
    store = parse_store(s.store)
    keep, grace, dry = s.keep_versions, s.grace_s, s.dry_run
    if isinstance(store, Path):
        report = gc_local(store, name=s.dataset, grace_s=grace, keep_versions=keep, dry_run=dry)
        failed = _print_local_gc(store, report, s.dataset, dry_run=dry)
    else:
        objects = ObjectStore(store)
        report = gc_objects(objects, name=s.dataset, grace_s=grace, keep_versions=keep, dry_run=dry)
        failed = _print_remote_gc(objects, report, dry_run=dry)
    _print_leases(report, dry_run=s.dry_run)
    return EXIT_ERROR if failed else 0


def _print_remote_gc(objects: ObjectStore, report: GcReport, *, dry_run: bool) -> bool:
    """Per dataset: what was deleted, and what was kept and why; True if any failed."""
    verb = "would delete" if dry_run else "deleted"
    failed = False
    for r in report.datasets:
        if r.error:
            failed = True
            print(f"{objects.url(r.dataset)}: {r.error}", file=sys.stderr)
            continue
        state = "" if r.has_manifest else " (no manifest: an unfinished publish)"
        print(
            f"{objects.url(r.dataset)}{state}: {verb} {len(r.deleted)} object(s), "
            f"{r.deleted_bytes:,} bytes; kept {r.referenced} referenced, {len(r.young)} "
            f"younger than the grace period, {len(r.foreign)} not tokenfeed's"
        )
        _print_versions(r.kept, r.dropped, verb)
        if r.held:
            print(f"  kept {len(r.held)} unreferenced object(s): a leased version is unreadable")
        if r.raced:
            print(f"  spared {len(r.raced)} object(s) named or touched while gc ran")
        for info in r.deleted:
            print(f"  {info.key}  {info.size:,} bytes  {info.modified.isoformat()}")
        if r.warning:
            print(f"{objects.url(r.dataset)}: warning: {r.warning}", file=sys.stderr)
    if not report.datasets:
        print(f"{objects.url()}: no datasets")
    return failed


def _print_local_gc(store: Path, report: GcReport, name: str | None, *, dry_run: bool) -> bool:
    """A local store: temp directories, then per dataset its older builds."""
    verb = "would delete" if dry_run else "deleted"
    failed = False
    if name is None:
        what = "temp directories (live writers' included)" if dry_run else "temp directories"
        print(f"{store}: {verb} {len(report.temp_dirs)} {what}")
        for path in report.temp_dirs:
            print(f"  {path.name}")
    for r in report.local:
        if r.error:
            failed = True
            print(f"{store / r.dataset}: {r.error}", file=sys.stderr)
            continue
        print(f"{store / r.dataset}: {verb} {len(r.deleted)} older build(s)")
        _print_versions(r.kept, [p.name for p in r.deleted], verb)
        if r.raced:
            print(f"  spared {len(r.raced)} older build(s) a server took a lease on meanwhile")
    return failed


def _print_versions(kept: Sequence[KeptVersion], dropped: Sequence[str], verb: str) -> None:
    for version in kept:
        print(f"  version {version.fingerprint}  kept: {'; '.join(version.reasons)}")
    for fingerprint in dropped:
        print(f"  version {fingerprint}  {verb}: not current or newest, no lease, past --grace")


def _print_leases(report: GcReport, *, dry_run: bool) -> None:
    """The leases gc honoured, the expired ones it removed, or that there were none."""
    for lease in report.leases:
        held = sum(len(fps) for fps in lease.held.values())
        print(f"lease of {lease.describe()}: {held} version(s) held")
    if report.expired:
        verb = "would delete" if dry_run else "deleted"
        servers = ", ".join(lease.server for lease in report.expired)
        print(f"{verb} {len(report.expired)} expired lease(s) of servers gone ({servers})")
    for where in report.unreadable_leases:
        print(f"warning: {where} is not a lease tokenfeed can read: ignored", file=sys.stderr)
    if report.no_leases:
        from tokenfeed_server.store.gc import NO_LEASES

        print(f"note: {NO_LEASES}")


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


log = logging.getLogger(__name__)
_SECRET_FLAGS = ("--token", "--admin-token")


def _run_serve(args: argparse.Namespace) -> int:
    config = _settings(settings.ServerConfig, args)  # refused before the heavy imports
    from tokenfeed_server.server import serve

    shown = [a.split("=")[0] for a in args.argv if a.split("=")[0] in _SECRET_FLAGS]
    if shown:
        log.warning(
            "%s on the command line shows in the process list of every user of this "
            "machine; prefer TOKENFEED_TOKEN / TOKENFEED_ADMIN_TOKEN or --token-file",
            " and ".join(sorted(set(shown))),
        )

    logging.getLogger().setLevel(config.log_level.upper())
    return serve(config)


# ---------------------------------------------------------------------------- keygen


def _add_keygen(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "keygen",
        help="write a CURVE key pair for encrypted serving",
        description="Write DIR/server.key (secret, mode 0600; give it to serve with "
        "--curve-secret-key) and DIR/server.key.pub (give it to clients, each with its "
        "own key from `tokenfeed-server client-key`).",
    )
    p.add_argument("directory", type=Path, metavar="DIR")
    p.set_defaults(handler=_run_keygen)


def _run_keygen(args: argparse.Namespace) -> int:
    from tokenfeed_server.dataplane.security import keygen

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
    add_inspect_command(subparsers)  # inspect: tokenfeed_server.inspect_cli
    _add_gc(subparsers)
    _add_serve(subparsers)
    _add_keygen(subparsers)
    add_client_key_command(subparsers)  # client-key: tokenfeed_server.client_key_cli
    add_admin_commands(subparsers)  # jobs, datasets, status: the HTTP API as tables
    return parser


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    # SIGTERM unwinds like Ctrl-C, so every finally (temp dirs, worker pools) runs.
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tokenfeed-server``; returns the exit status."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what was typed (serve warns)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not args.verbose:  # boto3 logs every credential lookup at INFO
        for name in ("botocore", "boto3", "s3transfer", "urllib3"):
            logging.getLogger(name).setLevel(logging.WARNING)
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
    except BrokenPipeError:
        # `tokenfeed-server inspect ... | head`: the reader had enough. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
