"""One ``pread`` per row, the way a request's rows are read from shard and cache files.

:func:`read_rows` returns what ``sum(map(os.preadv, fds, bufs, offsets))`` returns (the
bytes read, so a short read shows in the total; a failed read raises ``OSError``). It uses
the small C helper built with the package (``_rows.c``) when it is there: that releases the
GIL once per request instead of once per 4 KiB row and skips ``os.preadv``'s per-call
argument handling. Without it (no C compiler where the package was installed, or
``TOKENFEED_NATIVE_READS=0``) the same reads run through ``os.preadv``: same bytes, same
errors, more CPU per row.

Why reads and not a memory map: a map of a shard truncated under the server would kill it
with SIGBUS, and mapping every shard of a 150,000-shard store would also run into
``vm.max_map_count``; ``pread`` turns a truncated file into a short read, which the caller
reports for the dataset alone.
"""

from __future__ import annotations

import importlib
import itertools
import os
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["NATIVE", "read_rows", "read_path"]


def _portable(fds: int | Sequence[int], bufs: Iterable[Any], offsets: list[int]) -> int:
    # The loop runs in C (map, sum over os.preadv): no Python bytecode per row.
    each = itertools.repeat(fds) if isinstance(fds, int) else fds
    return sum(map(os.preadv, each, bufs, offsets))


def _load() -> tuple[Any, str]:
    """The C helper's ``read_rows`` (None: not used) and how rows are read, in words."""
    if os.environ.get("TOKENFEED_NATIVE_READS", "1") == "0":
        return None, "preadv per row (TOKENFEED_NATIVE_READS=0)"
    try:  # by name: a `from tokenfeed_server.store import` would be an import cycle
        native = importlib.import_module("tokenfeed_server.store._rows")
    except ImportError:
        return None, "preadv per row (the C helper was not built: no C compiler at install)"
    return native.read_rows, "native (one GIL release per request)"


_native, _path = _load()
#: True when rows are read by the C helper (one GIL release per request).
NATIVE = _native is not None


def read_rows(fds: int | list[int], bufs: Iterable[Any], offsets: list[int]) -> int:
    """Read row ``i`` from ``fds[i]`` (or ``fds`` for every row) at ``offsets[i]`` into
    the ``i``-th of ``bufs`` (1-tuples of writable buffers): the bytes read in all."""
    if _native is not None:
        return int(_native(fds, bufs, offsets))
    return _portable(fds, bufs, offsets)


def read_path() -> str:
    """How rows are read, for the server's start-up line."""
    return _path
