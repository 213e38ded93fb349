"""The piece cache's counters and fetch-latency histogram (for /v1/status and /metrics)."""

from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LATENCY_BUCKETS", "CacheStats"]

#: Upper bounds (seconds) of the fetch-latency histogram's buckets.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class CacheStats:
    """Counters of one cache since it started; the cache's lock guards them."""

    hits: int = 0
    misses: int = 0
    fetches: int = 0
    prefetches: int = 0
    bytes_fetched: int = 0
    fetch_errors: int = 0
    checksum_mismatches: int = 0
    unreadable: int = 0
    evictions: int = 0
    verified_local: int = 0
    latency_sum: float = 0.0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    # the last fetches' latencies: p50 and p99 without keeping every one
    recent: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=2048))

    def record_fetch(self, nbytes: int, elapsed: float, *, demand: bool) -> None:
        """A piece of ``nbytes`` came from object storage in ``elapsed`` seconds."""
        self.fetches += 1
        self.prefetches += 0 if demand else 1
        self.bytes_fetched += nbytes
        self.latency_sum += elapsed
        self.latency_buckets[bisect.bisect_left(LATENCY_BUCKETS, elapsed)] += 1
        self.recent.append(elapsed)

    def as_dict(self) -> dict[str, Any]:
        """The counters, the latency quantiles and the cumulative histogram."""
        recent = sorted(self.recent)
        return {
            "hits": self.hits,
            "misses": self.misses,
            "fetches": self.fetches,
            "prefetches": self.prefetches,
            "bytes_fetched": self.bytes_fetched,
            "fetch_errors": self.fetch_errors,
            "checksum_mismatches": self.checksum_mismatches,
            "unreadable": self.unreadable,
            "evictions": self.evictions,
            "verified_local": self.verified_local,
            "fetch_latency_p50_s": _quantile(recent, 0.5),
            "fetch_latency_p99_s": _quantile(recent, 0.99),
            "fetch_latency_sum_s": self.latency_sum,
            "fetch_latency_buckets": list(zip(LATENCY_BUCKETS, self._cumulative(), strict=True)),
        }

    def _cumulative(self) -> list[int]:
        out, total = [], 0
        for count in self.latency_buckets[:-1]:
            total += count
            out.append(total)
        return out


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(q * len(values)))], 6)
