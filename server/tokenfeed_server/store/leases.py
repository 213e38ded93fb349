"""Leases: each server's record, in the store, of the dataset versions its jobs hold.

``gc`` must never delete what a running job reads, and only the servers know which
versions their jobs read. So each server (:class:`LeaseKeeper`) keeps one small object,
``_tokenfeed/leases/<server-id>.json`` (a file under ``STORE/_tokenfeed/leases/`` for a
local store, written to a temp file and renamed so a reader never sees half of it)::

    {"server": "9f0c...", "host": "gpu-7", "pid": 4242, "written": 1718000000.0,
     "expires": 1718000600.0, "held": {"web": ["<fingerprint>", ...], ...}}

``held`` lists every (dataset, fingerprint) a job of that server reads, mixture sources
included, and every version it has open (the current ones, one a resume is opening).
The lease is rewritten every ``lease_s / 3`` seconds (so two refreshes may fail before it
lapses) and within about a second of the held set changing; it is deleted when the
server stops cleanly. A server that dies stops refreshing, and its lease expires
``lease_s`` after its last write: gc then ignores it (and deletes it). The server id is
random per process start (the one ``/v1/status`` shows), so a restarted server never
extends a dead one's lease.

Writing a lease is the only write ``serve`` makes to the store: its credentials need
write (and delete) access to ``_tokenfeed/leases/`` only. A server started with
``--read-only-store`` writes none; gc then protects its jobs' versions by ``--grace``
alone. A failed write is logged (at most once a minute) and retried with backoff, never
fatal: gc still sees the last lease written until it expires.

Expiry is judged on both clocks, conservatively: a lease is valid until its own
``expires`` (the server's clock) or until its object's last-modified time (the store's
clock) plus its lifetime, whichever is later, so a server clock running behind cannot
make gc delete early. (gc compares with its own clock: keep the hosts' clocks in sync,
as S3's request signing requires anyway.)
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenfeed.errors import StoreError
from tokenfeed_server.store.errors import ObjectNotFound
from tokenfeed_server.store.reader import is_dataset_name
from tokenfeed_server.store.versions import RESERVED_PREFIX, is_fingerprint

if TYPE_CHECKING:
    from tokenfeed_server.store.objects import ObjectStore

__all__ = [
    "LEASES_PREFIX",
    "HeldVersions",
    "Lease",
    "LeaseKeeper",
    "LeaseScan",
    "delete_lease",
    "encode_lease",
    "lease_key",
    "new_server_id",
    "parse_lease",
    "read_leases",
    "write_lease",
]

log = logging.getLogger(__name__)

#: Where leases live, relative to the store (a key prefix, or a directory).
LEASES_PREFIX = f"{RESERVED_PREFIX}/leases"
#: ``{dataset name: fingerprints}``: the versions one server's jobs read.
HeldVersions = Mapping[str, Iterable[str]]

_POLL_S = 0.25  # how often the keeper looks at the held set (a change is written at once)
_FIRST_RETRY_S = 1.0
_LOG_EVERY_S = 60.0
_STORE_TIME_RESOLUTION_S = 1.0  # S3's Last-Modified is in whole seconds


def new_server_id() -> str:
    """A random id for one server process (a restart gets a new one)."""
    return uuid.uuid4().hex


def lease_key(server_id: str) -> str:
    """``_tokenfeed/leases/<server-id>.json``, relative to the store."""
    return f"{LEASES_PREFIX}/{server_id}.json"


@dataclass(frozen=True)
class Lease:
    """One server's lease as gc reads it.

    ``where``: its key (remote) or path (local); ``stamp``: its ETag or mtime, to tell
    whether it changed since it was read; ``modified``: the store's time of the write.
    """

    server: str
    host: str
    pid: int
    written: float
    expires: float
    held: dict[str, frozenset[str]]
    where: str
    stamp: str
    modified: float

    @property
    def valid_until(self) -> float:
        """Unix time after which the lease no longer protects anything (see the module
        docstring: the later of the server's and the store's clock; S3 gives times in
        whole seconds, so a second is added to the store's)."""
        lifetime = max(0.0, self.expires - self.written)
        return max(self.expires, self.modified + _STORE_TIME_RESOLUTION_S + lifetime)

    def expired(self, now: float) -> bool:
        """True once the lease lapsed: its server stopped refreshing it."""
        return now >= self.valid_until

    def holds(self, name: str, fingerprint: str) -> bool:
        """True if a job of this server reads version ``fingerprint`` of ``name``."""
        return fingerprint in self.held.get(name, frozenset())

    def describe(self) -> str:
        """``server ID (HOST, pid PID)``, for gc's report."""
        return f"server {self.server} ({self.host}, pid {self.pid})"


def encode_lease(server_id: str, held: HeldVersions, *, lease_s: float, now: float) -> bytes:
    """The JSON of a lease written at ``now``, valid for ``lease_s`` seconds."""
    body: dict[str, Any] = {
        "server": server_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "written": now,
        "expires": now + lease_s,
        "held": {name: sorted(set(fps)) for name, fps in sorted(held.items()) if fps},
    }
    return json.dumps(body, indent=1).encode()


def parse_lease(data: bytes, *, where: str, stamp: str, modified: float) -> Lease | None:
    """The lease in ``data``; None when it is not one (gc cannot honour what it cannot
    read, and says so). Entries that are no dataset name or no fingerprint are dropped:
    they can name nothing gc would delete."""
    try:
        raw = json.loads(data)
        held_raw = raw["held"]
        held = {
            str(name): frozenset(fp for fp in fps if is_fingerprint(fp))
            for name, fps in held_raw.items()
            if is_dataset_name(str(name)) and isinstance(fps, list)
        }
        return Lease(
            server=str(raw["server"]),
            host=str(raw.get("host", "?")),
            pid=int(raw.get("pid", 0)),
            written=float(raw["written"]),
            expires=float(raw["expires"]),
            held=held,
            where=where,
            stamp=stamp,
            modified=modified,
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


@dataclass
class LeaseScan:
    """Every lease in a store: the readable ones, and where the unreadable ones are."""

    leases: list[Lease] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)

    def valid(self, now: float) -> list[Lease]:
        """The leases that still protect what they hold at ``now``."""
        return [lease for lease in self.leases if not lease.expired(now)]

    def expired(self, now: float) -> list[Lease]:
        """The lapsed leases (their servers died without a clean stop)."""
        return [lease for lease in self.leases if lease.expired(now)]


def read_leases(store: Path | ObjectStore) -> LeaseScan:
    """Every lease of ``store`` (a local directory or an object store), expired included.

    A lease deleted between the listing and its read (its server stopped) is skipped.
    """
    scan = LeaseScan()
    if isinstance(store, Path):
        root = store / LEASES_PREFIX
        paths = sorted(root.glob("*.json")) if root.is_dir() else []
        for path in paths:
            if path.name.startswith("."):
                continue  # a keeper's temp file
            try:
                data, st = path.read_bytes(), path.stat()
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise StoreError(f"cannot read the lease {path}: {exc}") from exc
            _add(scan, data, str(path), str(st.st_mtime_ns), st.st_mtime)
        return scan
    for info in store.list(f"{LEASES_PREFIX}/"):
        if not info.key.endswith(".json"):
            continue
        try:
            data = store.get(info.key)
        except ObjectNotFound:
            continue
        _add(scan, data, info.key, info.etag, info.modified.timestamp())
    return scan


def _add(scan: LeaseScan, data: bytes, where: str, stamp: str, modified: float) -> None:
    lease = parse_lease(data, where=where, stamp=stamp, modified=modified)
    if lease is None:
        scan.unreadable.append(where)
    else:
        scan.leases.append(lease)


def delete_lease(store: Path | ObjectStore, where: str) -> None:
    """Delete the lease at ``where`` (a path of a local store, else a key); absent is fine."""
    if isinstance(store, Path):
        Path(where).unlink(missing_ok=True)
    else:
        store.delete([where])


def write_lease(store: Path | ObjectStore, server_id: str, body: bytes) -> None:
    """Write a lease: one PUT (S3 makes it visible whole), or temp file + rename."""
    if not isinstance(store, Path):
        store.put_bytes(lease_key(server_id), body)
        return
    root = store / LEASES_PREFIX
    root.mkdir(parents=True, exist_ok=True)
    temp = root / f".{server_id}.json.tmp"
    with temp.open("wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, root / f"{server_id}.json")


class LeaseKeeper:
    """Keeps this server's lease current in a thread of its own.

    ``start(held)`` begins: ``held()`` returns the versions the jobs read now (called
    from the keeper's thread; it must be safe there, e.g. read a snapshot the data plane
    publishes). ``stop()`` ends the thread and deletes the lease (a no-op if never
    started).
    """

    def __init__(
        self, store: Path | ObjectStore, *, lease_s: float, server_id: str | None = None
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.store = store
        self.lease_s = lease_s
        self.server_id = server_id or new_server_id()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def where(self) -> str:
        """The lease's key (remote) or path (local)."""
        key = lease_key(self.server_id)
        return str(self.store / key) if isinstance(self.store, Path) else key

    def start(
        self, held: Callable[[], HeldVersions], *, server_id: str | None = None
    ) -> LeaseKeeper:
        """Start the thread; the first lease is written at once. ``server_id``: the id
        to write under (the server's own, as its status shows it), else the one made."""
        if server_id is not None:
            self.server_id = server_id
        self._thread = threading.Thread(
            target=self._run, args=(held,), name="tokenfeed-lease", daemon=True
        )
        self._thread.start()
        log.info(
            "lease %s: the versions this server's jobs read, valid %.0f s, refreshed every %.0f s",
            self.where,
            self.lease_s,
            self.lease_s / 3,
        )
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop refreshing and delete the lease (it would expire by itself anyway)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout)
        self._thread = None
        try:
            delete_lease(self.store, self.where)
        except Exception as exc:  # a cleanup step: the server stops cleanly regardless
            log.warning("could not delete the lease %s (it expires by itself): %s", self.where, exc)

    def _run(self, held: Callable[[], HeldVersions]) -> None:
        last: frozenset[tuple[str, str]] | None = None
        due = 0.0  # monotonic time of the next refresh
        retry_s = _FIRST_RETRY_S
        failing_since: float | None = None
        logged = -_LOG_EVERY_S
        while True:
            now = time.monotonic()
            current = _pairs(held, last)
            if current != last or now >= due:
                try:
                    self._write(current)
                except Exception as exc:  # never fatal: retried, gc sees the last lease
                    failing_since = failing_since if failing_since is not None else now
                    if now - logged >= _LOG_EVERY_S:
                        logged = now
                        log.warning("lease %s: write failed, retrying: %s", self.where, exc)
                    due, retry_s = now + retry_s, min(retry_s * 2, self.lease_s / 3)
                    last = current  # retried when due, not every poll
                else:
                    if failing_since is not None:
                        gap = now - failing_since
                        log.info("lease %s: written again after %.0f s", self.where, gap)
                    last, due = current, now + self.lease_s / 3
                    retry_s, failing_since = _FIRST_RETRY_S, None
            if self._stop.wait(_POLL_S):
                return

    def _write(self, pairs: frozenset[tuple[str, str]]) -> None:
        held: dict[str, set[str]] = {}
        for name, fingerprint in pairs:
            held.setdefault(name, set()).add(fingerprint)
        body = encode_lease(self.server_id, held, lease_s=self.lease_s, now=time.time())
        write_lease(self.store, self.server_id, body)


def _pairs(
    held: Callable[[], HeldVersions], last: frozenset[tuple[str, str]] | None
) -> frozenset[tuple[str, str]]:
    """The held set as (name, fingerprint) pairs. When ``held`` fails (a bug), the last
    set is kept: dropping versions from the lease could let gc delete what jobs read."""
    try:
        return frozenset((name, fp) for name, fps in held().items() for fp in fps)
    except Exception:  # a bug in the snapshot must not stop the lease
        log.exception("lease: could not read the versions the jobs hold")
        return last if last is not None else frozenset()
