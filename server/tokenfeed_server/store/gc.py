"""``tokenfeed-server gc``: delete what no version in use needs, never what a job reads.

Publishing never deletes (:mod:`~tokenfeed_server.store.publish`): ``--overwrite`` leaves
the previous version, and an interrupted publish leaves the files it uploaded. A dataset
is a series of versions (:mod:`~tokenfeed_server.store.versions`); gc decides per dataset
which versions to keep, then deletes the objects that no kept version names.

**Kept versions** (by use first, by age last):

* the current one (``NAME/manifest.json``);
* the newest ``--keep-versions`` (K, default 3; by the time each version was published),
  so that a run preempted for hours, or an investigation of an old step, finds its data;
* every version named by an unexpired server lease (:mod:`~.leases`): a running job reads
  it. This holds whatever ``--grace`` says; an expired lease (its server died) is ignored,
  and deleted;
* every version that stopped being current less than ``--grace`` seconds ago: a server
  that writes no lease (``--read-only-store``) is protected by age alone, so gc says when
  it found no lease at all.

Objects: a version's manifest (``NAME/versions/<fp>.json``) goes with its version; a
content-addressed object (``shard-<id>.bin``, ``<stem>-<hash>.<suffix>``, shared between
versions) is deleted once no kept version names it and it and the current manifest are
older than the grace period (a publish in progress has uploaded files its manifest does
not name yet). A lease naming a version gc cannot read (e.g. the previous build of a
store written before versions existed) keeps every unreferenced object of that dataset:
gc cannot tell which of them it needs. A store written before versions (no
``versions/``, no leases) is collected exactly as before: its current manifest is its only
version. Anything not named the way tokenfeed names its objects is counted as foreign
and never deleted; an unreadable manifest stops gc for that dataset.

**The re-check, and the window left.** Deciding takes a while (listings, manifests), and
meanwhile a server may take a lease (a job resumed on an old version) or a publish may
start to name an object again (reusing it: it touches it, renewing its time). So just
before deleting, gc decides again from scratch (a fresh listing of the dataset, fresh
leases, the current manifest read again) and deletes only what both passes chose. What is
left is the time between that second look and the delete request itself (milliseconds):

* a publish that reuses an object in that moment may write a manifest naming an object
  gc then deletes. It is detected (gc reads the current manifest once more after deleting
  and warns), never served wrong (pieces are verified), and repaired by running the
  publish again: publish checks every object by its ETag and uploads whatever is not
  there. (A reuse before the second look touched the object after gc began, which makes
  it too young to delete; with ``--grace`` under a second S3's whole-second times can
  hide a touch in gc's first second.)
* a server that opens a dropped old version in that moment (only a resume pinned to a
  version beyond the newest K and past the grace period can ask for one) names it in its
  lease within about a second, too late: the job fails naming the missing object, as a
  resume of a version that is gone does. A version opened a second or more before the
  second look is in a lease by then, and kept.

**Local stores** (:func:`gc_local`): the current build is ``STORE/NAME`` itself; the older
ones an overwrite kept under ``STORE/_tokenfeed/versions/NAME/<fp>/`` are pruned by the
same rules (the current one counts as one of the newest K; the grace period counts from
when a build was retired), leases read again just before each removal. A job that has a
build's files open keeps reading them even then (they are unlinked, not changed).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

from tokenfeed.errors import StoreError, TokenFeedError
from tokenfeed_server.store.format import MANIFEST_NAME, TEMP_PREFIX
from tokenfeed_server.store.leases import Lease, LeaseScan, delete_lease, read_leases
from tokenfeed_server.store.local import list_datasets
from tokenfeed_server.store.manifest import Manifest
from tokenfeed_server.store.objects import ObjectInfo, ObjectStore
from tokenfeed_server.store.reader import is_dataset_name, validate_dataset_name
from tokenfeed_server.store.versions import (
    RESERVED_PREFIX,
    VERSIONS_DIR,
    list_versions,
    local_versions_root,
    parse_version_key,
)
from tokenfeed_server.store.writer import clean_stale_temp_dirs

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_KEEP_VERSIONS",
    "NO_LEASES",
    "GcReport",
    "GcResult",
    "KeptVersion",
    "LocalResult",
    "gc_local",
    "gc_objects",
]

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 3600.0
DEFAULT_KEEP_VERSIONS = 3
#: What gc says when no server holds a lease: read-only servers are protected by age only.
NO_LEASES = (
    "no server leases found: if servers run with --read-only-store, only --grace protects "
    "the versions they read"
)
# shard-<content id>.bin, <stem>-<blake2b-128>[.suffix] (see store.publish)
_CONTENT_NAME = re.compile(r"shard-[0-9a-f]{32}\.bin|[^/]+-[0-9a-f]{32}(\.[^/]+)?")


@dataclass
class KeptVersion:
    """One version gc keeps, and every reason it does (current, newest K, a lease...)."""

    fingerprint: str
    reasons: list[str]


@dataclass
class GcResult:
    """What gc found under one dataset prefix of an object store."""

    dataset: str
    has_manifest: bool = False
    #: the current version's fingerprint (None: no manifest)
    current: str | None = None
    #: objects a kept version names
    referenced: int = 0
    kept: list[KeptVersion] = field(default_factory=list)
    #: fingerprints of the versions dropped (their manifests are in ``deleted``)
    dropped: list[str] = field(default_factory=list)
    #: unreferenced and older than the grace period: deleted (or, dry run, to delete)
    deleted: list[ObjectInfo] = field(default_factory=list)
    #: unreferenced but younger than the grace period: kept this time
    young: list[ObjectInfo] = field(default_factory=list)
    #: unreferenced, but a lease names a version whose manifest is gone: kept
    held: list[ObjectInfo] = field(default_factory=list)
    #: not named like a file publish writes: never deleted
    foreign: list[ObjectInfo] = field(default_factory=list)
    #: chosen by the first look, spared by the re-check just before deleting
    raced: list[ObjectInfo] = field(default_factory=list)
    #: why nothing was deleted here ("" when gc ran)
    error: str = ""
    #: something the operator must act on although gc ran (a publish raced it)
    warning: str = ""

    @property
    def deleted_bytes(self) -> int:
        """The bytes of the deleted objects."""
        return sum(o.size for o in self.deleted)


@dataclass
class LocalResult:
    """What gc found for one dataset of a local store: its kept older builds."""

    dataset: str
    current: str | None = None
    kept: list[KeptVersion] = field(default_factory=list)
    #: version directories removed (or, dry run, to remove)
    deleted: list[Path] = field(default_factory=list)
    #: chosen by the first look, spared because a lease appeared before the delete
    raced: list[Path] = field(default_factory=list)
    error: str = ""


@dataclass
class GcReport:
    """One gc run: per dataset what was kept and deleted, and the leases it honoured."""

    #: an object store's datasets
    datasets: list[GcResult] = field(default_factory=list)
    #: a local store's datasets (older builds) and its dead writers' temp directories
    local: list[LocalResult] = field(default_factory=list)
    temp_dirs: list[Path] = field(default_factory=list)
    #: unexpired leases at the start, and the expired ones (deleted unless a dry run)
    leases: list[Lease] = field(default_factory=list)
    expired: list[Lease] = field(default_factory=list)
    unreadable_leases: list[str] = field(default_factory=list)

    @property
    def no_leases(self) -> bool:
        """True when no server holds a lease: only age protected the versions in use."""
        return not self.leases


@dataclass(frozen=True)
class _Version:
    """A version on the timeline: ``key`` of its version manifest (None: the current
    manifest of a dataset published before versions, its only version)."""

    fingerprint: str
    modified: datetime
    key: str | None


# ---------------------------------------------------------------------------- object store


def gc_objects(
    store: ObjectStore,
    *,
    name: str | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    keep_versions: int = DEFAULT_KEEP_VERSIONS,
    dry_run: bool = False,
    now: datetime | None = None,
) -> GcReport:
    """Collect every dataset of ``store`` (only ``name`` with ``name``): see the module
    docstring for what is kept. ``dry_run`` deletes nothing; ``now`` stands for the clock
    (tests), also when judging leases."""
    _check_args(grace_s, keep_versions, name)
    store.check_bucket()
    moment = now or datetime.now(timezone.utc)
    cutoff = moment - timedelta(seconds=grace_s)
    report = _lease_report(read_leases(store), moment)
    groups: dict[str, list[ObjectInfo]] = {}
    for info in store.list(f"{name}/" if name is not None else ""):
        dataset, sep, _ = info.key.partition("/")
        # objects right under the prefix belong to no dataset; _tokenfeed/ is gc's input
        if sep and dataset != RESERVED_PREFIX:
            groups.setdefault(dataset, []).append(info)
    for dataset in sorted(groups):
        first = _plan(
            store, dataset, groups[dataset], leases=report.leases, cutoff=cutoff, keep=keep_versions
        )
        if first.error or not first.deleted or dry_run:
            report.datasets.append(first)
            continue
        report.datasets.append(_recheck_and_delete(store, first, moment, cutoff, keep_versions))
    if not dry_run:
        report.expired = _delete_expired(store, report.expired, moment)
    return report


def _check_args(grace_s: float, keep_versions: int, name: str | None) -> None:
    if grace_s < 0:
        raise TokenFeedError(f"--grace must be >= 0 seconds, got {grace_s}")
    if keep_versions < 1:
        raise TokenFeedError(f"--keep-versions must be >= 1, got {keep_versions}")
    if name is not None:
        validate_dataset_name(name)


def _lease_report(scan: LeaseScan, moment: datetime) -> GcReport:
    now = moment.timestamp()
    for where in scan.unreadable:
        log.warning("gc: %s is not a lease tokenfeed can read; ignored", where)
    return GcReport(
        leases=scan.valid(now), expired=scan.expired(now), unreadable_leases=scan.unreadable
    )


def _plan(
    store: ObjectStore,
    dataset: str,
    objects: list[ObjectInfo],
    *,
    leases: list[Lease],
    cutoff: datetime,
    keep: int,
) -> GcResult:
    """One look at one dataset: which versions to keep and which objects to delete."""
    result = GcResult(dataset)
    manifest_key = f"{dataset}/{MANIFEST_NAME}"
    referenced = {manifest_key}
    current: Manifest | None = None
    manifest_time: datetime | None = None
    try:
        if any(o.key == manifest_key for o in objects):
            result.has_manifest = True
            # Read after the listing; its time is looked up after reading it, so the time
            # is never older than the content read (a manifest replaced meanwhile only
            # makes gc wait longer). An object listed for a newer one is younger too.
            current = Manifest.from_json(store.get(manifest_key))
            info = store.head(manifest_key)
            manifest_time = info.modified if info is not None else datetime.now(timezone.utc)
            result.current = current.fingerprint
            referenced |= _names(dataset, current)
        timeline = _timeline(dataset, objects, current, manifest_time)
        reasons = _keep_reasons(dataset, result.current, leases)
        _keep_newest(reasons, timeline, keep)
        _keep_young(reasons, timeline, result.current, manifest_time, cutoff)
        for version in timeline:
            if version.fingerprint not in reasons:
                result.dropped.append(version.fingerprint)
            elif version.key is not None:
                referenced.add(version.key)
                if version.fingerprint != result.current:
                    referenced |= _names(dataset, Manifest.from_json(store.get(version.key)))
    except StoreError as exc:
        result.error = f"a manifest is unreadable, nothing deleted: {exc}"
        log.warning("gc %s: %s", store.url(dataset), result.error)
        return result
    known = {v.fingerprint for v in timeline}
    result.kept = _kept(reasons, timeline, known)
    dropped = {v.key for v in timeline if v.fingerprint in result.dropped and v.key}
    # before the grace period ends, the manifest's own time protects what it dropped
    old = manifest_time is None or manifest_time < cutoff
    hold_all = any(fp not in known for fp in reasons)
    _classify(
        result, objects, referenced, dropped, cutoff=cutoff if old else None, hold_all=hold_all
    )
    return result


def _classify(
    result: GcResult,
    objects: list[ObjectInfo],
    referenced: set[str],
    dropped: set[str],
    *,
    cutoff: datetime | None,
    hold_all: bool,
) -> None:
    """Sort ``objects`` into ``result``: ``dropped`` (version manifests) and the
    unreferenced objects of ours older than ``cutoff`` (None: none is) are deleted;
    with ``hold_all`` (a leased version gc cannot read) no unreferenced one is."""
    for info in objects:
        if info.key in referenced:
            result.referenced += 1
        elif info.key in dropped:
            result.deleted.append(info)
        elif not _ours(result.dataset, info.key):
            result.foreign.append(info)
        elif hold_all:
            result.held.append(info)
        elif cutoff is not None and info.modified < cutoff:
            result.deleted.append(info)
        else:
            result.young.append(info)


def _timeline(
    dataset: str, objects: list[ObjectInfo], current: Manifest | None, current_time: datetime | None
) -> list[_Version]:
    """The dataset's versions, newest first: its version manifests, and the current one
    when it has none (a dataset published before versions)."""
    found: list[_Version] = []
    for info in objects:
        parsed = parse_version_key(info.key)
        if parsed is not None and parsed[0] == dataset:
            found.append(_Version(parsed[1], info.modified, info.key))
    if current is not None and all(v.fingerprint != current.fingerprint for v in found):
        assert current_time is not None
        found.append(_Version(current.fingerprint, current_time, None))
    # S3 times are whole seconds: of versions published in one second the current one
    # counts as the newest
    current_fp = current.fingerprint if current is not None else None
    found.sort(key=lambda v: (v.modified, v.fingerprint == current_fp, v.fingerprint))
    return found[::-1]


def _keep_reasons(dataset: str, current: str | None, leases: list[Lease]) -> dict[str, list[str]]:
    """Fingerprint -> why it is kept, for the current version and the leased ones."""
    reasons: dict[str, list[str]] = {}
    if current is not None:
        reasons[current] = ["current"]
    for lease in leases:
        for fingerprint in sorted(lease.held.get(dataset, ())):
            until = datetime.fromtimestamp(lease.valid_until, timezone.utc)
            why = f"leased by {lease.describe()} until {until.isoformat(timespec='seconds')}"
            reasons.setdefault(fingerprint, []).append(why)
    return reasons


def _keep_newest(reasons: dict[str, list[str]], timeline: list[_Version], keep: int) -> None:
    for version in timeline[:keep]:
        reasons.setdefault(version.fingerprint, []).append(f"one of the newest {keep}")


def _keep_young(
    reasons: dict[str, list[str]],
    timeline: list[_Version],
    current: str | None,
    current_time: datetime | None,
    cutoff: datetime,
) -> None:
    """Versions that stopped being current within the grace period: a server without a
    lease may have started a job on one until then. A version stopped being current
    when the next newer one was published (the newest: when the current manifest was)."""
    for i, version in enumerate(timeline):
        if version.fingerprint == current:
            continue
        successor = timeline[i - 1].modified if i else current_time
        retired = max(version.modified, successor) if successor else version.modified
        if retired >= cutoff:
            reasons.setdefault(version.fingerprint, []).append("younger than the grace period")


def _kept(
    reasons: dict[str, list[str]], timeline: list[_Version], known: set[str]
) -> list[KeptVersion]:
    """The kept versions in timeline order, then leased ones gc cannot find."""
    kept = [
        KeptVersion(v.fingerprint, reasons[v.fingerprint])
        for v in timeline
        if v.fingerprint in reasons
    ]
    for fingerprint in sorted(set(reasons) - known):
        why = [*reasons[fingerprint], "its manifest is gone: every unreferenced object kept"]
        kept.append(KeptVersion(fingerprint, why))
    return kept


def _names(dataset: str, manifest: Manifest) -> set[str]:
    """The keys of the objects one version needs."""
    names = {f"{dataset}/{s.name}" for s in manifest.shards}
    if manifest.pieces_file:  # version 3: the sidecar of piece digests is the version's
        names.add(f"{dataset}/{manifest.pieces_file}")
    return names | {f"{dataset}/{f}" for f in manifest.extra_files}


def _recheck_and_delete(
    store: ObjectStore, first: GcResult, moment: datetime, cutoff: datetime, keep: int
) -> GcResult:
    """Decide again from a fresh look (listing, leases, manifests) and delete only what
    both looks chose; version manifests first, so no server opens a version whose shards
    are going. Then look at the current manifest once more (see the module docstring)."""
    dataset = first.dataset
    leases = read_leases(store).valid(moment.timestamp())
    listing = list(store.list(f"{dataset}/"))
    again = _plan(store, dataset, listing, leases=leases, cutoff=cutoff, keep=keep)
    if again.error:
        return again
    chosen = {o.key for o in again.deleted}
    again.raced = [o for o in first.deleted if o.key not in chosen]
    again.deleted = [o for o in again.deleted if o.key in {f.key for f in first.deleted}]
    again.dropped = [fp for fp in again.dropped if fp in first.dropped]
    gone = {o.key for o in again.deleted}
    versions = {key for key in gone if parse_version_key(key) is not None}
    store.delete(sorted(versions))
    store.delete(sorted(gone - versions))
    log.info("gc %s: deleted %d object(s)", store.url(dataset), len(again.deleted))
    if again.raced:
        log.info("gc %s: %d object(s) spared by the re-check", store.url(dataset), len(again.raced))
    try:
        named = _names(dataset, Manifest.from_json(store.get(f"{dataset}/{MANIFEST_NAME}")))
    except StoreError:
        return again  # no current manifest (any more): nothing can name what went
    lost = sorted(named & gone)
    if lost:
        again.warning = (
            f"a publish raced this gc: the current manifest names {len(lost)} deleted "
            f"object(s) ({store.url(lost[0])}, ...); run the publish again "
            "(tokenfeed-server prepare ... --overwrite uploads whatever is missing)"
        )
        log.warning("gc %s: %s", store.url(dataset), again.warning)
    return again


def _delete_expired(
    store: Path | ObjectStore, expired: list[Lease], moment: datetime
) -> list[Lease]:
    """Delete the lapsed leases still lapsed and unchanged now (a server that came back
    and wrote again keeps its new lease); return those deleted."""
    if not expired:
        return []
    again = {lease.where: lease for lease in read_leases(store).expired(moment.timestamp())}
    gone = [x for x in expired if x.where in again and again[x.where].stamp == x.stamp]
    for lease in gone:
        try:
            delete_lease(store, lease.where)
        except (StoreError, OSError) as exc:
            log.warning("gc: could not delete the expired lease %s: %s", lease.where, exc)
    return gone


def _ours(dataset: str, key: str) -> bool:
    """True for ``DATASET/FILE`` with FILE named the way publish names files (by content):
    gc never deletes anything else, whatever else shares the prefix."""
    name = key[len(dataset) + 1 :]
    return is_dataset_name(dataset) and _CONTENT_NAME.fullmatch(name) is not None


# ---------------------------------------------------------------------------- local store


def gc_local(
    store: Path,
    *,
    name: str | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    keep_versions: int = DEFAULT_KEEP_VERSIONS,
    dry_run: bool = False,
    now: datetime | None = None,
) -> GcReport:
    """A local store's gc: the older builds of each dataset (``_tokenfeed/versions/``)
    kept by the same rules as an object store's versions, and the temp directories of
    dead writers (not with ``name``; a dry run lists every temp directory, a live
    writer's included)."""
    _check_args(grace_s, keep_versions, name)
    if not store.is_dir():
        raise StoreError(f"store {store} is not a directory")
    moment = now or datetime.now(timezone.utc)
    cutoff = moment - timedelta(seconds=grace_s)
    report = _lease_report(read_leases(store), moment)
    for dataset in [name] if name is not None else _local_names(store):
        result = _plan_local(store, dataset, report.leases, cutoff, keep_versions)
        if result.deleted and not dry_run:
            _delete_local(store, result, moment)
        report.local.append(result)
    if name is None:
        if dry_run:
            report.temp_dirs = sorted(p for p in store.iterdir() if p.name.startswith(TEMP_PREFIX))
        else:
            report.temp_dirs = sorted(clean_stale_temp_dirs(store))
    if not dry_run:
        report.expired = _delete_expired(store, report.expired, moment)
    return report


def _local_names(store: Path) -> list[str]:
    """Every dataset that is current or has older builds kept."""
    names = set(list_datasets(store))
    root = store / RESERVED_PREFIX / VERSIONS_DIR
    if root.is_dir():
        names |= {p.name for p in root.iterdir() if p.is_dir() and is_dataset_name(p.name)}
    return sorted(names)


def _plan_local(
    store: Path, dataset: str, leases: list[Lease], cutoff: datetime, keep: int
) -> LocalResult:
    """Which older builds of ``dataset`` go: the current build counts as the newest."""
    result = LocalResult(dataset)
    manifest = store / dataset / MANIFEST_NAME
    try:
        if manifest.is_file():
            result.current = Manifest.from_json(manifest.read_bytes()).fingerprint
        versions = list_versions(store, dataset)
    except (StoreError, OSError) as exc:
        result.error = f"cannot read its versions, nothing deleted: {exc}"
        return result
    # The current build is STORE/NAME itself, never pruned; a kept older build with the
    # same content (built again after another) is judged like any other.
    reasons = _keep_reasons(dataset, None, leases)
    room = keep - (1 if result.current is not None else 0)
    for version in versions[: max(0, room)]:
        reasons.setdefault(version.fingerprint, []).append(f"one of the newest {keep}")
    for version in versions:
        if version.modified >= cutoff:
            reasons.setdefault(version.fingerprint, []).append("younger than the grace period")
    for version in versions:
        if version.fingerprint in reasons:
            result.kept.append(KeptVersion(version.fingerprint, reasons[version.fingerprint]))
        else:
            result.deleted.append(Path(version.location))
    if result.current is not None:
        why = ["current", f"one of the newest {keep}", *reasons.get(result.current, [])]
        result.kept.insert(0, KeptVersion(result.current, why))
    return result


def _delete_local(store: Path, result: LocalResult, moment: datetime) -> None:
    """Remove the chosen older builds, leases read again first. Each is renamed out of
    the versions directory before it is removed, so no server ever opens half of one
    (one that has it open keeps its files: they are unlinked, not changed)."""
    leases = read_leases(store).valid(moment.timestamp())
    chosen, result.deleted = result.deleted, []
    for path in chosen:
        if any(lease.holds(result.dataset, path.name) for lease in leases):
            result.raced.append(path)
            continue
        doomed = path.with_name(f".gc-{path.name}-{os.getpid()}")
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            continue  # another gc took it
        shutil.rmtree(doomed, ignore_errors=True)
        result.deleted.append(path)
    where = local_versions_root(store, result.dataset)
    log.info("gc %s: removed %d older build(s)", where, len(result.deleted))
