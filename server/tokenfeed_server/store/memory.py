"""Who holds the server's memory, and the C allocator's share of it (issue 28).

:func:`memory_by_owner` answers in bytes per owner, from the owners' own counts (not
the process's RSS, which says how much but not who): the row buffer pool, the window
blocks, the mixture tables of running jobs, and whatever other part of the server
registered itself with :func:`register_owner` (the data plane's job records or
per-connection state, say). It is cheap (each owner keeps a running count), so /metrics
and /v1/status may call it on every scrape.

The process's memory also depends on glibc's malloc, which keeps freed memory for reuse
in per-thread *arenas*: the 16 threads fetching pieces from object storage each get one,
and a piece freed in it stays with that arena. :func:`limit_malloc_arenas` (once, at
server start, before threads start) caps how many arenas there are; :func:`trim_malloc`
hands free memory at the top of the heaps back to the system after big frees
(:func:`release_idle` calls it when the pools shrank). Both do nothing off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

__all__ = [
    "BUILTIN_OWNERS",
    "configure",
    "limit_malloc_arenas",
    "memory_by_owner",
    "register_owner",
    "release_idle",
    "trim_malloc",
]

log = logging.getLogger(__name__)

#: The owners every server has, always listed first by :func:`memory_by_owner`.
BUILTIN_OWNERS = ("row_buffers", "window_blocks", "mixture_tables")

# glibc's mallopt parameter for the most arenas (malloc.h: M_ARENA_MAX).
_M_ARENA_MAX = -8
# Bytes the pools give back above which release_idle trims at once.
_TRIM_MIN_BYTES = 16 << 20

_owners: dict[str, Callable[[], int]] = {}
_last_trim = 0.0  # time.monotonic() of release_idle's last trim
_owners_lock = threading.Lock()


def register_owner(name: str, held_bytes: Callable[[], int]) -> Callable[[], None]:
    """Report ``held_bytes()`` under ``name`` in :func:`memory_by_owner`; returns the
    function that removes it again.

    ``held_bytes`` must be cheap and thread-safe (it runs on the HTTP thread at every
    scrape) and should count what its owner holds, estimated where exact counts cost
    too much (``sys.getsizeof`` of the containers, say). A second registration under the
    same name replaces the first (a data plane started again in one process), and the
    first one's remover then leaves the second in place.
    """
    if name in BUILTIN_OWNERS:
        raise ValueError(f"{name!r} is a built-in owner of memory_by_owner()")
    with _owners_lock:
        _owners[name] = held_bytes

    def unregister() -> None:
        with _owners_lock:
            if _owners.get(name) is held_bytes:
                del _owners[name]

    return unregister


def memory_by_owner() -> dict[str, int]:
    """Bytes held now per owner: :data:`BUILTIN_OWNERS` first, then the registered ones
    in the order they registered.

    ``row_buffers``: the pooled token buffers and their row views
    (:class:`~tokenfeed_server.store.pools.RowBuffers`); ``window_blocks``: the cached
    blocks of stream orders (:class:`~tokenfeed_server.store.pools.WindowBlocks`);
    ``mixture_tables``: the period tables of the mixtures running jobs read, each counted
    once however many jobs share it (:mod:`~tokenfeed_server.store.mixing`). An owner
    whose count fails is left out (and logged), never the whole answer.
    """
    # Imported here: both import this module's neighbours, and the built-in owners must
    # be listed whether or not a mixture job has imported mixing yet.
    from tokenfeed_server.store import mixing, pools

    out = {
        "row_buffers": pools.row_buffers.held_bytes,
        "window_blocks": pools.window_blocks.held_bytes,
        "mixture_tables": mixing.shared_mixtures.held_bytes,
    }
    with _owners_lock:
        owners = list(_owners.items())
    for name, held_bytes in owners:
        try:
            out[name] = int(held_bytes())
        except Exception:  # one broken owner must not hide the others
            log.exception("memory owner %r failed to count its bytes", name)
    return out


def configure(*, row_pool_bytes: int, window_blocks_bytes: int) -> None:
    """Apply the memory settings (:class:`~tokenfeed_server.config.MemorySettings`) to
    the shared pools; what no longer fits is dropped now."""
    from tokenfeed_server.store import pools

    pools.row_buffers.resize(row_pool_bytes)
    pools.window_blocks.resize(window_blocks_bytes)


def release_idle(idle_s: float) -> int:
    """Drop pooled buffers and cached blocks no request used for ``idle_s`` seconds, and
    trim the heaps (at most once per ``idle_s``, or at once when the pools gave back a
    lot); the bytes the pools gave back.

    For a periodic housekeeping tick, off the data plane's hot path (trimming walks the
    heaps). Trimming is what returns the pieces the fetch threads freed: in a probe of 16
    threads allocating and freeing 1 MiB pieces, RSS fell back to within a few MB of its
    start only with both the arena limit and a trim (either alone kept most of it).
    """
    global _last_trim
    from tokenfeed_server.store import pools

    freed = pools.row_buffers.release_idle(idle_s) + pools.window_blocks.release_idle(idle_s)
    now = time.monotonic()
    if freed >= _TRIM_MIN_BYTES or now - _last_trim >= idle_s:
        _last_trim = now
        trim_malloc()
    return freed


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The process's C library if it is glibc (it has ``mallopt`` and ``malloc_trim``
    with glibc's meaning), else None: musl, macOS, Windows."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  # only glibc has it
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """Let glibc's malloc make at most ``arenas`` arenas (0: leave glibc's default of 8
    per core); True when applied.

    Call it once at server start, before the piece fetchers and the data plane start:
    arenas made before stay. Left alone when the operator set ``MALLOC_ARENA_MAX`` (glibc
    read it at start-up) and off glibc. Harmless to call again.
    """
    if arenas <= 0 or os.environ.get("MALLOC_ARENA_MAX"):
        return False
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, arenas))


def trim_malloc() -> bool:
    """Give free heap memory back to the system (glibc ``malloc_trim(0)``); True when
    some was given back. Walks every arena: not for the data plane's hot path."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


class MemoryKeeper:
    """A daemon thread that calls :func:`release_idle` every ``idle_s / 4`` seconds.

    Its own thread rather than a turn of the data plane's loop: a trim walks the heaps
    (milliseconds on a big one), which no request should wait behind.
    """

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenfeed-memory", daemon=True)

    def start(self) -> MemoryKeeper:
        if self.idle_s > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.wait(max(0.05, self.idle_s / 4)):
            try:
                release_idle(self.idle_s)
            except Exception:  # a housekeeping failure must not end the server
                log.exception("memory housekeeping failed; retrying at the next tick")
