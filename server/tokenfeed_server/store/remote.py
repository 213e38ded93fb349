"""Datasets in object storage: read through the piece cache with the reading API of a
local :class:`~tokenfeed_server.store.reader.Dataset`, so serving code is the same."""

from __future__ import annotations

import bisect
import itertools
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt

from tokenfeed.errors import DatasetNotFound, ManifestError, StoreError
from tokenfeed_server.store.cache_rounds import Rounds, write_rows
from tokenfeed_server.store.errors import DamagedShardObject, MissingShardObject, ObjectNotFound
from tokenfeed_server.store.format import HEADER_SIZE, MANIFEST_NAME, is_plain_file_name
from tokenfeed_server.store.manifest import Manifest
from tokenfeed_server.store.piece_table import PieceDigests
from tokenfeed_server.store.pieces import PieceList
from tokenfeed_server.store.reader import (
    Dataset,
    FileSpan,
    is_dataset_name,
    pread_exact,
    validate_dataset_name,
)
from tokenfeed_server.store.rows import read_rows
from tokenfeed_server.store.sidecar import attach_remote_pieces
from tokenfeed_server.store.versions import version_key
from tokenfeed_server.store.waiters import NotResident

if TYPE_CHECKING:
    from tokenfeed_server.store.cache import PieceCache, Waiter
    from tokenfeed_server.store.objects import ObjectStore
    from tokenfeed_server.store.remote_pieces import RemoteSidecar

__all__ = [
    "PieceList",
    "RemoteDataset",
    "list_remote_datasets",
    "open_remote_dataset",
    "read_blocking",
]


class RemoteDataset(Dataset):
    """A dataset in object storage, read through a :class:`~tokenfeed_server.store.cache.
    PieceCache`: the same reading API as :class:`Dataset`, so the serving code is the same.

    Every read first checks that the pieces it needs are in the cache; if one is not, it
    raises :class:`~tokenfeed_server.store.cache.NotResident` before reading anything (the
    missing pieces are then on their way). Reads take the cache's lock, so no piece is
    evicted while being read. Every byte read was verified against the manifest's piece
    digest when it entered the cache.
    """

    def __init__(
        self,
        name: str,
        manifest: Manifest,
        objects: ObjectStore,
        cache: PieceCache,
        sidecar: RemoteSidecar | None = None,
    ) -> None:
        super().__init__(name, Path(name), manifest)
        self.objects = objects
        self.cache = cache
        self.url = objects.url(name)
        self.piece_bytes = manifest.piece_bytes
        #: Every piece of the dataset, shard by shard, made on demand (a big dataset has
        #: millions): the global piece ids index it.
        self.pieces = PieceList(name, manifest, objects)
        self._piece_base = np.asarray(self.pieces.base, dtype=np.int64)
        self._piece_base_list = self.pieces.base
        #: Bytes of every shard file (what the whole dataset takes in a cache).
        self.nbytes = sum(self.pieces.sizes)
        #: the largest piece: the piece size, or the largest shard file when every shard
        #: is smaller than a piece (what one row can need of the cache, per piece)
        self.largest_piece = max(1, min(self.piece_bytes, max(self.pieces.sizes, default=0)))
        #: requests too big for the cache at once, read in rounds
        self.rounds = Rounds(cache.max_partial_read_bytes)
        #: version 3: where the digests come from (fetched off the loop on first need)
        self.sidecar = sidecar

    @property
    def digests(self) -> PieceDigests:
        """The digest of every piece by global id: the manifest's one accessor. Version 3:
        raises NotResident (nothing read) until the sidecar is downloaded and mapped,
        which the first read starts (off the loop: see
        :mod:`~tokenfeed_server.store.remote_pieces`)."""
        if self.sidecar is not None and not self.manifest.pieces_loaded:
            self.sidecar.park()
        return self.manifest.piece_digests()

    def digests_ready(self) -> bool:
        """Whether the digests are here (version 3: if not, their download starts):
        the prefetch plans only for datasets whose digests are."""
        return self.sidecar is None or self.sidecar.ready()

    def __repr__(self) -> str:
        return (
            f"RemoteDataset({self.url!r}, tokens={self.n_tokens}, "
            f"shards={len(self.manifest.shards)}, pieces={len(self.pieces)})"
        )

    # -- which pieces -------------------------------------------------------------------

    def piece_range(self, start: int, stop: int) -> tuple[int, int]:
        """Global piece ids ``[first, last)`` holding the tokens ``[start, stop)`` (for the
        prefetch plan; the document index at the end of a shard is not included)."""
        start, stop = max(0, int(start)), min(self.n_tokens, int(stop))
        if stop <= start:
            return 0, 0
        first = self._piece_of(start)
        last = self._piece_of(stop - 1) + 1
        return first, last

    def range_bytes(self, first: int, end: int) -> int:
        """Bytes of the pieces ``[first, end)`` as cached (a shard's last piece, or its
        only one when the shard is smaller than a piece, is shorter than
        :attr:`piece_bytes`)."""
        bases, sizes, p = self.pieces.base, self.pieces.sizes, self.piece_bytes
        total, g = 0, max(0, first)
        k = bisect.bisect_right(bases, g) - 1
        while g < end and k < len(sizes):
            hi = min(end, bases[k + 1])
            total += min((hi - bases[k]) * p, sizes[k]) - (g - bases[k]) * p
            g, k = hi, k + 1
        return total

    def _piece_of(self, token: int) -> int:
        k = int(np.searchsorted(self._bounds, token, side="right")) - 1
        offset = HEADER_SIZE + (token - self._bounds_list[k]) * self.dtype.itemsize
        return self._piece_base_list[k] + offset // self.piece_bytes

    def _span_pieces(self, k: int, offset: int, nbytes: int) -> range:
        """Global piece ids of file bytes ``[offset, offset + nbytes)`` of shard ``k``."""
        base = self._piece_base_list[k]
        p = self.piece_bytes
        return range(base + offset // p, base + (offset + nbytes - 1) // p + 1)

    # -- reads --------------------------------------------------------------------------

    def _read_file(self, buf: memoryview, k: int, offset: int, fds: dict[int, int]) -> None:
        """Fill ``buf`` from shard ``k``'s file bytes at ``offset``, piece by piece."""
        p = self.piece_bytes
        base = self._piece_base_list[k]
        done, n = 0, len(buf)
        while done < n:
            i = (offset + done) // p
            inner = offset + done - i * p
            take = min(n - done, p - inner)
            self._pread_piece(fds[base + i], buf[done : done + take], inner, base + i)
            done += take

    def _pread_piece(self, fd: int, buf: memoryview, offset: int, gid: int) -> None:
        problem = pread_exact(fd, buf, offset)
        if problem is not None:
            raise self._cache_error(gid, problem)

    def _cache_error(self, gid: int, what: str) -> StoreError:
        """The error for a cached piece that cannot be read: out of file descriptors is
        said as such; else the cache directory changed under the server. The message may
        reach trainers: it names no path (the data plane logs the cache directory)."""
        import errno

        from tokenfeed_server.store.errors import CacheOutOfDescriptors
        from tokenfeed_server.store.piece_files import OUT_OF_DESCRIPTORS

        piece = self.pieces[gid]
        if what in (os.strerror(errno.EMFILE), os.strerror(errno.ENFILE)):
            return CacheOutOfDescriptors(
                f"dataset {self.name!r}: the server cannot read the cached piece "
                f"{piece.digest} of {piece.url}: {OUT_OF_DESCRIPTORS}"
            )
        return StoreError(
            f"dataset {self.name!r}: the cached piece {piece.digest} of {piece.url} cannot "
            f"be read ({what}): something changed the server's cache directory; the "
            "operator should restart the server"
        )

    def _acquire(self, gids: Iterable[int]) -> dict[int, int]:
        """gid -> descriptor of every piece (cache lock held by the caller)."""
        ids = sorted(set(gids))
        fds = self.cache.acquire_locked(
            self.digests.take(ids), lambda: [self.pieces[g] for g in ids]
        )
        return dict(zip(ids, fds, strict=True))

    def _read_spans(self, buf: memoryview, spans: Sequence[FileSpan]) -> None:
        """Fill ``buf`` from the cache (NotResident, nothing read, if pieces are missing)."""
        with self.cache.lock:
            fds = self._acquire(g for k, off, n in spans for g in self._span_pieces(k, off, n))
            done = 0
            for k, off, n in spans:
                self._read_file(buf[done : done + n], k, off, fds)
                done += n

    def _gather(
        self,
        starts_arr: npt.NDArray[np.int64],
        length: int,
        out: np.ndarray | None,
        rows: Sequence[tuple[Any]] | None,
    ) -> None:
        """:meth:`Dataset._gather` from the cache (NotResident, nothing read, if pieces
        are missing): every row into ``rows`` when given, else into ``out``'s rows."""
        self._check_open()
        plan = self._plan_rows(starts_arr, length)
        if self.rounds.needed(self, len(plan.ids)):  # more than the cache takes at once
            write_rows(self.rounds.gather(self, starts_arr, length, self._gather_all), out, rows)
        else:
            self._gather_plan(plan, length, out, rows)

    def _gather_all(self, starts: npt.NDArray[np.int64], length: int, out: np.ndarray) -> None:
        """Every row into ``out`` at once (one round of :class:`Rounds`)."""
        self._gather_plan(self._plan_rows(starts, length), length, out, None)

    def _gather_plan(
        self,
        plan: _RowPlan,
        length: int,
        out: np.ndarray | None,
        rows: Sequence[tuple[Any]] | None,
    ) -> None:
        import errno

        row = length * self.dtype.itemsize
        with self.cache.lock:
            id_list = plan.ids.tolist()
            fd_list = self.cache.acquire_locked(
                self.digests.take(id_list), lambda: [self.pieces[g] for g in id_list]
            )
            fd_arr = np.asarray(fd_list, dtype=np.int64)
            fds_simple = fd_arr[np.searchsorted(plan.ids, plan.g0)].tolist()
            if rows is None:
                assert out is not None
                row_bufs: Iterator[Any] = zip(out)  # ndarray rows (typeshed: not buffers)
            else:
                row_bufs = iter(rows)
            if plan.simple is not None:
                row_bufs = itertools.compress(row_bufs, plan.simple.tolist())
            try:
                got = read_rows(fds_simple, row_bufs, plan.inner.tolist())
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):  # said as such, not "changed"
                    raise self._cache_error(int(plan.ids[0]), os.strerror(exc.errno)) from exc
                got = -1
            if got != len(fds_simple) * row:
                # the message may reach trainers: no path (the data plane logs the directory)
                raise StoreError(
                    f"dataset {self.name!r}: a cached piece read short; something changed "
                    "the server's cache directory: the operator should restart the server"
                )
            if plan.simple is not None:
                # Where the fast path would have put them: ``rows`` when given (maybe
                # views of anywhere), else ``out``'s rows.
                target = self._row_target(out, rows, row)
                self._read_awkward(plan, target, dict(zip(id_list, fd_list, strict=True)))

    def _plan_rows(self, starts_arr: npt.NDArray[np.int64], length: int) -> _RowPlan:
        """Which pieces the rows need, and how each row is read.

        Rows in one piece of one shard (nearly all when rows are small next to pieces)
        are read in one pread each, in C; rows across one piece boundary of one shard
        (the next most common) in two, their pieces found in bulk; the others (across a
        shard boundary, or longer than a piece) span by span.
        """
        itemsize, p = self.dtype.itemsize, self.piece_bytes
        row = length * itemsize
        if len(self._bounds_list) == 2:  # one shard: no look-up of shards needed
            first = np.zeros(len(starts_arr), dtype=np.int64)
            offsets = starts_arr * itemsize + HEADER_SIZE
            whole: Any = True
        else:
            first = np.searchsorted(self._bounds, starts_arr, side="right") - 1
            last = np.searchsorted(self._bounds, starts_arr + (length - 1), side="right") - 1
            offsets = (starts_arr - self._bounds[first]) * itemsize + HEADER_SIZE
            whole = first == last
        pieces = offsets // p
        g0 = self._piece_base[first] + pieces
        simple = whole & (pieces == (offsets + (row - 1)) // p)
        if simple.all():
            return _RowPlan(_sorted_unique(g0), g0, offsets % p)
        pair = whole & (pieces == (offsets + (row - 1)) // p - 1)
        pair_rows = np.flatnonzero(pair)
        pair_g, pair_inner = g0[pair_rows], offsets[pair_rows] % p
        pairs = list(
            zip(
                pair_rows.tolist(), pair_g.tolist(), pair_inner.tolist(),
                (p - pair_inner).tolist(), strict=True,
            )
        )  # fmt: skip
        others = np.flatnonzero(~(simple | pair)).tolist()
        needed = [g0[simple], pair_g, pair_g + 1]
        slow_spans: list[list[FileSpan]] = []
        for i in others:
            spans = list(self._file_spans(int(starts_arr[i]), row))
            slow_spans.append(spans)
            gids = [g for k, off, nb in spans for g in self._span_pieces(k, off, nb)]
            needed.append(np.asarray(gids, dtype=np.int64))
        ids = _sorted_unique(np.concatenate(needed))
        return _RowPlan(ids, g0[simple], offsets[simple] % p, simple, pairs, others, slow_spans)

    def _read_awkward(
        self, plan: _RowPlan, target: Callable[[int], memoryview], fd_of: dict[int, int]
    ) -> None:
        """Read the rows across a piece or shard boundary (cache lock held)."""
        for i, g, inner_i, cut in plan.pairs:
            buf = target(i)
            self._pread_piece(fd_of[g], buf[:cut], inner_i, g)
            self._pread_piece(fd_of[g + 1], buf[cut:], 0, g + 1)
        for i, spans in zip(plan.others, plan.slow_spans, strict=True):
            buf, done = target(i), 0
            for k, off, nb in spans:
                self._read_file(buf[done : done + nb], k, off, fd_of)
                done += nb

    def verify_checksums(self) -> None:
        """Nothing to do: every piece is verified against the manifest as it is fetched."""
        self._check_open()

    def read_extra_file(self, name: str) -> bytes:
        """One of the manifest's ``extra_files``, fetched from the bucket (blocking: for
        the HTTP side, never the data plane's loop)."""
        if name not in self.manifest.extra_files or not is_plain_file_name(name):
            raise ValueError(f"{name!r} is not one of dataset {self.name!r}'s files")
        try:
            return self.objects.get(f"{self.name}/{name}")
        except StoreError as exc:  # what a reader of a local file would see: OSError
            raise OSError(str(exc)) from exc

    def close(self) -> None:
        """Forget the dataset (the cache keeps its pieces; they are shared by builds)."""
        super().close()
        self.rounds.clear()


@dataclass
class _RowPlan:
    """How the rows of one gather are read (see :meth:`RemoteDataset._plan_rows`)."""

    ids: npt.NDArray[np.int64]  # every piece needed, sorted, unique
    g0: npt.NDArray[np.int64]  # the piece of each row read in one pread
    inner: npt.NDArray[np.int64]  # the row's offset in that piece
    simple: npt.NDArray[np.bool_] | None = None  # which rows those are (None: all)
    pairs: list[tuple[int, int, int, int]] = field(default_factory=list)  # (row, first
    # piece, offset there, bytes there) of rows across one piece boundary
    others: list[int] = field(default_factory=list)  # rows read span by span
    slow_spans: list[list[FileSpan]] = field(default_factory=list)


_T = TypeVar("_T")


def read_blocking(ds: Dataset, read: Callable[[], _T], timeout: float | None = 60.0) -> _T:
    """``read()`` (a read of ``ds``), waiting for missing pieces instead of raising
    NotResident: for tools and tests, never for the data plane's loop."""
    deadline = None if timeout is None else time.monotonic() + timeout
    held: tuple[PieceCache, Waiter] | None = None
    try:
        while True:
            try:
                return read()
            except NotResident as exc:
                # The pins of the last wait are kept until the retry has read: released
                # before, its pieces could be evicted for others again and again.
                if held is not None:
                    held[0].release(held[1])
                held = (exc.cache, exc.waiter)
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not exc.waiter.wait(left):
                    raise StoreError(
                        f"dataset {ds.name!r}: pieces did not arrive in {timeout} s"
                    ) from None
                if exc.waiter.error is not None:
                    raise exc.waiter.error from None
    finally:
        if held is not None:
            held[0].release(held[1])


def list_remote_datasets(objects: ObjectStore) -> dict[str, tuple[str, int]]:
    """``{name: (etag, size)}`` of every ``<name>/manifest.json`` in the store (a manifest
    is uploaded last, so only complete datasets are listed)."""
    found: dict[str, tuple[str, int]] = {}
    for info in objects.list():
        name, sep, rest = info.key.partition("/")
        if sep and rest == MANIFEST_NAME and is_dataset_name(name):
            found[name] = (info.etag, info.size)
    return found


def open_remote_dataset(
    objects: ObjectStore, cache: PieceCache, name: str, *, fingerprint: str | None = None
) -> RemoteDataset:
    """Open dataset ``name`` of a remote store: read and check its manifest (version 2 or
    3, with per-piece digests), and check that every shard object (and the version-3
    sidecar) exists with its size; the sidecar is fetched when a digest is first needed.

    The current version (``NAME/manifest.json``), or with ``fingerprint`` that kept version
    (``NAME/versions/<fingerprint>.json``, see :mod:`~tokenfeed_server.store.versions`):
    DatasetNotFound if it is not kept. Nothing else is read: pieces come into the cache on
    demand, verified.
    """
    validate_dataset_name(name)
    key = f"{name}/{MANIFEST_NAME}" if fingerprint is None else version_key(name, fingerprint)
    url = objects.url(key)
    try:
        text = objects.get(key)
    except ObjectNotFound:
        what = f"dataset {name!r}" if fingerprint is None else f"version {fingerprint} of {name!r}"
        raise DatasetNotFound(
            f"no {what} in store {objects.url()}; create it with "
            "tokenfeed-server prepare ... --store " + objects.url()
        ) from None
    try:
        manifest = Manifest.from_json(text)
    except ManifestError as exc:
        raise ManifestError(
            f"{url}: {exc}; re-run tokenfeed-server prepare ... --overwrite"
        ) from exc
    if manifest.format_version < 2 or not manifest.piece_bytes:
        raise ManifestError(
            f"{url}: format version {manifest.format_version} has no per-piece checksums, "
            "which serving from object storage needs; re-run tokenfeed-server prepare "
            "... --overwrite into the bucket with this tokenfeed"
        )
    if fingerprint is not None and manifest.fingerprint != fingerprint:
        raise ManifestError(
            f"{url}: holds build {manifest.fingerprint}, not the {fingerprint} its name "
            "says (written by hand?); delete it, or re-run the prepare of that build"
        )
    sizes = {info.key: info.size for info in objects.list(f"{name}/")}
    sidecar = attach_remote_pieces(manifest, objects, name, sizes, cache)
    itemsize = manifest.itemsize
    for shard in manifest.shards:
        key = f"{name}/{shard.name}"
        expected = shard.file_size(itemsize)
        size = sizes.get(key)
        if size is None:
            raise MissingShardObject(
                f"{objects.url(key)}: shard object is missing (deleted by gc or by hand?); "
                "re-run tokenfeed-server prepare ... --overwrite"
            )
        if size != expected:
            raise DamagedShardObject(
                f"{objects.url(key)}: object has {size} bytes, the manifest says {expected}; "
                "re-run tokenfeed-server prepare ... --overwrite"
            )
    return RemoteDataset(name, manifest, objects, cache, sidecar)


def _sorted_unique(a: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """``np.unique(a)`` of a small int array: a sort and a mask, a fraction of the cost
    of numpy's general path for the few hundred piece ids of a request."""
    a = np.sort(a)
    if a.size < 2:
        return a
    keep = np.empty(a.size, dtype=bool)
    keep[0] = True
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    return a[keep]
