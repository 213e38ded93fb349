"""A request parked for pieces not in the cache yet, and the exception that parks it.

The data plane's loop never waits on object storage: a read that needs a piece not here
raises :class:`NotResident`, whose :class:`Waiter` the cache completes when the pieces
are in (or one stays unreadable); the loop then retries the request and releases the
waiter (:meth:`PieceCache.release <tokenfeed_server.store.cache.PieceCache.release>`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenfeed.errors import StoreError
from tokenfeed_server.store.pieces import PieceRef

if TYPE_CHECKING:
    from tokenfeed_server.store.cache import PieceCache
    from tokenfeed_server.store.cache_policy import PieceEntry

__all__ = ["NotResident", "Waiter"]


class Waiter:
    """The pieces one parked request waits for; done when all are in or one failed.

    ``error`` is set when a piece stays unreadable (or the request can never fit).
    """

    def __init__(self, refs: Sequence[PieceRef]) -> None:
        self.refs = tuple(refs)
        self.error: StoreError | None = None
        # The cache's bookkeeping (under its lock): the digests not in yet, the entries
        # pinned for this request, and where the request is in its life.
        self.pending: set[str] = set()
        self.pinned: list[PieceEntry] = []
        self.admitted = False
        self.released = False
        self._event = threading.Event()

    @property
    def done(self) -> bool:
        """True once every piece is in, or ``error`` is set."""
        return self._event.is_set()

    def finish(self) -> None:
        """Mark the waiter done (the cache calls this once every piece is in, or one
        failed, or it stops)."""
        self._event.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (for callers off the data plane's loop); False on timeout."""
        return self._event.wait(timeout)


class NotResident(Exception):
    """A read needs pieces that are not in the cache; nothing was read.

    The data plane parks the request and retries it when :attr:`waiter` is done, then
    calls :meth:`PieceCache.release` with it.
    """

    def __init__(self, cache: PieceCache, waiter: Waiter) -> None:
        super().__init__(f"waiting for {len(waiter.refs)} pieces")
        self.cache = cache
        self.waiter = waiter
