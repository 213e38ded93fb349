"""Check a dataset against its manifest, object by object, and repair what does not verify
(``tokenfeed-server inspect NAME --store URL --verify [--repair --source DIR]``).

Published (``s3://``): every object the manifest names is looked up (its size), then with
``pieces`` every piece of every shard object is downloaded, a few at once, and checked
against the manifest's digest, and every extra file against the hash in its
content-addressed name. Nothing stops at the first bad object: the report lists every
object missing or damaged, which is what a repair needs. Objects are content-addressed, so
uploading the right bytes again under the same key is always safe:
:class:`RepairSource` does that from a local copy of the same build (the same
fingerprint), after checking that copy against the published manifest too.

Local (a directory): :func:`verify_local` checks every shard's size and checksums (its
pieces for a version-2 dataset). A local dataset is not repaired in place: it is rebuilt
with ``prepare ... --overwrite``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from tokenfeed.errors import ConfigError, CorruptShard, ManifestError, StoreError
from tokenfeed_server.store.errors import ObjectNotFound, ObjectTruncated
from tokenfeed_server.store.format import CHECKSUM_ALGO, HEADER_SIZE, MANIFEST_NAME, piece_digest
from tokenfeed_server.store.manifest import Manifest
from tokenfeed_server.store.objects import ObjectStore
from tokenfeed_server.store.piece_table import PieceDigests, sidecar_checksum
from tokenfeed_server.store.publish import content_name
from tokenfeed_server.store.sidecar import sidecar_bytes

__all__ = [
    "DEFAULT_THREADS",
    "Finding",
    "ProgressSink",
    "RepairSource",
    "VerifyReport",
    "local_source",
    "repair_command",
    "repair_hint",
    "verify_local",
    "verify_published",
]

#: Downloads at once while verifying (and uploads while repairing).
DEFAULT_THREADS = 8
_CHUNK = 1 << 22
_NAMED_HASH = re.compile(r"-([0-9a-f]{32})(\.[^/]*)?$")


def repair_command(store_url: str, name: str) -> str:
    """What to run about missing or damaged objects of dataset ``name`` published in
    ``store_url`` (``s3://BUCKET/PREFIX``)."""
    return (
        f"repair it with tokenfeed-server inspect {name} --store {store_url} --verify "
        "--repair --source DIR (DIR: a local copy of the same build), or re-run "
        "tokenfeed-server prepare ... --overwrite with the same inputs"
    )


def repair_hint(object_url: str) -> str:
    """:func:`repair_command` for the dataset of object ``object_url``
    (``s3://BUCKET/PREFIX/NAME/OBJECT``): the text every error message that names a
    missing or damaged object ends with."""
    store_url, _, name = object_url.rsplit("/", 1)[0].rpartition("/")
    if not store_url.startswith("s3://") or not name:
        store_url, name = "s3://BUCKET/PREFIX", "NAME"
    return repair_command(store_url, name)


class ProgressSink(Protocol):
    """Where verification reports its progress, in bytes checked (called on the thread
    that called :func:`verify_published` or :func:`verify_local`)."""

    def begin(self, total_bytes: int) -> None:
        """The bytes the check will read in all."""

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more were checked."""


@dataclass(frozen=True)
class Finding:
    """One object (or local file) that does not verify."""

    #: the object's URL (a local file: its path)
    url: str
    #: the object's key relative to the store (a local file: its name)
    key: str
    kind: Literal["missing", "damaged"]
    #: what is wrong, e.g. "pieces 3, 7 (of 12) do not match their checksums"
    detail: str


@dataclass
class VerifyReport:
    """What a verification checked, and what it found."""

    objects: int = 0
    pieces: int = 0
    bytes: int = 0
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True if nothing is missing or damaged."""
        return not self.findings


@dataclass(frozen=True)
class _Object:
    """One object a published manifest names."""

    key: str
    size: int | None  # None: an extra file (the manifest does not say its size)
    pieces: tuple[str, ...] = ()  # a shard's piece digests
    digest: str | None = None  # an extra file's blake2b-128, from its name


def _published_objects(name: str, manifest: Manifest, with_pieces: bool) -> list[_Object]:
    """Every object ``manifest`` names, once each (equal shards share one object); the
    shards' piece digests only ``with_pieces`` (version 3: they are read from the
    sidecar, which must then be intact). The version-3 sidecar is checked like an extra
    file: its name carries its hash."""
    if manifest.format_version < 2 or not manifest.piece_bytes:
        raise ManifestError(
            f"dataset {name!r}: version-{manifest.format_version} manifest has no piece "
            "checksums to verify"
        )
    found: dict[str, _Object] = {}
    for k, shard in enumerate(manifest.shards):
        key = f"{name}/{shard.name}"
        if key not in found:
            pieces = manifest.shard_pieces(k) if with_pieces else ()
            found[key] = _Object(key, shard.file_size(manifest.itemsize), pieces)
    if manifest.format_version >= 3:
        key = f"{name}/{manifest.pieces_file}"
        found[key] = _Object(key, None, digest=manifest.pieces_checksum.partition(":")[2])
    for extra in manifest.extra_files:
        match = _NAMED_HASH.search(extra)
        key = f"{name}/{extra}"
        found.setdefault(key, _Object(key, None, digest=match.group(1) if match else None))
    return list(found.values())


def verify_published(
    store: ObjectStore,
    name: str,
    manifest: Manifest,
    *,
    pieces: bool = False,
    keys: set[str] | None = None,
    threads: int = DEFAULT_THREADS,
    progress: ProgressSink | None = None,
) -> VerifyReport:
    """Check every object ``manifest`` names (or only ``keys``): present with its size
    and, with ``pieces``, every piece against its digest (downloads the whole dataset,
    ``threads`` requests at once). Every object that does not verify is in the report's
    findings; a request that fails otherwise (storage down) raises its ObjectStoreError.
    """
    sidecar: Finding | None = None
    if pieces and manifest.format_version >= 3:
        try:
            manifest.piece_digests()
        except ManifestError as exc:  # shards then checked for presence and size only
            key = f"{name}/{manifest.pieces_file}"
            sidecar = _finding(store, key, "damaged", str(exc))
    with_pieces = pieces and sidecar is None
    objects = [
        o
        for o in _published_objects(name, manifest, with_pieces)
        if (keys is None or o.key in keys) and (sidecar is None or o.key != sidecar.key)
    ]
    report = VerifyReport(objects=len(objects) + (sidecar is not None))
    if sidecar is not None:
        report.findings.append(sidecar)
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="tokenfeed-verify") as pool:
        sizes = list(pool.map(lambda o: store.head(o.key), objects))
        present: list[tuple[_Object, int]] = []
        for obj, info in zip(objects, sizes, strict=True):
            if info is None:
                report.findings.append(_finding(store, obj.key, "missing", "not in the bucket"))
            elif obj.size is not None and info.size != obj.size:
                detail = f"{info.size:,} bytes, the manifest says {obj.size:,}"
                report.findings.append(_finding(store, obj.key, "damaged", detail))
            else:
                present.append((obj, info.size))
        if pieces:
            _check_contents(
                store, present, piece_bytes=manifest.piece_bytes, pool=pool, threads=threads,
                report=report, progress=progress,
            )  # fmt: skip
    report.findings.sort(key=lambda f: f.key)
    return report


def _finding(
    store: ObjectStore, key: str, kind: Literal["missing", "damaged"], detail: str
) -> Finding:
    return Finding(store.url(key), key, kind, detail)


# (object, piece index or -1 for a whole extra file, its size)
_Task = tuple[_Object, int, int]


def _tasks(present: Sequence[tuple[_Object, int]], piece_bytes: int) -> Iterator[_Task]:
    for obj, size in present:
        if obj.size is None:
            yield obj, -1, size
            continue
        for i in range(len(obj.pieces)):
            yield obj, i, min(piece_bytes, size - i * piece_bytes)


def _check_contents(
    store: ObjectStore,
    present: Sequence[tuple[_Object, int]],
    *,
    piece_bytes: int,
    pool: ThreadPoolExecutor,
    threads: int,
    report: VerifyReport,
    progress: ProgressSink | None,
) -> None:
    """Download and check every piece of ``present`` (extra files whole), a bounded
    number in flight; fold the results into ``report``."""
    if progress is not None:
        progress.begin(sum(size for _, size in present))
    bad: dict[str, list[int]] = {}  # key -> bad pieces (-1: the whole extra file)
    gone: set[str] = set()
    inflight: set[Future[tuple[_Task, str | None]]] = set()

    def settle(done: set[Future[tuple[_Task, str | None]]]) -> None:
        for future in done:
            (obj, index, nbytes), problem = future.result()
            report.pieces += index >= 0
            report.bytes += nbytes
            if problem == "missing":
                gone.add(obj.key)
            elif problem is not None:
                bad.setdefault(obj.key, []).append(index)
            if progress is not None:
                progress.advance(nbytes)

    try:
        for task in _tasks(present, piece_bytes):
            if len(inflight) >= 4 * threads:
                done, inflight = wait(inflight, return_when=FIRST_COMPLETED)
                settle(done)
            inflight.add(pool.submit(_check_one, store, piece_bytes, task))
        settle(wait(inflight).done)
    except BaseException:
        for future in inflight:
            future.cancel()
        raise
    _report_contents(store, present, bad, gone, report)


def _check_one(store: ObjectStore, piece_bytes: int, task: _Task) -> tuple[_Task, str | None]:
    """One piece (or extra file): None if it matches, else "missing" or "damaged"."""
    obj, index, nbytes = task
    start = max(index, 0) * piece_bytes
    try:
        data = store.get_range(obj.key, start, start + nbytes)
    except ObjectNotFound:
        return task, "missing"  # deleted since its lookup
    except ObjectTruncated:
        return task, "damaged"  # replaced by a shorter object since its lookup
    if index < 0:
        digest = hashlib.blake2b(data, digest_size=16).hexdigest()
        return task, None if obj.digest is None or digest == obj.digest else "damaged"
    return task, None if piece_digest(data) == obj.pieces[index] else "damaged"


def _report_contents(
    store: ObjectStore,
    present: Sequence[tuple[_Object, int]],
    bad: dict[str, list[int]],
    gone: set[str],
    report: VerifyReport,
) -> None:
    for obj, _ in present:
        if obj.key in gone:
            report.findings.append(_finding(store, obj.key, "missing", "deleted while checked"))
        elif obj.key in bad and obj.size is None:
            detail = "its bytes do not match the hash in its name"
            report.findings.append(_finding(store, obj.key, "damaged", detail))
        elif obj.key in bad:
            report.findings.append(
                _finding(store, obj.key, "damaged", _bad_pieces(bad[obj.key], len(obj.pieces)))
            )


def _bad_pieces(indices: list[int], count: int) -> str:
    shown = ", ".join(map(str, sorted(indices)[:10]))
    more = f", ... ({len(indices)} in all)" if len(indices) > 10 else ""
    word = "piece" if len(indices) == 1 else "pieces"
    verb = "does" if len(indices) == 1 else "do"
    return f"{word} {shown}{more} (of {count}) {verb} not match the manifest's checksums"


# ---------------------------------------------------------------------------- repair


def local_source(source: Path, name: str) -> Path:
    """The dataset directory ``--source`` names: ``DIR`` itself when it holds a manifest,
    else ``DIR/NAME`` (``DIR`` a local store); ConfigError naming both otherwise."""
    for candidate in (source, source / name):
        if (candidate / MANIFEST_NAME).is_file():
            return candidate
    raise ConfigError(
        f"--source {source}: neither {source / MANIFEST_NAME} nor "
        f"{source / name / MANIFEST_NAME} exists; give the local dataset directory (or the "
        f"local store holding {name!r}) the dataset was published from"
    )


class RepairSource:
    """A local copy of a published build that objects can be uploaded again from.

    Made before anything is downloaded, so that a wrong ``--source`` is refused at once:
    ConfigError for a directory without a manifest or with another build's (another
    fingerprint).
    """

    def __init__(self, source: Path, name: str, manifest: Manifest, store_url: str) -> None:
        self.name = name
        self.manifest = manifest
        self.directory = local_source(source, name)
        local = Manifest.from_json((self.directory / MANIFEST_NAME).read_bytes())
        if local.fingerprint != manifest.fingerprint:
            raise ConfigError(
                f"--source {self.directory} holds build {local.fingerprint}, but {store_url} "
                f"is build {manifest.fingerprint}: a repair needs a local copy of the same "
                "build (else re-run tokenfeed-server prepare ... --overwrite with the "
                "inputs of the published build)"
            )
        self.files = _local_files(name, manifest, local, self.directory)

    def upload(
        self,
        store: ObjectStore,
        findings: Sequence[Finding],
        *,
        threads: int = DEFAULT_THREADS,
        on_upload: Callable[[str, int], None] | None = None,
    ) -> list[str]:
        """Upload again every object of ``findings`` from this copy; returns their keys.
        Each local file is checked against the published manifest first (CorruptShard if
        it is damaged too: uploading it would spread the damage)."""
        keys = sorted({f.key for f in findings})
        lacking = [key for key in keys if key not in self.files]
        if lacking:
            raise StoreError(
                f"--source {self.directory} has no file for "
                f"{', '.join(store.url(k) for k in lacking)}"
            )
        for key in keys:
            _check_local_copy(self.files[key], self.manifest, key, self.name)

        def upload(key: str) -> str:
            path = self.files[key][0]
            store.put_file(key, path)
            if on_upload is not None:
                on_upload(key, path.stat().st_size)
            return key

        workers = max(1, min(threads, 4))
        with ThreadPoolExecutor(workers, thread_name_prefix="tokenfeed-repair") as pool:
            return list(pool.map(upload, keys))


# key -> (local file, its shard's piece digests; () for an extra file)
_LocalFiles = dict[str, tuple[Path, tuple[str, ...]]]


def _local_files(name: str, manifest: Manifest, local: Manifest, local_dir: Path) -> _LocalFiles:
    """Which local file holds each published object: the same build has the same shards
    in the same order (each is checked piece by piece before it is uploaded); an extra
    file is found by the content name its bytes give."""
    files: _LocalFiles = {}
    for k, (mine, theirs) in enumerate(zip(local.shards, manifest.shards, strict=True)):
        key = f"{name}/{theirs.name}"
        if key not in files:
            files[key] = (local_dir / mine.name, manifest.shard_pieces(k))
    if local.format_version >= 3 and manifest.format_version >= 3:
        sidecar = local_dir / local.pieces_file
        files.setdefault(f"{name}/{manifest.pieces_file}", (sidecar, ()))
    for extra in local.extra_files:
        path = local_dir / extra
        if path.is_file():
            files.setdefault(f"{name}/{content_name(extra, path)}", (path, ()))
    return files


def _check_local_copy(
    entry: tuple[Path, tuple[str, ...]], manifest: Manifest, key: str, name: str
) -> None:
    """The local file matches the published manifest piece by piece (an extra file is
    found by its content name, which is its hash): else it would spread the damage."""
    path, pieces = entry
    if not pieces:
        return
    count = 0
    for i, data in enumerate(_read_pieces(path, manifest.piece_bytes)):
        count += 1
        if i >= len(pieces) or piece_digest(data) != pieces[i]:
            break
    else:
        if count == len(pieces):
            return
    raise CorruptShard(
        f"{path}: the local copy does not match {key!r} of the published manifest either "
        f"(piece {count - 1}); rebuild {name!r} with tokenfeed-server prepare ... --overwrite"
    )


def _read_pieces(path: Path, piece_bytes: int) -> Iterator[bytes]:
    with path.open("rb") as f:
        while data := f.read(piece_bytes):
            yield data


# ---------------------------------------------------------------------------- local


def verify_local(
    dataset_dir: Path,
    manifest: Manifest,
    *,
    checksums: bool = True,
    progress: ProgressSink | None = None,
) -> VerifyReport:
    """Check every shard of the local dataset in ``dataset_dir``: present with its exact
    size and, with ``checksums``, its bytes (piece digests for a version-2 dataset, the
    shard checksum for version 1) and the tokenizer file's hash. Lists every finding."""
    report = VerifyReport(objects=len(manifest.shards) + len(manifest.extra_files))
    digests = _local_sidecar(dataset_dir, manifest, report, checksums)
    bases = manifest.piece_bases()
    readable: list[tuple[Path, int, tuple[str, ...], str]] = []
    for k, shard in enumerate(manifest.shards):
        path = dataset_dir / shard.name
        size = shard.file_size(manifest.itemsize)
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            report.findings.append(Finding(str(path), shard.name, "missing", "no such file"))
            continue
        if actual != size:
            detail = f"{actual:,} bytes, the manifest says {size:,}"
            report.findings.append(Finding(str(path), shard.name, "damaged", detail))
            continue
        # version 3 with a bad sidecar: the whole-shard checksum instead of the pieces
        pieces = shard.pieces if digests is None else tuple(digests[bases[k] : bases[k + 1]])
        readable.append((path, size, pieces, shard.checksum))
    for extra in manifest.extra_files:
        if not (dataset_dir / extra).is_file():
            report.findings.append(
                Finding(str(dataset_dir / extra), extra, "missing", "no such file")
            )
    if checksums:
        if progress is not None:
            progress.begin(sum(size for _, size, _, _ in readable))
        for path, _, pieces, checksum in readable:
            problem = _local_problem(
                path, checksum, piece_bytes=manifest.piece_bytes, pieces=pieces, report=report,
                progress=progress,
            )  # fmt: skip
            if problem is not None:
                report.findings.append(Finding(str(path), path.name, "damaged", problem))
        _check_tokenizer_file(dataset_dir, manifest, report)
    report.findings.sort(key=lambda f: f.key)
    return report


def _local_sidecar(
    dataset_dir: Path, manifest: Manifest, report: VerifyReport, checksums: bool
) -> PieceDigests | None:
    """A version-3 dataset's sidecar: present with its size, and (``checksums``) read and
    checked; its digests, or None (a finding says why) and the shards are checked by
    their whole checksums."""
    if manifest.format_version < 3:
        return None
    report.objects += 1
    path = dataset_dir / manifest.pieces_file
    want = sidecar_bytes(manifest)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        report.findings.append(Finding(str(path), path.name, "missing", "no such file"))
        return None
    if size != want:
        detail = f"{size:,} bytes, the manifest says {want:,}"
        report.findings.append(Finding(str(path), path.name, "damaged", detail))
        return None
    if not checksums:
        return None
    raw = path.read_bytes()
    actual = sidecar_checksum(raw)
    if actual != manifest.pieces_checksum:
        detail = f"checksum mismatch ({actual} != manifest {manifest.pieces_checksum})"
        report.findings.append(Finding(str(path), path.name, "damaged", detail))
        return None
    return PieceDigests(raw=raw)


def _local_problem(
    path: Path,
    checksum: str,
    *,
    piece_bytes: int,
    pieces: tuple[str, ...],
    report: VerifyReport,
    progress: ProgressSink | None,
) -> str | None:
    """What is wrong with the bytes of local shard ``path``, or None."""
    bad: list[int] = []
    whole = hashlib.blake2b(digest_size=16)
    step = piece_bytes if pieces else _CHUNK
    offset = 0
    for i, data in enumerate(_read_pieces(path, step)):
        if pieces:
            report.pieces += 1
            if i >= len(pieces) or piece_digest(data) != pieces[i]:
                bad.append(i)
        else:
            whole.update(data[max(0, HEADER_SIZE - offset) :])
        offset += len(data)
        report.bytes += len(data)
        if progress is not None:
            progress.advance(len(data))
    if pieces:
        return _bad_pieces(bad, len(pieces)) if bad else None
    algo, _, expected = checksum.partition(":")
    if algo != CHECKSUM_ALGO or whole.hexdigest() != expected:
        return f"checksum mismatch ({algo} {whole.hexdigest()} != manifest {expected})"
    return None


def _check_tokenizer_file(dataset_dir: Path, manifest: Manifest, report: VerifyReport) -> None:
    info = manifest.tokenizer
    if info.file is None or info.file_hash is None:
        return
    path = dataset_dir / info.file
    if not path.is_file():
        return  # listed as missing already
    actual = "blake2b-128:" + hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()
    if actual != info.file_hash:
        detail = f"{actual} != tokenizer.file_hash {info.file_hash}"
        report.findings.append(Finding(str(path), info.file, "damaged", detail))
