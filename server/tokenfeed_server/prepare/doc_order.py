"""The order of a prepared dataset: every document keyed by the seed and its identity.

A document's identity is its file's path relative to the inputs' root and its record
number in that file (a JSONL line's 0-based line number, a parquet row's 0-based index,
0 for a whole-file document). Its shuffle key is a splitmix64 draw determined by the seed
and that identity alone, and the dataset holds the documents sorted by
``(key, path, record)``: a uniform global shuffle that any engine computes the same way,
whatever the order in which documents are read, how they are partitioned, or which
records around them were skipped.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from tokenfeed.plan import splitmix64

__all__ = ["CorpusFiles", "corpus_files", "document_keys", "path_hash"]

# The key generator's constants; fixed forever (pinned by tests: a change reorders every
# dataset prepared from then on).
_GOLDEN = 0x9E3779B97F4A7C15
_SEED_MULT = 0xD1B54A32D192ED03
_SEED_ADD = 0x632BE59BD9B4E019


def path_hash(relpath: str) -> int:
    """A stable 64-bit hash of a file's path relative to the inputs' root (POSIX form)."""
    digest = hashlib.blake2b(os.fsencode(relpath), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def document_keys(
    seed: int, path_hashes: npt.ArrayLike, records: npt.ArrayLike
) -> npt.NDArray[np.uint64]:
    """The shuffle keys of the documents ``(path_hashes[i], records[i])`` for ``seed``.

    A file's documents are the draws ``record * gamma + start`` of a splitmix64 generator
    (:func:`tokenfeed.plan.splitmix64`) whose start mixes the seed and the path's hash.
    Both arguments broadcast (one hash for a whole file's records is fine).
    """
    offset = np.uint64((seed * _SEED_MULT + _SEED_ADD) % (1 << 64))
    hashes = np.asarray(path_hashes, dtype=np.uint64)
    with np.errstate(over="ignore"):
        start = splitmix64(hashes ^ offset)
        state = np.asarray(records, dtype=np.uint64) * np.uint64(_GOLDEN) + start
    return splitmix64(np.asarray(state, dtype=np.uint64))


@dataclass(frozen=True)
class CorpusFiles:
    """The input files with what orders their documents.

    ``paths[i]`` is read as given (messages name it so); ``relpaths[i]`` is its path
    relative to ``root``; ``ranks[i]`` its place in the byte order of
    ``(relpath, i)``, the tie rule after the key (unique even if a file is given twice).
    """

    root: Path
    paths: tuple[Path, ...]
    relpaths: tuple[str, ...]
    hashes: npt.NDArray[np.uint64]
    ranks: npt.NDArray[np.int64]


def corpus_files(inputs: Sequence[Path], files: Sequence[Path]) -> CorpusFiles:
    """Identify ``files`` (expanded from ``inputs``) relative to the inputs' root.

    The root is the deepest directory holding every input (a directory input counts as
    itself, a file input as its parent), so the same corpus moved elsewhere, or mounted
    elsewhere on a cluster, gets the same identities and so the same order.
    """
    absolute = [Path(os.path.abspath(p)) for p in inputs]
    root = Path(os.path.commonpath([str(p if p.is_dir() else p.parent) for p in absolute]))
    relpaths = tuple(Path(os.path.abspath(f)).relative_to(root).as_posix() for f in files)
    hashes = np.fromiter((path_hash(r) for r in relpaths), dtype=np.uint64, count=len(relpaths))
    order = sorted(range(len(relpaths)), key=lambda i: (os.fsencode(relpaths[i]), i))
    ranks = np.empty(len(relpaths), dtype=np.int64)
    ranks[order] = np.arange(len(relpaths), dtype=np.int64)
    return CorpusFiles(root, tuple(files), relpaths, hashes, ranks)
