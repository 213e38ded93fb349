"""Open shard files, bounded: one server-wide set of descriptors, least recently used closed.

A local dataset of 37,000 shards used to hold 37,000 descriptors, and a big store ran out
of them. Now a dataset keeps one descriptor, its directory's, and its shard files are
opened on demand into :data:`HANDLES`, which holds at most ``max_open_shards`` of them and
closes the least recently used one to make room: never an error for being full.

Reopening is safe because a build's files never change: ``prepare --overwrite`` publishes
a new directory and moves the old one aside with a rename, which the directory descriptor
follows. A file is reopened by name relative to that descriptor (``O_NOFOLLOW``), and must
be the very file first seen (device, inode, size recorded when the dataset was opened):
anything else (a build removed by gc, a file replaced by hand) is a clear
:class:`~tokenfeed.errors.CorruptShard`, never other data.

Reads may run on several threads (the data plane, HTTP handlers, health checks). A reader
takes the descriptors of its rows with :meth:`ShardHandles.acquire` and gives them back
with :meth:`ShardHandles.release`; a descriptor evicted meanwhile is closed only once
every reader that started before the eviction has finished (the ticks below), so no read
ever lands on a descriptor number the kernel has given to another file. Per request this
costs a few numpy operations over its rows, whatever their number: no Python per row.
"""

from __future__ import annotations

import errno
import math
import os
import resource
import stat
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from tokenfeed.errors import CorruptShard, StoreError
from tokenfeed_server.store.format import HEADER_SIZE

__all__ = [
    "DEFAULT_MAX_OPEN_SHARDS",
    "HANDLES",
    "HandleTable",
    "ShardFiles",
    "ShardHandles",
    "default_max_open_shards",
]

#: The default bound on open shard files (``--max-open-shards 0``), lowered to a quarter
#: of the process's open-file limit where that is small (the rest: sockets, directories).
DEFAULT_MAX_OPEN_SHARDS = 1024
_FLOOR = 16
_RDONLY = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_FIX = "re-run tokenfeed-server prepare ... --overwrite to rebuild the dataset"


def default_max_open_shards() -> int:
    """``min(1024, RLIMIT_NOFILE / 4)``, at least 16: what ``--max-open-shards 0`` means."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return DEFAULT_MAX_OPEN_SHARDS
    return max(_FLOOR, min(DEFAULT_MAX_OPEN_SHARDS, soft // 4))


class ShardFiles:
    """The shard files of one build, by number, opened relative to its directory.

    Holds the directory's descriptor (a duplicate of ``dir_fd``: the caller keeps its
    own) and the identity of every file, taken by :meth:`stat_all` when the dataset is
    opened; :meth:`open` returns a descriptor of file ``k`` only if it is still that file.
    """

    def __init__(
        self,
        dir_fd: int,
        path: Path,
        names: Sequence[str],
        sizes: npt.NDArray[np.int64],
        check: Callable[[int, int], None],
    ) -> None:
        self.path = path
        self.names = names
        self.sizes = sizes
        self._check = check  # (fd, k): the header of file k, raising CorruptShard
        self._ident = np.zeros((len(names), 2), dtype=np.uint64)  # st_dev, st_ino
        self._checked = np.zeros(len(names), dtype=bool)
        self.dir_fd = os.dup(dir_fd)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (opening a file then raises StoreError)."""
        return self.dir_fd < 0

    def stat_all(self) -> None:
        """Record every file's identity, and refuse a missing, linked or mis-sized one:
        one ``stat`` each through the directory, no file opened."""
        for k, name in enumerate(self.names):
            try:
                st = os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                raise CorruptShard(f"{self.path / name}: shard file is missing; {_FIX}") from None
            except OSError as exc:
                raise CorruptShard(f"{self.path / name}: cannot stat shard: {exc}; {_FIX}") from exc
            self._refuse_odd(k, st)
            self._ident[k] = (st.st_dev, st.st_ino)

    def _refuse_odd(self, k: int, st: os.stat_result) -> None:
        if stat.S_ISREG(st.st_mode) and st.st_size == self.sizes[k]:
            return  # the common case, without building a Path (150,000 shards: 0.9 s)
        path = self.path / self.names[k]
        if stat.S_ISLNK(st.st_mode):
            # prepare writes files, never links: a link may point anywhere
            raise CorruptShard(
                f"{path}: the shard is a symbolic link, which is refused (it may point out "
                f"of the store); {_FIX}"
            )
        if not stat.S_ISREG(st.st_mode):
            raise CorruptShard(f"{path}: the shard is not a regular file; {_FIX}")
        expected = int(self.sizes[k])
        if st.st_size != expected:
            if st.st_size < HEADER_SIZE:
                raise CorruptShard(f"{path}: truncated header ({st.st_size} bytes); {_FIX}")
            what = "truncated" if st.st_size < expected else "has trailing bytes"
            raise CorruptShard(
                f"{path}: file {what}: {st.st_size} bytes, expected {expected}; {_FIX}"
            )

    def open(self, k: int) -> int:
        """A new read-only descriptor of file ``k``, the same file :meth:`stat_all` saw
        (CorruptShard otherwise; StoreError once closed). The caller closes it."""
        if self.closed:
            raise StoreError(f"{self.path}: the dataset is closed")
        path = self.path / self.names[k]
        try:
            fd = os.open(self.names[k], _RDONLY | _NOFOLLOW, dir_fd=self.dir_fd)
        except FileNotFoundError:
            raise CorruptShard(
                f"{path}: shard file is gone while the dataset is served (this build was "
                "removed, by tokenfeed-server gc or by hand); reconnect to read the current "
                "build, or restore it"
            ) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CorruptShard(
                    f"{path}: the shard is a symbolic link, which is refused"
                ) from None
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise StoreError(
                    f"{path}: out of file descriptors opening a shard; lower "
                    "--max-open-shards or raise the limit (`ulimit -n`, `nofile` in "
                    "Docker/systemd)"
                ) from exc
            raise CorruptShard(f"{path}: cannot open shard: {exc}; {_FIX}") from exc
        try:
            self._verify(k, fd, path)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _verify(self, k: int, fd: int, path: Path) -> None:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != tuple(self._ident[k].tolist()):
            raise CorruptShard(
                f"{path}: another file now has this shard's name (the build the server "
                "opened was changed in place; builds are immutable): refused rather than "
                "serve other data; reconnect to read the current build"
            )
        # Same inode, so a regular file; its size is not checked again: a file damaged in
        # place (truncated) fails the reads that reach past its end, naming it, and still
        # serves the rest, as a file kept open would.
        if not self._checked[k]:
            self._check(fd, k)
            self._checked[k] = True
            # Windows are read at random: readahead would pull in pages nobody asked for.
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

    def check_all(self) -> None:
        """Open, check and close every file (its header too): what a small dataset does
        at open so that damage shows at once."""
        for k in range(len(self.names)):
            os.close(self.open(k))

    def close(self) -> None:
        """Close the directory (idempotent); open files are :class:`ShardHandles`'."""
        if self.dir_fd >= 0:
            fd, self.dir_fd = self.dir_fd, -1
            os.close(fd)


class HandleTable:
    """Files ``0..n-1`` of one reader (a dataset, or a mixture's sources one after the
    other) and which of them are open: ``slot_of[k]`` is file ``k``'s slot in
    :class:`ShardHandles`, -1 when closed."""

    def __init__(self, n: int, opener: Callable[[int], int]) -> None:
        self.slot_of = np.full(n, -1, dtype=np.int32)
        self.opener = opener
        self.released = False


class ShardHandles:
    """At most ``limit`` open shard descriptors, shared by every dataset of the server."""

    def __init__(self, limit: int | None = None) -> None:
        self._lock = threading.Lock()
        self._tick = 0  # one per acquire; a slot's _used is the tick of its last reader
        self._active: set[int] = set()  # ticks of the readers in progress
        self._deferred: list[tuple[int, int]] = []  # (evicted at tick, fd) still in use
        self.opens = 0
        self.evictions = 0
        self._resize(limit or default_max_open_shards())

    def _resize(self, limit: int) -> None:
        self.limit = limit
        self._fd = np.full(limit + 1, -1, dtype=np.int64)  # [limit]: the closed sentinel
        self._used = np.zeros(limit + 1, dtype=np.int64)
        self._file = np.zeros(limit, dtype=np.int64)
        self._table: list[HandleTable | None] = [None] * limit
        self._free = list(range(limit - 1, -1, -1))

    def configure(self, limit: int) -> None:
        """Set the bound (0: :func:`default_max_open_shards`); open files are closed."""
        with self._lock:
            for s in range(self.limit):
                if self._table[s] is not None:
                    self._evict(s, self._tick + 1)
            self._sweep()
            self._resize(limit or default_max_open_shards())

    def stats(self) -> dict[str, int]:
        """Open shard descriptors now (evicted ones still in a read included), the bound,
        and the opens and evictions since start."""
        with self._lock:
            held = self.limit - len(self._free) + len(self._deferred)
            return {
                "open": held,
                "limit": self.limit,
                "opens": self.opens,
                "evictions": self.evictions,
            }

    def acquire(self, table: HandleTable, files: npt.NDArray[np.int64]) -> tuple[list[int], int]:
        """The descriptor of each of ``files`` (at most ``limit`` distinct ones), opened
        as needed, valid until :meth:`release` of the returned ticket."""
        with self._lock:
            if table.released:
                raise StoreError("the dataset is closed")
            self._tick += 1
            tick = self._tick
            self._active.add(tick)
            try:
                slots = table.slot_of[files]
                # A closed file's slot is -1: the sentinel last entry, fd -1 (a list test
                # is cheaper than a numpy reduction on a request of a few rows).
                fds = self._fd[slots].tolist()
                if -1 in fds:
                    self._open_missing(table, files, slots, tick)
                    slots = table.slot_of[files]
                    fds = self._fd[slots].tolist()
                self._used[slots] = tick
                return fds, tick
            except BaseException:
                self._active.discard(tick)
                self._sweep()
                raise

    def release(self, tick: int) -> None:
        """The reader of ``tick`` is done with its descriptors."""
        with self._lock:
            self._active.discard(tick)
            if self._deferred:
                self._sweep()

    def _open_missing(
        self,
        table: HandleTable,
        files: npt.NDArray[np.int64],
        slots: npt.NDArray[np.int32],
        tick: int,
    ) -> None:
        self._used[slots[slots >= 0]] = tick  # this reader's open files stay
        missing = np.unique(files[slots < 0]).tolist()
        if len(missing) > self.limit:  # callers split their rows: never
            raise AssertionError(f"{len(missing)} files at once, limit {self.limit}")
        need = len(missing) - len(self._free)
        if need > 0:
            # Every other reader's slot has an older tick than this reader's: the least
            # recently used are never ours.
            used = np.where(self._fd[:-1] >= 0, self._used[:-1], np.iinfo(np.int64).max)
            for s in np.argpartition(used, need - 1)[:need].tolist():
                self._evict(s, tick)
            self._sweep()
        for k in missing:
            fd = table.opener(k)
            s = self._free.pop()
            self._fd[s], self._used[s], self._file[s] = fd, tick, k
            self._table[s] = table
            table.slot_of[k] = s
            self.opens += 1

    def _evict(self, s: int, tick: int) -> None:
        table = self._table[s]
        assert table is not None
        table.slot_of[self._file[s]] = -1
        self._table[s] = None
        self._deferred.append((tick, int(self._fd[s])))
        self._fd[s], self._used[s] = -1, 0
        self._free.append(s)
        self.evictions += 1

    def _sweep(self) -> None:
        """Close the evicted descriptors no reader can still hold: those evicted at a tick
        no later than the oldest reader in progress (a reader takes its descriptors after
        its own evictions)."""
        oldest = min(self._active, default=math.inf)
        keep = []
        for tick, fd in self._deferred:
            if tick <= oldest:
                os.close(fd)
            else:
                keep.append((tick, fd))
        self._deferred = keep

    def release_table(self, table: HandleTable, files: ShardFiles | None = None) -> None:
        """Forget ``table`` (its dataset or mixture is closed or gone): close its files
        once no read holds them, and ``files``' directory."""
        with self._lock:
            table.released = True
            for s in table.slot_of[table.slot_of >= 0].tolist():
                self._evict(s, self._tick + 1)
            self._sweep()
            if files is not None:
                files.close()  # under the lock: no open() is using the directory now

    def open_one(self, files: ShardFiles, k: int) -> int:
        """A private descriptor of ``files``' file ``k`` (the caller closes it): for a
        whole-file pass such as a checksum check, which must not churn the shared set."""
        with self._lock:
            return files.open(k)

    def open_name(self, files: ShardFiles, name: str) -> int:
        """A descriptor of file ``name`` (no link followed) in ``files``' directory."""
        with self._lock:
            if files.closed:
                raise StoreError(f"{files.path}: the dataset is closed")
            return os.open(name, _RDONLY | _NOFOLLOW, dir_fd=files.dir_fd)


#: The server's one set of open shard files (``--max-open-shards``).
HANDLES = ShardHandles()
