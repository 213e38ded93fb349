"""``tokenfeed-server inspect``: a dataset's manifest summary, every object checked against
it, and a repair of what does not verify in object storage.

Exit status, so that a script can tell a finding from a failure to look:

* 0: everything checked is whole;
* 1: the check ran and found objects (or local files) missing or damaged: each is listed
  on stdout with what is wrong, and what to run about them;
* 2: the check could not be made (bad arguments, no such dataset, refused credentials,
  unreachable storage): the CLI's usual one line on stderr.

The checking and the repair are :mod:`tokenfeed_server.store.verify`'s; this module only
parses, prints and picks the exit status.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tokenfeed.errors import ConfigError, CorruptShard, ManifestError

if TYPE_CHECKING:
    from tokenfeed_server.prepare.progress import ByteProgress
    from tokenfeed_server.store.manifest import Manifest
    from tokenfeed_server.store.objects import ObjectStore, S3Location
    from tokenfeed_server.store.verify import VerifyReport

__all__ = ["EXIT_FINDINGS", "add_inspect_command"]

#: the check ran and found something missing or damaged
EXIT_FINDINGS = 1
#: requests at once while checking (not store.verify's: every command imports this module,
#: and importing the store would slow every one down)
DEFAULT_THREADS = 8


def add_inspect_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``inspect`` on the ``tokenfeed-server`` parser."""
    p = subparsers.add_parser(
        "inspect",
        help="print a dataset's summary, check every file against it, repair it in s3://",
        description="Print the manifest summary of a dataset (NAME with --store DIR or "
        "s3://BUCKET/PREFIX; or DIR/NAME, s3://BUCKET/PREFIX/NAME) and check every file it "
        "names, listing every one that is missing or damaged. A local dataset: sizes and "
        "checksums (--no-verify: sizes only). s3://: every object's size; --verify also "
        "downloads every piece and checks its checksum; --repair --source DIR uploads every "
        "object that does not verify again from a local copy of the same build, then checks "
        "them again. Exit status 0: all whole; 1: something missing or damaged (listed); 2: "
        "the check could not be made.",
    )
    p.add_argument("path", metavar="NAME")
    p.add_argument(
        "--store", help="the store holding dataset NAME (a directory or s3://BUCKET/PREFIX)"
    )
    p.add_argument("--no-verify", action="store_true", help="local: sizes only, no checksums")
    p.add_argument(
        "--verify",
        action="store_true",
        help="s3://: check every piece's checksum (downloads the dataset); local: the default",
    )
    p.add_argument(
        "--repair",
        action="store_true",
        help="s3://: upload every object that does not verify again, from --source (implies "
        "--verify); a local dataset is rebuilt with prepare ... --overwrite instead",
    )
    p.add_argument(
        "--source",
        type=Path,
        metavar="DIR",
        help="for --repair: the local dataset directory (or the local store holding NAME) of "
        "the same build (the same fingerprint) that was published",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_THREADS,
        help=f"s3://: requests at once while checking (default {DEFAULT_THREADS})",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    p.set_defaults(handler=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    """The ``inspect`` command (see the module doc for its exit status)."""
    from tokenfeed_server.store.objects import S3Location

    _check_flags(args)
    target = _target(args.path, args.store)
    if isinstance(target, S3Location):
        return _inspect_remote(target, args)
    if args.repair:
        raise ConfigError(
            "--repair is for datasets in object storage (s3://): a local dataset is rebuilt "
            "with tokenfeed-server prepare ... --overwrite"
        )
    return _inspect_local(target, args)


def _check_flags(args: argparse.Namespace) -> None:
    if args.verify and args.no_verify:
        raise ConfigError("give --verify or --no-verify, not both")
    if args.repair and args.no_verify:
        raise ConfigError("--repair checks every piece: it cannot go with --no-verify")
    if args.repair and args.source is None:
        raise ConfigError(
            "--repair needs --source DIR: the local dataset directory (or local store) of "
            "the same build, to upload the objects that do not verify from"
        )
    if args.source is not None and not args.repair:
        raise ConfigError("--source is for --repair")
    if args.threads < 1:
        raise ConfigError(f"--threads must be at least 1, got {args.threads}")


def _target(path: str, store: str | None) -> Path | S3Location:
    """The dataset's own path or URL, from NAME and --store or from the one argument."""
    from tokenfeed_server.store import validate_dataset_name
    from tokenfeed_server.store.objects import parse_store

    if store is None:
        return parse_store(path)
    validate_dataset_name(path)
    root = parse_store(store)
    return root / path if isinstance(root, Path) else root.child(path)


def _progress(args: argparse.Namespace, desc: str) -> ByteProgress:
    from tokenfeed_server.prepare.progress import ByteProgress

    return ByteProgress(enabled=False if args.no_progress else None, desc=desc)


def _print_summary(name: str, where: str, fingerprint: str, m: Manifest) -> None:
    t = m.tokenizer
    print(f"dataset      {name}  ({where})")
    print(f"fingerprint  {fingerprint}")
    print(f"created      {m.created}")
    print(f"format       {_format_line(m)}")
    print(f"tokenizer    {t.kind}  vocab {t.vocab_size}  eos {t.eos_id}  dtype {m.dtype}")
    print(f"tokens       {m.total_tokens:,}")
    print(f"documents    {m.documents:,}")
    print(f"shuffle seed {m.shuffle_seed}")
    print(f"shards       {len(m.shards)}")
    for s in m.shards:
        print(f"  {s.name}  {s.tokens:>14,} tokens  {s.documents:>10,} docs  {s.checksum}")


def _print_versions(store: Path | ObjectStore, name: str, current: str) -> None:
    """The layout the dataset uses, and its kept versions (newest first)."""
    from tokenfeed_server.store.versions import list_versions

    versions = list_versions(store, name)
    if not isinstance(store, Path) and not versions:
        print("layout       before versions (no versions/: the manifest is the only version)")
        return
    older = ", ".join(v.fingerprint for v in versions if v.fingerprint != current) or "none"
    print(f"layout       versions: {current} (current); older kept: {older}")


def _format_line(m: Manifest) -> str:
    if m.format_version < 2:
        return f"version {m.format_version} (no piece checksums: re-prepare to publish to s3://)"
    if m.format_version == 2:
        return f"version 2, pieces of {m.piece_bytes:,} bytes (digests in the manifest)"
    return (
        f"version {m.format_version}, pieces of {m.piece_bytes:,} bytes (digests in the "
        f"sidecar {m.pieces_file}, read on demand)"
    )


def _conclude(report: VerifyReport, *, contents: str | None, fix: str) -> int:
    """Print the verdict; ``contents``: what the checksum line says when they were not
    checked (None: they were). Returns the exit status."""
    if not report.ok:
        bad = len(report.findings)
        print(f"problems     {bad} of {report.objects} files missing or damaged:")
        for f in report.findings:
            print(f"  {f.kind:<8} {f.url}: {f.detail}")
        print(f"to fix       {fix}")
        print(
            f"tokenfeed-server inspect: {bad} file(s) missing or damaged (listed above)",
            file=sys.stderr,
        )
        return EXIT_FINDINGS
    print("objects      ok (every file present, sizes match)")
    if contents is None:
        print(f"checksums    ok ({report.pieces} pieces, {report.bytes:,} bytes)")
    else:
        print(f"checksums    {contents}")
    return 0


def _inspect_local(path: Path, args: argparse.Namespace) -> int:
    from tokenfeed_server.store import Manifest, open_dataset
    from tokenfeed_server.store.format import MANIFEST_NAME
    from tokenfeed_server.store.verify import Finding, verify_local

    refused: CorruptShard | ManifestError | None = None
    try:
        with open_dataset(path.parent, path.name) as ds:
            manifest = ds.manifest
    except (CorruptShard, ManifestError) as exc:  # listed with every other finding below
        refused = exc
        try:
            manifest = Manifest.from_json((path / MANIFEST_NAME).read_bytes())
        except (OSError, ManifestError):
            raise exc from None
    _print_summary(path.name, str(path), manifest.fingerprint, manifest)
    _print_versions(path.parent, path.name, manifest.fingerprint)
    with _progress(args, f"checking {path.name}") as progress:
        report = verify_local(path, manifest, checksums=not args.no_verify, progress=progress)
    if refused is not None and report.ok:  # e.g. a bad header of a version-1 shard
        report.findings.append(Finding(str(path), "", "damaged", str(refused)))
    fix = f"rebuild it with tokenfeed-server prepare ... --dataset {path.name} --overwrite"
    return _conclude(
        report, contents="not verified (--no-verify)" if args.no_verify else None, fix=fix
    )


def _inspect_remote(location: S3Location, args: argparse.Namespace) -> int:
    from tokenfeed_server.store.objects import ObjectStore
    from tokenfeed_server.store.publish import read_published
    from tokenfeed_server.store.verify import RepairSource, repair_command, verify_published

    parent, name = location.split()
    store = ObjectStore(parent)
    m = read_published(store, name)
    _print_summary(name, store.url(name), m.fingerprint, m)
    _print_versions(store, name, m.fingerprint)
    source = None
    if args.repair:  # refused before anything is downloaded
        source = RepairSource(args.source, name, m, store.url(name))
    pieces = bool(args.verify or args.repair)
    with _progress(args, f"checking {name}") as progress:
        report = verify_published(
            store, name, m, pieces=pieces, threads=args.threads, progress=progress
        )
    fix = repair_command(parent.url(), name)
    if source is None or report.ok:
        skipped = (
            None if pieces else "not verified (pass --verify to download and check every piece)"
        )
        return _conclude(report, contents=skipped, fix=fix)
    for f in report.findings:
        print(f"found        {f.kind} {f.url}: {f.detail}")
    keys = source.upload(
        store,
        report.findings,
        threads=args.threads,
        on_upload=lambda key, size: print(f"uploaded     {store.url(key)} ({size:,} bytes)"),
    )
    with _progress(args, f"checking {name} again") as progress:
        again = verify_published(
            store, name, m, pieces=True, keys=set(keys), threads=args.threads, progress=progress
        )
    if again.ok:
        print(f"repaired     {len(keys)} object(s) uploaded again from {source.directory}")
        print(f"checksums    ok ({again.pieces} pieces, {again.bytes:,} bytes checked again)")
        return 0
    return _conclude(again, contents=None, fix=fix)
