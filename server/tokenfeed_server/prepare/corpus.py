"""Reading a raw corpus: files and directories in, document texts out.

* ``.jsonl`` / ``.ndjson``: one document per line, the text in a field (``text`` by
  default); blank lines are skipped.
* ``.parquet``: one document per row of a string column (needs pyarrow).
* any other file named explicitly (``.txt``, ``.md``, ``.py`` ...): the whole file is one
  document.
* ``.gz`` / ``.zst`` forms of all of these are decompressed on the fly.
* directories are walked in sorted order; there only known text suffixes are taken
  (``.txt .text .md .rst .jsonl .ndjson .parquet`` and compressed forms), hidden entries
  are skipped.
* ``s3://BUCKET/PREFIX`` inputs (``prepare`` only) are downloaded first into a scratch
  directory, mirroring their keys, and read from there as above: a prefix as a
  directory (only the objects a walk would take are downloaded), a key as a file. The
  documents' identities (paths relative to the inputs' root) and so the order are those
  of the same files on local disk.

Bad input (unreadable file, corrupt compression, a line that is not JSON, lacks the field
or is not a string, bytes that are not UTF-8, a lone surrogate escape such as
``"\\udc80"``) raises :class:`BadRecord` naming the file and line; with ``skip_bad`` it
is logged, counted in :class:`CorpusStats` and skipped.
Empty documents are skipped and counted.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeAlias

from tokenfeed.errors import BadRecord, PrepareError

__all__ = [
    "MAX_LOGGED_BAD",
    "CorpusStats",
    "count_bad",
    "estimate_text_bytes",
    "expand_inputs",
    "iter_documents",
    "iter_file_records",
    "iter_records",
    "walked",
]

log = logging.getLogger(__name__)

_COMPRESSED = (".gz", ".zst")
_JSONL = (".jsonl", ".ndjson")
_WALKED = (".txt", ".text", ".md", ".rst", *_JSONL, ".parquet")
MAX_LOGGED_BAD = 20
_SURROGATE = re.compile(r"[\ud800-\udfff]")


@dataclass
class CorpusStats:
    """Counts filled in while reading."""

    files: int = 0
    documents: int = 0
    text_bytes: int = 0
    bad_records: int = 0
    empty_documents: int = 0


def _base_suffix(path: Path) -> str:
    """The format suffix under any compression suffix: a.jsonl.gz -> .jsonl."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSED:
        suffixes.pop()
    return suffixes[-1] if suffixes else ""


def expand_inputs(inputs: Sequence[os.PathLike[str] | str]) -> list[Path]:
    """Resolve input files and directories into the ordered list of files to read.

    A directory contributes only the files of a known text suffix (see the module
    doc); the others are not read, and a warning names how many of each suffix were
    left out, so a code corpus of ``.py`` files does not vanish silently: name such
    files explicitly (a file given by name is always read, as one document).
    """
    files: list[Path] = []
    for raw in inputs:
        path = Path(raw)
        if path.is_dir():
            skipped: dict[str, int] = {}
            files += _walk(path, skipped)
            if skipped:
                log.warning("%s", skipped_message(path, skipped))
        elif path.exists():
            files.append(path)
        else:
            raise PrepareError(f"input {path} does not exist")
    return files


def _walk(directory: Path, skipped: dict[str, int]) -> list[Path]:
    """The files a walk of ``directory`` reads, in order; counts the others by suffix."""
    found: list[Path] = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            child = Path(root) / name
            if name.startswith("."):
                continue
            suffix = _base_suffix(child)
            if suffix in _WALKED:
                found.append(child)
            else:
                skipped[suffix or "(none)"] = skipped.get(suffix or "(none)", 0) + 1
    return found


def skipped_message(directory: Path, skipped: dict[str, int]) -> str:
    """The warning for files of unknown suffixes left out of a directory walk."""
    counts = ", ".join(f"{s} ({n})" for s, n in sorted(skipped.items(), key=lambda i: -i[1]))
    return (
        f"{directory}: {sum(skipped.values())} file(s) not read, of suffixes {counts}: a "
        f"directory contributes only {' '.join(_WALKED)} files (and their .gz/.zst forms); "
        "name other files explicitly to read each as one document"
    )


def walked(relpath: str) -> bool:
    """True if walking a directory takes the file at ``relpath`` (POSIX, relative to the
    directory): no hidden component, a known text suffix. :func:`expand_inputs` takes
    exactly these, so a prefix in object storage is filtered the same way before download.
    """
    parts = relpath.split("/")
    if any(not part or part.startswith(".") for part in parts):
        return False
    return _base_suffix(Path(parts[-1])) in _WALKED


def estimate_text_bytes(files: Sequence[Path]) -> int:
    """A rough upper estimate of the corpus text size (compressed files count 5x)."""
    total = 0
    for path in files:
        try:
            size = path.stat().st_size
        except OSError:
            continue
        compressed = path.suffix.lower() in _COMPRESSED or _base_suffix(path) == ".parquet"
        total += size * 5 if compressed else size
    return total


def _open_binary(path: Path) -> IO[bytes]:
    suffix = path.suffix.lower()
    if suffix == ".gz":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if suffix == ".zst":
        import zstandard

        raw = path.open("rb")
        reader = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)
        return io.BufferedReader(reader)
    return path.open("rb")


def iter_documents(
    files: Sequence[Path],
    *,
    text_field: str = "text",
    skip_bad: bool = False,
    stats: CorpusStats | None = None,
) -> Iterator[str]:
    """Yield every non-empty document text of ``files`` in order."""
    for _, _, text in iter_records(files, text_field=text_field, skip_bad=skip_bad, stats=stats):
        yield text


def iter_records(
    files: Sequence[Path],
    *,
    text_field: str = "text",
    skip_bad: bool = False,
    stats: CorpusStats | None = None,
) -> Iterator[tuple[int, int, str]]:
    """Yield ``(file index, record number, text)`` for every non-empty document, in order.

    A bad record raises its BadRecord, or with ``skip_bad`` is logged (the first few),
    counted and skipped; empty documents are counted and skipped. Either keeps its record
    number, so the records after it keep theirs.
    """
    stats = stats if stats is not None else CorpusStats()
    for index, path in enumerate(files):
        stats.files += 1
        for record, item in iter_file_records(path, text_field=text_field):
            if isinstance(item, BadRecord):
                count_bad(item, skip_bad=skip_bad, stats=stats)
                continue
            if not item:
                stats.empty_documents += 1
                continue
            stats.documents += 1
            stats.text_bytes += len(item)
            yield index, record, item


def count_bad(bad: BadRecord, *, skip_bad: bool, stats: CorpusStats) -> None:
    """Raise ``bad``, or with ``skip_bad`` count it (and log the first few)."""
    if not skip_bad:
        raise bad
    stats.bad_records += 1
    if stats.bad_records <= MAX_LOGGED_BAD:
        # The record's message advises --skip-bad, which is what is running now.
        log.warning("skipped bad record: %s", str(bad).removesuffix(_SKIP_HINT))
        if stats.bad_records == MAX_LOGGED_BAD:
            log.warning("further bad records are skipped without a line each (counted)")


def iter_file_records(
    path: Path, *, text_field: str = "text", label: Path | None = None
) -> Iterator[tuple[int, str | BadRecord]]:
    """Yield ``(record number, text or BadRecord)`` for each record of one file.

    The record number is a JSONL line's 0-based line number (blank lines are skipped but
    counted), a parquet row's 0-based index, 0 for a whole-file document. Messages name
    the file as ``label`` (default: ``path``), so a worker reading an absolute path
    reports the path the user gave.
    """
    shown = label if label is not None else path
    fmt = _base_suffix(path)
    if fmt in _JSONL:
        return _iter_jsonl(path, shown, text_field)
    if fmt == ".parquet":
        return _iter_parquet(path, shown, text_field)
    return _iter_text_file(path, shown)


# The readers below *yield* a BadRecord instead of raising it: a generator that raises
# is finished, and --skip-bad must go on with the next line of the same file.
_Item: TypeAlias = "tuple[int, str | BadRecord]"


_SKIP_HINT = "; fix or remove it, or pass --skip-bad to skip it"


def _bad(path: Path, line: int | None, what: str) -> BadRecord:
    where = f"{path}:{line}" if line is not None else str(path)
    return BadRecord(f"{where}: {what}{_SKIP_HINT}")


def _read_error(path: Path, exc: Exception) -> BadRecord:
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return _bad(path, None, f"cannot read file ({type(exc).__name__}: {reason})")


def _iter_text_file(path: Path, shown: Path) -> Iterator[_Item]:
    try:
        with _open_binary(path) as f:
            data = f.read()
    except Exception as exc:  # OSError, gzip/zstd corruption, EOFError: all "unreadable"
        yield 0, _read_error(shown, exc)
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        yield 0, _bad(shown, line, f"not valid UTF-8 (byte offset {exc.start})")
        return
    yield 0, text


def _iter_jsonl(path: Path, shown: Path, text_field: str) -> Iterator[_Item]:
    try:
        f = _open_binary(path)
    except OSError as exc:
        yield 0, _read_error(shown, exc)
        return
    with f:
        lineno = 0
        while True:
            try:
                raw = f.readline()
            except Exception as exc:
                yield lineno, _read_error(shown, exc)
                return
            if not raw:
                return
            lineno += 1
            if not raw.strip():
                continue
            yield lineno - 1, _parse_json_line(shown, lineno, raw, text_field)


def _parse_json_line(path: Path, lineno: int, raw: bytes, text_field: str) -> str | BadRecord:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return _bad(path, lineno, f"not valid UTF-8 (column {exc.start + 1})")
    try:
        record: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        return _bad(path, lineno, f"not valid JSON ({exc.msg})")
    if not isinstance(record, dict):
        return _bad(path, lineno, f"expected a JSON object, got {type(record).__name__}")
    if text_field not in record:
        return _bad(path, lineno, f"no field {text_field!r} (use --text-field to pick another)")
    text = record[text_field]
    if not isinstance(text, str):
        return _bad(path, lineno, f"field {text_field!r} is {type(text).__name__}, not a string")
    # JSON may spell a lone surrogate ("\udc80"), which no tokenizer can encode. Only a
    # \u escape can make one, so lines without one skip the scan.
    if b"\\u" in raw and (found := _SURROGATE.search(text)) is not None:
        code = f"\\u{ord(found.group()):04x}"
        what = f"field {text_field!r} has a lone surrogate {code} at character {found.start()}"
        return _bad(path, lineno, f"{what} (not encodable as UTF-8)")
    return text


def _iter_parquet(path: Path, shown: Path, text_field: str) -> Iterator[_Item]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(
            f"{shown}: reading parquet needs pyarrow: pip install 'tokenfeed-server[parquet]'"
        ) from None
    row = 0
    try:
        pf = pq.ParquetFile(path)
        if text_field not in pf.schema_arrow.names:
            yield 0, _bad(shown, None, f"no column {text_field!r} (use --text-field)")
            return
        for batch in pf.iter_batches(columns=[text_field], batch_size=4096):
            for value in batch.column(0).to_pylist():
                row += 1
                if isinstance(value, str):
                    yield row - 1, value
                else:
                    what = f"column {text_field!r} is {type(value).__name__}, not a string"
                    yield row - 1, _bad(shown, row, what)
    except Exception as exc:  # pyarrow raises its own ArrowException family
        yield row, _read_error(shown, exc)
