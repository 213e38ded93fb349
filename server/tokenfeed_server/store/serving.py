"""The serving Store: the datasets of one directory, opened once and shared by every job.

A dataset is validated when first opened (see
:func:`~tokenfeed_server.store.reader.open_dataset`); it is then shared by all jobs, so
the page cache holds one copy whatever the number of trainers.

The data plane's loop thread never touches the file system to look a dataset up: a
watcher thread rescans the store every ``scan_interval_s`` and (re)opens what changed,
and :meth:`Store.get` only reads the result. A dataset that appears is served from the
next scan on; one replaced on disk (``prepare --overwrite``, noticed by the identity of
its manifest file) is reopened for new jobs; one removed is no longer found.

Versions: a job reads the version it started on until it ends. The Store keeps, besides
the current dataset per name, the older versions jobs still hold
(:mod:`~tokenfeed_server.store.pinned`), and :meth:`Store.version` finds one by
fingerprint, a hello's or a checkpoint's, opening a kept version on demand (on the
watcher thread: the loop is told to ask again) from ``_tokenfeed/versions/`` of a local
store or ``NAME/versions/`` of a remote one (see :mod:`~tokenfeed_server.store.versions`).

A store in object storage (``s3://BUCKET/PREFIX``) is watched through its catalog
(:mod:`~tokenfeed_server.store.catalog`): one conditional GET every ``scan_interval_s``,
whatever the number of datasets, and only the datasets whose entry changed are read
again. A store without a catalog (written before it existed) is listed instead
(``PREFIX/*/manifest.json``, a replaced manifest has a new ETag), every
:data:`LEGACY_SCAN_EVERY` intervals. Its datasets are
:class:`~tokenfeed_server.store.remote.RemoteDataset` objects, which read verified pieces
through the server's :class:`~tokenfeed_server.store.cache.PieceCache`. While object
storage fails, the last view is kept and the log says so once (and then once a minute),
not once per scan.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenfeed.errors import DatasetNotFound, ManifestError, StoreError
from tokenfeed_server.logbudget import LogBudget
from tokenfeed_server.store.assemble import assemble
from tokenfeed_server.store.catalog import Catalog, CatalogError, poll_catalog
from tokenfeed_server.store.errors import DamagedShardObject, MissingShardObject
from tokenfeed_server.store.format import MANIFEST_NAME
from tokenfeed_server.store.local import list_datasets, open_dataset
from tokenfeed_server.store.objects import ObjectStoreError, S3Location
from tokenfeed_server.store.pinned import PinnedVersions, VersionGone, VersionOpening
from tokenfeed_server.store.pools import (
    DEFAULT_POOL_BYTES,
    Order,
    RowBuffers,
    WindowBlocks,
    row_buffers,
    window_blocks,
)
from tokenfeed_server.store.reader import Dataset, validate_dataset_name
from tokenfeed_server.store.remote import list_remote_datasets, open_remote_dataset
from tokenfeed_server.store.versions import (
    build_fingerprint,
    is_fingerprint,
    local_version_dir,
    local_versions_root,
)

if TYPE_CHECKING:
    from tokenfeed_server.store.cache import PieceCache
    from tokenfeed_server.store.objects import ObjectStore

# The pools moved to store.pools (issue 28); their names here still work.
__all__ = [
    "DEFAULT_POOL_BYTES",
    "DEFAULT_SCAN_INTERVAL_S",
    "LEGACY_SCAN_EVERY",
    "Order",
    "RowBuffers",
    "Store",
    "VersionGone",
    "VersionOpening",
    "WindowBlocks",
    "assemble",
    "row_buffers",
    "summary",
    "window_blocks",
]

log = logging.getLogger(__name__)

#: Seconds between two scans of the store directory by the watcher.
DEFAULT_SCAN_INTERVAL_S = 0.5
#: A remote store without a catalog is listed every this many scan intervals.
LEGACY_SCAN_EVERY = 6
#: Seconds between two log lines saying that rescans still fail.
_RESCAN_REMINDER_S = 60.0

# The identity of a manifest file: a dataset published again gets a new inode (local),
# a new ETag (object storage).
_Signature = tuple[object, ...]


#: Seconds between two attempts to open a remote dataset that storage or a missing or
#: damaged object kept from opening.
RETRY_BROKEN_S = 10.0
_RETRIED_AT_OPEN = (ObjectStoreError, MissingShardObject, DamagedShardObject)


@dataclass(frozen=True)
class _Listing:
    """One dataset as the last scan found it: opened, or the error that stops it."""

    signature: _Signature
    dataset: Dataset | None
    error: StoreError | None
    #: when this was found (monotonic): a broken remote dataset is opened again after
    #: :data:`RETRY_BROKEN_S`
    when: float = field(default_factory=time.monotonic)


class Store:
    """The datasets of one store directory, by name, kept current by a watcher thread.

    :meth:`open_all` opens every dataset and starts the watcher; :meth:`close` stops it.
    """

    def __init__(
        self,
        root: Path | S3Location,
        *,
        verify_checksums: bool = False,
        scan_interval_s: float = DEFAULT_SCAN_INTERVAL_S,
        objects: ObjectStore | None = None,
        cache: PieceCache | None = None,
    ) -> None:
        if scan_interval_s <= 0:
            raise ValueError(f"scan_interval_s must be > 0, got {scan_interval_s}")
        if isinstance(root, S3Location) and (objects is None or cache is None):
            raise ValueError("a store in object storage needs its ObjectStore and a PieceCache")
        self.root = root
        #: For a store in object storage: its objects, and the cache its datasets read from.
        self.objects = objects if isinstance(root, S3Location) else None
        self.cache = cache if isinstance(root, S3Location) else None
        self.verify_checksums = verify_checksums
        self.scan_interval_s = scan_interval_s
        # Replaced whole by the watcher, never mutated: readers need no lock.
        self._entries: dict[str, _Listing] = {}
        #: the older versions jobs hold, and those opened on demand
        self.pinned = PinnedVersions()
        # local: the fingerprints kept under _tokenfeed/versions/, by name, at the last
        # scan (a version in none is refused at once); remote: None (not listed per poll)
        self._kept: dict[str, frozenset[str]] | None = None if self.objects else {}
        self._catalog: Catalog | None = None  # as last read (remote)
        self._catalog_error = ""  # why the catalog could not be read (logged once)
        self._legacy_wait = 0  # scans to skip before listing a store without a catalog
        self._scans = threading.Condition()
        self._started = 0  # scans begun
        self._finished = 0  # scans completed
        self._forced = False  # a scan was asked for (wait_for_scan): list even if not due
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log_budget = LogBudget(per_s=5)
        self._failing_since: float | None = None  # rescans fail since (monotonic)
        self._reminded = 0.0

    # -- lifecycle -------------------------------------------------------------------

    def open_all(self, *, watch: bool = True) -> None:
        """Open and validate every dataset now (problems show in the start-up log), then
        start the watcher unless ``watch`` is false.

        Checksums are verified here when the Store was made with ``verify_checksums``;
        never for datasets that appear or change later, so a rescan stays cheap.
        """
        if self.objects is not None:
            self.objects.check_readable()  # serving reads: no write permission asked
        elif not isinstance(self.root, Path) or not self.root.is_dir():
            raise StoreError(
                f"store directory {self.root} does not exist; create it with "
                "`tokenfeed-server prepare ... --store DIR` or point --store at an existing one"
            )
        self.scan(verify_checksums=self.verify_checksums, initial=True)
        if watch and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._watch, name="tokenfeed-store-watcher", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        """Stop the watcher and close every open dataset."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        entries, self._entries = self._entries, {}
        for entry in entries.values():
            if entry.dataset is not None:
                entry.dataset.close()
        self.pinned.close()

    # -- look-ups (memory only) ------------------------------------------------------

    def get(self, name: str) -> Dataset:
        """The open dataset ``name``; raises DatasetNotFound or the error that stops it."""
        validate_dataset_name(name)
        entry = self._entries.get(name)
        if entry is None:
            raise DatasetNotFound(
                f"dataset {name!r} is not in store {self.root}; available: "
                f"{', '.join(self.names()) or 'none'}"
            )
        if entry.error is not None:
            raise entry.error
        assert entry.dataset is not None
        return entry.dataset

    def version(self, name: str, fingerprint: str) -> Dataset:
        """Version ``fingerprint`` of dataset ``name`` (``""``: the current one), for the
        data plane's loop: memory only.

        Raises :class:`VersionOpening` (ask again shortly) when that version is kept but
        not open yet: the watcher is woken to open it. :class:`VersionGone` when it is
        not kept; DatasetNotFound, or the error that stops it, as :meth:`get`.
        """
        if not fingerprint:
            return self.get(name)
        validate_dataset_name(name)
        entry = self._entries.get(name)
        if entry is not None and entry.dataset and entry.dataset.fingerprint == fingerprint:
            return entry.dataset
        found = self.pinned.lookup(name, fingerprint)
        if found is not None:
            return found
        if entry is None:
            self.get(name)  # not in the store: DatasetNotFound
        kept = self._kept.get(name, frozenset()) if self._kept is not None else None
        if not is_fingerprint(fingerprint) or (kept is not None and fingerprint not in kept):
            raise VersionGone(self._gone(name, fingerprint))
        self.pinned.request(name, fingerprint)
        self._wake.set()
        raise VersionOpening(
            f"version {fingerprint} of dataset {name!r} (an earlier build a job is pinned "
            "to) is being opened; ask again shortly"
        )

    def names(self) -> list[str]:
        """Names of the complete datasets on disk at the last scan, sorted."""
        return sorted(self._entries)

    def held_versions(self) -> dict[str, list[str]]:
        """``{name: fingerprints}`` of every version open now: the current ones and the
        older ones jobs hold."""
        held = self.pinned.held()
        for name, entry in self._entries.items():
            if entry.dataset is not None:
                held[name] = sorted({*held.get(name, ()), entry.dataset.fingerprint})
        return held

    def summaries(self) -> list[dict[str, Any]]:
        """One summary per dataset on disk, including those that fail to open."""
        out = []
        for name, entry in sorted(self._entries.items()):
            if entry.dataset is not None:
                out.append(self.summary(entry.dataset))
            else:
                out.append({"name": name, "ok": False, "error": str(entry.error)})
        return out

    def summary(self, ds: Dataset) -> dict[str, Any]:
        """:func:`summary` of ``ds`` with the older versions of its name that jobs hold."""
        older = [fp for fp in self.pinned.fingerprints(ds.name) if fp != ds.fingerprint]
        return summary(ds, versions_in_use=older)

    # -- scanning (off the data plane's thread) -------------------------------------

    def wait_for_scan(self, timeout: float | None = None) -> bool:
        """Wait until a scan that began after this call has finished; False on timeout.

        What was on disk when this is called is then what :meth:`get` answers from. The
        watcher is woken at once, so this takes one scan, not one interval.
        """
        with self._scans:
            target = self._started + 1
            self._forced = True
            self._wake.set()
            return self._scans.wait_for(lambda: self._finished >= target, timeout)

    def scan(self, *, verify_checksums: bool = False, initial: bool = False) -> None:
        """Rescan the directory: open datasets that are new or whose manifest changed,
        forget removed ones. The watcher calls this; it is safe from one thread at a time.
        """
        with self._scans:
            self._started += 1
            forced, self._forced = self._forced, False
        try:
            old = self._entries
            self._entries = self._rescan(verify_checksums, initial or forced)
            self._retire(old, self._entries)
        finally:
            with self._scans:
                self._finished += 1
                self._scans.notify_all()

    def _retire(self, old: dict[str, _Listing], new: dict[str, _Listing]) -> None:
        """Track the datasets a scan replaced by another build: jobs may still read them."""
        for name, entry in old.items():
            now = new.get(name)
            ds = entry.dataset
            if ds is None or (now is not None and now.dataset is ds):
                continue
            if now is None or now.dataset is None or now.dataset.fingerprint != ds.fingerprint:
                self.pinned.add(ds, pin=False)
        self.pinned.prune()

    def _rescan(self, verify_checksums: bool, initial: bool) -> dict[str, _Listing]:
        old = self._entries
        new: dict[str, _Listing] = {}
        if self.objects is not None:
            return self._retry_broken(self._rescan_remote(old, initial))
        assert isinstance(self.root, Path)
        for name in list_datasets(self.root) if self.root.is_dir() else []:
            entry = old.get(name)
            try:
                st = os.stat(self.root / name / MANIFEST_NAME)
            except FileNotFoundError:
                continue  # removed between the listing and now
            except OSError as exc:  # e.g. EACCES: listed as broken, the others served
                signature: _Signature = (-1, -1, exc.errno or 0)
                if entry is None or entry.signature != signature:
                    error = StoreError(f"dataset {name!r}: cannot read its manifest: {exc}")
                    entry = _Listing(signature, None, error)
                    self._report(name, entry, True)
                new[name] = entry
                continue
            signature = (st.st_ino, st.st_mtime_ns, st.st_size)
            if entry is None or entry.signature != signature:
                # Running jobs hold the old Dataset and keep reading the old files.
                entry = self._open(name, signature, verify_checksums)
                self._report(name, entry, initial or name not in old)
            new[name] = entry
        # After the current builds: a build an overwrite retires meanwhile is then the
        # current one seen (stale, still open) or kept, never neither.
        self._kept = {name: _kept_versions(self.root, name) for name in new}
        return new

    def _remote_signatures(self, initial: bool) -> dict[str, _Signature] | None:
        """``{name: signature}`` of the remote store now: from its catalog (one request;
        signature ``("version", fingerprint)``), else from a listing of its manifests
        (``("manifest", etag, size)``), made every :data:`LEGACY_SCAN_EVERY` scans only
        (None: not this time)."""
        assert self.objects is not None
        try:
            catalog = poll_catalog(self.objects, self._catalog)
        except CatalogError as exc:  # a damaged catalog: the listing still works
            if str(exc) != self._catalog_error:
                log.error("%s; listing the store instead until it is rewritten", exc)
            self._catalog_error = str(exc)
            catalog = None
        else:
            self._catalog_error = ""
        self._catalog = catalog
        if catalog is not None:
            return {n: ("version", e.fingerprint) for n, e in catalog.datasets.items()}
        if not initial and self._legacy_wait > 0:
            self._legacy_wait -= 1
            return None
        self._legacy_wait = LEGACY_SCAN_EVERY - 1
        listed = list_remote_datasets(self.objects)
        return {name: ("manifest", etag, size) for name, (etag, size) in listed.items()}

    def _rescan_remote(self, old: dict[str, _Listing], initial: bool) -> dict[str, _Listing]:
        """(Re)open the datasets of the remote store that are new or changed."""
        signatures = self._remote_signatures(initial)
        if signatures is None:
            return old
        new: dict[str, _Listing] = {}
        for name, signature in signatures.items():
            entry = old.get(name)
            held = entry.dataset if entry is not None else None
            if held is not None and signature == ("version", held.fingerprint):
                entry = _Listing(signature, held, None)  # the same build (a first catalog)
            if entry is None or entry.signature != signature:
                # Running jobs hold the old Dataset: its pieces are content-addressed
                # objects that stay in the bucket until gc, so they never mix builds.
                fingerprint = str(signature[1]) if signature[0] == "version" else None
                opened = self._open(name, signature, False, fingerprint=fingerprint)
                if isinstance(opened.error, ObjectStoreError):
                    # Object storage failed (after retries), not the dataset: keep what
                    # was served, and try again at the next scan.
                    if entry is None or entry.dataset is None:
                        if entry is None or str(entry.error) != str(opened.error):
                            self._report(name, opened, True)
                        entry = _Listing((), None, opened.error)
                    new[name] = entry
                    continue
                entry = opened
                self._report(name, entry, initial or name not in old)
            new[name] = entry
        return new

    def _retry_broken(self, entries: dict[str, _Listing]) -> dict[str, _Listing]:
        """Open again, every :data:`RETRY_BROKEN_S`, the remote datasets that a storage
        fault or a missing or damaged shard object keeps from opening (their catalog
        entry has not changed, so the scan would not): an object put back, or repaired
        by ``inspect --repair``, is served again without a restart or a new build."""
        now = time.monotonic()
        out = dict(entries)
        for name, entry in entries.items():
            retryable = isinstance(entry.error, _RETRIED_AT_OPEN)
            if entry.dataset is not None or not retryable or now - entry.when < RETRY_BROKEN_S:
                continue
            version = str(entry.signature[1]) if entry.signature[:1] == ("version",) else None
            opened = self._open(name, entry.signature, False, fingerprint=version)
            if opened.dataset is not None:
                self._report(name, opened, False)
            elif str(opened.error) == str(entry.error):
                opened = _Listing(entry.signature, None, entry.error)  # logged once
            else:
                self._report(name, opened, False)
            out[name] = opened
        return out

    def _open(
        self,
        name: str,
        signature: _Signature,
        verify_checksums: bool,
        *,
        fingerprint: str | None = None,
    ) -> _Listing:
        # A failure is kept under its signature: a damaged dataset is not re-read on every
        # scan, only once its manifest changes (a rebuild).
        try:
            ds = self._open_dataset(name, verify_checksums, fingerprint)
        except StoreError as exc:
            return _Listing(signature, None, exc)
        except Exception as exc:
            # An OSError the reader did not expect, a manifest nested too deep to parse, a
            # bug: the dataset is listed broken and every other one is still served.
            error = StoreError(f"dataset {name!r} cannot be opened: {type(exc).__name__}: {exc}")
            return _Listing(signature, None, error)
        return _Listing(signature, ds, None)

    def _open_dataset(self, name: str, verify: bool, fingerprint: str | None) -> Dataset:
        """The current version of ``name`` (remote: the catalog's ``fingerprint``)."""
        if self.objects is None:
            assert isinstance(self.root, Path)
            return open_dataset(self.root, name, verify_checksums=verify)
        assert self.cache is not None
        if fingerprint is not None:
            try:
                return open_remote_dataset(self.objects, self.cache, name, fingerprint=fingerprint)
            except DatasetNotFound:
                pass  # no version object (removed by hand?): the current manifest then
        return open_remote_dataset(self.objects, self.cache, name)

    # -- older versions, on demand ---------------------------------------------------

    def _open_version(self, name: str, fingerprint: str) -> Dataset:
        """Open kept version ``fingerprint`` of ``name`` (DatasetNotFound: not kept)."""
        if self.objects is not None:
            assert self.cache is not None
            return open_remote_dataset(self.objects, self.cache, name, fingerprint=fingerprint)
        assert isinstance(self.root, Path)
        path = local_version_dir(self.root, name, fingerprint)
        if not path.is_dir():
            if build_fingerprint(self.root / name) != fingerprint:
                raise DatasetNotFound(f"version {fingerprint} of {name!r} is not kept")
            path = self.root / name  # current now, not noticed by a scan yet
        ds = open_dataset(self.root, name, path=path)
        if ds.fingerprint != fingerprint:
            ds.close()
            raise ManifestError(f"{path} holds build {ds.fingerprint}, not {fingerprint}")
        return ds

    def _gone(self, name: str, fingerprint: str) -> str:
        entry = self._entries.get(name)
        current = entry.dataset.fingerprint if entry is not None and entry.dataset else None
        now = f"the current version is {current}" if current else "it has no current version"
        return (
            f"version {fingerprint} of dataset {name!r} is no longer kept ({now}): it was "
            "replaced and removed by tokenfeed-server gc once no job held it and it was not "
            "among the last versions kept; continuing on another build would train on "
            "different data. Restore that build, or start over on purpose from a fresh "
            "state (no checkpointed loader state)"
        )

    def _report(self, name: str, entry: _Listing, new: bool) -> None:
        if entry.error is not None:
            log.error("dataset %s is not served: %s", name, entry.error)
            return
        ds = entry.dataset
        assert ds is not None
        log.info(
            "dataset %s %s: version %s, %d tokens, %d shards",
            name,
            "opened" if new else "replaced, reopened (running jobs keep their version)",
            ds.fingerprint,
            ds.n_tokens,
            len(ds.manifest.shards),
        )

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.scan_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.pinned.open_requested(self._open_version, self._gone)
                self.scan()
            except StoreError as exc:  # storage failing: keep the last view, say so once
                self._rescan_failed(exc)
            except Exception:  # a bug or an unreadable store: keep the last good view
                if self._log_budget.take():
                    log.exception("cannot rescan store %s", self.root)
            else:
                if self._failing_since is not None:
                    down = time.monotonic() - self._failing_since
                    log.warning("store %s: rescans work again (after %.0f s)", self.root, down)
                    self._failing_since = None

    def _rescan_failed(self, exc: StoreError) -> None:
        """One log line when rescans start failing, then one a minute while they do."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = self._reminded = now
            log.warning(
                "cannot rescan store %s: %s; serving the datasets as last seen, retrying "
                "every %.1f s",
                self.root,
                exc,
                self.scan_interval_s,
            )
        elif now - self._reminded >= _RESCAN_REMINDER_S:
            self._reminded = now
            log.warning(
                "store %s: rescans still fail (for %.0f s): %s",
                self.root,
                now - self._failing_since,
                exc,
            )


def _kept_versions(root: Path, name: str) -> frozenset[str]:
    """The fingerprints of the older builds of ``name`` a local store keeps."""
    try:
        entries = os.listdir(local_versions_root(root, name))
    except OSError:  # none kept (or unreadable: then opening one says why)
        return frozenset()
    return frozenset(e for e in entries if is_fingerprint(e))


def summary(ds: Dataset, *, versions_in_use: list[str] | None = None) -> dict[str, Any]:
    """The manifest summary served at /v1/datasets: ``version`` is the current version's
    id (its fingerprint), ``versions_in_use`` the older versions jobs still read."""
    m = ds.manifest
    return {
        "name": ds.name,
        "ok": True,
        "fingerprint": ds.fingerprint,
        "version": ds.fingerprint,
        "versions_in_use": list(versions_in_use or ()),
        "tokens": ds.n_tokens,
        "documents": ds.n_documents,
        "dtype": m.dtype,
        "shards": len(m.shards),
        "tokenizer": {
            "kind": m.tokenizer.kind,
            "vocab_size": m.tokenizer.vocab_size,
            "eos_id": m.tokenizer.eos_id,
            "hash": m.tokenizer.identity,
        },
        "shuffle_seed": m.shuffle_seed,
        "format_version": m.format_version,
        "created": m.created,
    }
