"""Who made the cache fetch what: bytes fetched from object storage, per job.

A fetch is charged to the job whose read caused it: a request's missing pieces to the
job being served when the read missed (the data plane names it before it reads:
:attr:`FetchLedger.owner`), a prefetched piece to the job whose plan wanted it first (the
prefetcher names the owner of each wanted range). The data plane takes the counts each
second (:meth:`FetchLedger.take`) into its jobs, so a job's figure ends with the job and
the ledger holds only the jobs that fetched since the last take.

Used under the cache's lock (the owner is set by the loop thread alone, which is the only
one that reads through the cache).
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Sequence

__all__ = ["FetchLedger"]


class FetchLedger:
    """Bytes fetched per owner (a job id; ``""``: nobody named, e.g. a tool's read)."""

    def __init__(self) -> None:
        #: the job whose request reads now (set by the data plane before it reads)
        self.owner = ""
        self._fetched: collections.Counter[str] = collections.Counter()
        # the prefetch plan's owners: want-list index where each owner's range ends
        self._ends: list[int] = []
        self._owners: list[str] = []

    def set_plan_owners(self, owners: Sequence[tuple[int, str]]) -> None:
        """The wanted list's owners: ``(count, owner)`` per range, in the list's order."""
        self._ends, self._owners, end = [], [], 0
        for count, owner in owners:
            end += count
            self._ends.append(end)
            self._owners.append(owner)

    def plan_owner(self, index: int) -> str:
        """The owner of the wanted list's ``index``-th piece (``""`` if none was named)."""
        k = bisect.bisect_right(self._ends, index)
        return self._owners[k] if k < len(self._owners) else ""

    def charge(self, owner: str, nbytes: int) -> None:
        """``owner``'s read made the cache fetch ``nbytes``."""
        self._fetched[owner] += nbytes

    def take(self) -> dict[str, int]:
        """The bytes fetched per owner since the last call (then forgotten here)."""
        taken, self._fetched = dict(self._fetched), collections.Counter()
        return taken
