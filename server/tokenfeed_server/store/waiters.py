"""A request parked for pieces not in the cache yet, and the exception that parks it.

The data plane's loop never waits on object storage: a read that needs a piece not here
raises :class:`NotResident`, whose :class:`Waiter` the cache completes when the pieces
are in (or one stays unreadable); the loop then retries the request and releases the
waiter (:meth:`PieceCache.release <tokenfeed_server.store.cache.PieceCache.release>`)
once the retried request has been served, so its pieces stay pinned until then.

While object storage does not answer for one of its pieces, a waiter's :attr:`Waiter.fault`
says which object, the last error and until when the fetch keeps trying: the data plane
tells the waiting trainer so (:meth:`StorageFault.notice`) instead of going silent.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenfeed.errors import StorageUnavailable, StoreError
from tokenfeed_server.store.pieces import PieceRef

if TYPE_CHECKING:
    from tokenfeed_server.store.cache import PieceCache
    from tokenfeed_server.store.cache_policy import PieceEntry

__all__ = ["Completions", "NotResident", "StorageFault", "Waiter"]


@dataclass(frozen=True)
class StorageFault:
    """Object storage does not answer for a piece: its object, the last error, when the
    trouble began and until when the fetch keeps trying (``time.monotonic`` seconds)."""

    url: str
    error: str
    since: float
    until: float

    def notice(self, now: float) -> str:
        """What a request waiting on it is told at ``now`` (see
        :meth:`~tokenfeed.errors.StorageUnavailable.retrying_message`)."""
        return StorageUnavailable.retrying_message(self.until - now, self.url, self.error)


class Waiter:
    """The pieces one parked request waits for; done when all are in or one failed.

    ``error`` is set when a piece stays unreadable (or the request can never fit);
    ``fault`` while one of its pieces waits on object storage that does not answer.
    """

    def __init__(self, refs: Sequence[PieceRef]) -> None:
        self.refs = tuple(refs)
        self.error: StoreError | None = None
        #: set and cleared by the cache (under its lock), read by the loop without it
        self.fault: StorageFault | None = None
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


class Completions:
    """The waiters done, on their way to the data plane's loop: a list, and a pipe whose
    read end (:attr:`fd`, polled by the loop) turns readable when the list is not empty.

    The cache's lock guards :meth:`complete`, :meth:`take` and :meth:`close` (the caller
    holds it); :meth:`clear_wake` is the loop's, without it.
    """

    def __init__(self) -> None:
        self._done: list[Waiter] = []
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    @property
    def fd(self) -> int:
        """The descriptor to poll (-1 once closed)."""
        return self._r

    def complete(self, waiter: Waiter) -> None:
        """``waiter`` is done: mark it, hand it over and wake the loop."""
        waiter.finish()
        self._done.append(waiter)
        if self._w < 0:
            return  # closed
        try:
            os.write(self._w, b"\0")
        except (BlockingIOError, InterruptedError):
            pass  # the pipe is full: the loop is already due to wake
        except OSError:
            pass  # closed

    def clear_wake(self) -> bool:
        """Empty the pipe; False once closed (nothing more will come)."""
        if self._r < 0:
            return False
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:  # closed meanwhile
            return False
        return True

    def take(self) -> list[Waiter]:
        """The waiters done since the last call."""
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        """Close the pipe (a late completion writes nothing)."""
        fds = (self._r, self._w)
        self._r = self._w = -1
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
