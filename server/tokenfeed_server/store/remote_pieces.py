"""The piece digests of a version-3 dataset in object storage, as the server reads them.

The sidecar (16 bytes per piece: 16 MB per TB of data, ~300 MB for 20 TB) is downloaded
once, in ranges of :data:`CHUNK_BYTES`, into ``<cache dir>/sidecars/`` under its
content name, checked against the manifest's ``pieces_checksum`` as it streams, and then
memory-mapped: its pages are the page cache's, shared, clean and dropped under memory
pressure, so a big dataset's digests cost the server no anonymous memory, and a global
shuffle (whose rows touch every shard) finds each digest with no request at all. (A
range GET per shard on demand would keep memory small too, but would put a request to
object storage in the path of the rows of any shard not looked at lately, and could not
check the sidecar's checksum.) A file left by an earlier run is checked again, then used.

Never on the data plane's loop: a read that needs digests not here yet raises
:class:`~tokenfeed_server.store.waiters.NotResident` like one that needs pieces; one
thread downloads the sidecar and completes the waiting requests through the piece cache.
While storage does not answer, their waiters carry a
:class:`~tokenfeed_server.store.waiters.StorageFault` (the trainer hears why it waits),
retried for ``--storage-retry-s``; past it, or for a missing or damaged sidecar, the
requests fail naming the object, and the next request tries again.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import random
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tokenfeed.errors import ManifestError, StoreError
from tokenfeed_server.store.errors import StorageExhausted
from tokenfeed_server.store.format import CHECKSUM_ALGO
from tokenfeed_server.store.piece_fetch import is_transient
from tokenfeed_server.store.piece_table import PieceDigests
from tokenfeed_server.store.waiters import NotResident, StorageFault, Waiter

if TYPE_CHECKING:
    from tokenfeed_server.store.cache import PieceCache
    from tokenfeed_server.store.manifest import Manifest
    from tokenfeed_server.store.objects import ObjectStore

__all__ = ["CHUNK_BYTES", "RemoteSidecar", "map_digests"]

log = logging.getLogger(__name__)

#: bytes per range GET of a sidecar download (the most it holds in memory at once)
CHUNK_BYTES = 8 << 20
_FIX = "re-run tokenfeed-server prepare ... --overwrite"


def map_digests(path: Path) -> PieceDigests:
    """The digests of the sidecar file at ``path``, memory-mapped read-only."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        if os.fstat(fd).st_size == 0:
            return PieceDigests(raw=b"")
        view = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)  # the mapping keeps the file
    return PieceDigests(raw=view)


class RemoteSidecar:
    """Gets the sidecar of one remote version-3 manifest into the cache directory, off
    the loop (see the module docstring). ``digests()`` is its blocking form, for tools
    and the HTTP side."""

    def __init__(
        self, manifest: Manifest, objects: ObjectStore, key: str, cache: PieceCache
    ) -> None:
        self.manifest = manifest
        self.objects = objects
        self.key = key
        self.url = objects.url(key)
        self.cache = cache
        self.size = manifest.piece_bases()[-1] * 16
        self.path = Path(cache.directory) / "sidecars" / manifest.pieces_file
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._waiters: list[Waiter] = []
        self._done = threading.Event()
        self._error: StoreError | None = None

    # -- the data plane's side (never blocks) ------------------------------------------

    def ready(self) -> bool:
        """Whether the digests are mapped; if not, their download is started."""
        if self.manifest.pieces_loaded:
            return True
        with self._lock:
            self._start()
        return False

    def park(self) -> None:
        """Raise NotResident for a read that needs the digests (the download started);
        return at once if they are here by now."""
        with self._lock:
            if self.manifest.pieces_loaded:
                return
            waiter = Waiter(())
            self._waiters.append(waiter)
            self._start()
        raise NotResident(self.cache, waiter)

    def _start(self) -> None:
        # lock held
        if self._thread is None or not self._thread.is_alive():
            self._done.clear()
            self._thread = threading.Thread(target=self._run, name="tokenfeed-sidecar", daemon=True)
            self._thread.start()

    # -- blocking ------------------------------------------------------------------------

    def digests(self) -> PieceDigests:
        """The digests, downloading them first if needed (blocking: never on the loop)."""
        with self._lock:
            if not self.manifest.pieces_loaded:
                self._start()
            thread = self._thread
        if thread is not None:
            thread.join()
        if not self.manifest.pieces_loaded:
            raise self._error or StoreError(f"{self.url}: the piece sidecar was not read")
        return self.manifest.piece_digests()

    # -- the download thread ----------------------------------------------------------

    def _run(self) -> None:
        error: StoreError | None = None
        try:
            self.manifest.set_piece_digests(self._fetch())
        except StoreError as exc:
            error = exc
        except Exception as exc:  # a bug: fail the waiting requests, keep the cause
            log.exception("cannot read the piece sidecar %s", self.url)
            error = StoreError(f"{self.url}: cannot read the piece sidecar: {exc}")
        with self._lock:
            waiters, self._waiters = self._waiters, []
            self._error = error
        if error is not None:
            log.error("%s", error)
        with self.cache.lock:
            for waiter in waiters:
                waiter.fault = None
                waiter.error = error
                self.cache._complete(waiter)  # the loop picks them up as any completed

    def _fetch(self) -> PieceDigests:
        """Map the local copy if it is intact, else download it first."""
        if self._intact(self.path):
            return map_digests(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temp = self.path.with_name(f".tmp-{os.getpid()}-{threading.get_ident()}")
        try:
            self._download(temp)
            os.replace(temp, self.path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
        return map_digests(self.path)

    def _intact(self, path: Path) -> bool:
        try:
            if path.stat().st_size != self.size:
                return False
            hasher = hashlib.blake2b(digest_size=16)
            with path.open("rb") as f:
                while chunk := f.read(CHUNK_BYTES):
                    hasher.update(chunk)
        except OSError:
            return False
        ok = f"{CHECKSUM_ALGO}:{hasher.hexdigest()}" == self.manifest.pieces_checksum
        if not ok:
            log.warning("%s does not match its manifest: downloaded again", path)
        return ok

    def _download(self, temp: Path) -> None:
        hasher = hashlib.blake2b(digest_size=16)
        with temp.open("wb") as f:
            done = 0
            while done < self.size:
                stop = min(self.size, done + CHUNK_BYTES)
                data = self._get_range(done, stop)
                if len(data) != stop - done:
                    raise ManifestError(
                        f"{self.url}: the piece sidecar object is shorter than its manifest "
                        f"needs ({self.size} bytes); {_FIX}"
                    )
                hasher.update(data)
                f.write(data)
                done = stop
            f.flush()
            os.fsync(f.fileno())
        actual = f"{CHECKSUM_ALGO}:{hasher.hexdigest()}"
        if actual != self.manifest.pieces_checksum:
            raise ManifestError(
                f"{self.url}: the piece sidecar is damaged (checksum {actual}, the "
                f"manifest says {self.manifest.pieces_checksum}); {_FIX}"
            )

    def _get_range(self, start: int, stop: int) -> bytes:
        """One range, retried while storage does not answer (the waiting requests are
        told why), for the cache's retry budget."""
        policy, rng = self.cache.retry, random.Random()
        since: float | None = None
        failures = 0
        while True:
            began = time.monotonic()
            try:
                data = self.objects.get_range(self.key, start, stop)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                since = began if since is None else since
                failures += 1
                left = policy.retry_s - (time.monotonic() - since)
                last = str(exc).removeprefix(f"{self.url}: ")
                if left <= 0:
                    raise StorageExhausted(
                        f"{self.url}: object storage did not answer for "
                        f"{time.monotonic() - since:.1f} s, the server's retry budget "
                        f"(--storage-retry-s {policy.retry_s:g}); the last error: {last}"
                    ) from exc
                self._tell(StorageFault(self.url, last, since, time.monotonic() + left))
                time.sleep(min(policy.delay(failures, rng), left))
                continue
            if since is not None:
                self._tell(None)
            return data

    def _tell(self, fault: StorageFault | None) -> None:
        with self._lock:
            for waiter in self._waiters:
                waiter.fault = fault
