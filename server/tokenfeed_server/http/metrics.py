"""Prometheus metrics, read from the data plane's snapshot at scrape time (zero cost on
the hot path), from the piece cache's counters of an ``s3://`` store, and from each
dataset's storage health (:mod:`tokenfeed_server.http.dataset_health`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tokenfeed_server.http.dataset_health import DatasetEntry
from tokenfeed_server.http.routes.status import memory_figures
from tokenfeed_server.http.state import ServerState
from tokenfeed_server.store.handles import HANDLES
from tokenfeed_server.store.health import FaultKind, StorageHealth

__all__ = ["PROMETHEUS_CONTENT_TYPE", "SnapshotCollector", "exposition"]

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def exposition(state: ServerState) -> bytes:
    """The text exposition of every metric of the server ``state`` describes."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(state))
    return generate_latest(registry)


class SnapshotCollector(Collector):
    """Reads the data plane's snapshot at scrape time: zero cost on the hot path."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        """The per-job metrics, the server's gauges and events, the cache's metrics."""
        snap = self.state.dataplane.snapshot
        yield from _job_metrics(snap["jobs"])
        yield GaugeMetricFamily(
            "tokenfeed_connections", "Attached connections", value=snap["connections"]
        )
        yield GaugeMetricFamily("tokenfeed_jobs", "Known jobs", value=len(snap["jobs"]))
        yield GaugeMetricFamily(
            "tokenfeed_ready", "1 when serving", value=1 if self.state.ready else 0
        )
        loop = snap.get("loop", {})
        busiest = GaugeMetricFamily(
            "tokenfeed_loop_busiest_turn_seconds",
            "Busy time of the data plane loop's busiest turn (every job waits it)",
            labels=["window"],
        )
        busiest.add_metric(["since_start"], loop.get("busiest_turn_s", 0.0))
        busiest.add_metric(["recent"], loop.get("recent_busiest_turn_s", 0.0))
        yield busiest
        yield CounterMetricFamily(
            "tokenfeed_loop_busy_seconds", "Busy time of the data plane loop in all",
            value=loop.get("busy_s", 0.0),
        )  # fmt: skip
        events = CounterMetricFamily("tokenfeed_events", "Data plane events", labels=["event"])
        for name, value in sorted(snap["counters"].items()):
            events.add_metric([name], value)
        yield events
        held = GaugeMetricFamily(
            "tokenfeed_memory_bytes", "Bytes the server holds, by owner", labels=["owner"]
        )
        for owner, value in memory_figures(snap).items():
            held.add_metric([owner], value)
        yield held
        yield from _handle_metrics(HANDLES.stats())
        cache = self.state.store.cache
        if cache is not None:
            yield from _cache_metrics(cache.stats())
        yield from _storage_metrics(
            cache.health if cache is not None else None, self.state.dataset_health.entries()
        )


def _handle_metrics(stats: dict[str, int]) -> Iterator[Metric]:
    """Local shard files held open (bounded by --max-open-shards), opened and closed."""
    yield GaugeMetricFamily(
        "tokenfeed_open_shard_files", "Shard files of local datasets open now",
        value=stats["open"],
    )  # fmt: skip
    yield GaugeMetricFamily(
        "tokenfeed_max_open_shards", "Bound on open shard files", value=stats["limit"]
    )
    events = CounterMetricFamily(
        "tokenfeed_shard_files", "Shard files opened, and closed to make room", labels=["event"]
    )
    events.add_metric(["opened"], stats["opens"])
    events.add_metric(["evicted"], stats["evictions"])
    yield events


def _job_metrics(jobs: list[dict[str, Any]]) -> Iterator[Metric]:
    """One sample per job of each job metric (as ``/v1/jobs`` shows the jobs)."""
    # Not "job": Prometheus sets that label to the scrape target's job and would rename
    # ours to "exported_job"; "job_id" survives the scrape as it is.
    labels = ["job_id", "dataset", "tenant"]
    tokens = CounterMetricFamily("tokenfeed_tokens_served", "Tokens sent", labels=labels)
    batches = CounterMetricFamily("tokenfeed_batches_served", "Batches sent", labels=labels)
    retrans = CounterMetricFamily(
        "tokenfeed_retransmits", "Requests for data already sent", labels=labels
    )
    rate = GaugeMetricFamily(
        "tokenfeed_tokens_per_second", "Recent rate of tokens sent", labels=labels
    )
    workers = GaugeMetricFamily("tokenfeed_job_workers", "Attached workers", labels=labels)
    served = GaugeMetricFamily(
        "tokenfeed_served_position",
        "Furthest stream position sent (windows from the stream's start; prefetched)",
        labels=labels,
    )
    consumed = GaugeMetricFamily(
        "tokenfeed_consumed_position",
        "Stream position the trainer reported consumed (absent until it reports)",
        labels=labels,
    )
    consumed_rate = GaugeMetricFamily(
        "tokenfeed_consumed_tokens_per_second",
        "Recent rate of input tokens the trainer consumed (seq_len per window)",
        labels=labels,
    )
    fetched = CounterMetricFamily(
        "tokenfeed_job_bytes_fetched",
        "Bytes fetched from object storage for the job (per byte served: read amplification)",
        labels=labels,
    )
    amplification = GaugeMetricFamily(
        "tokenfeed_job_fetched_per_served",
        "Bytes fetched from object storage per byte served (absent before any is served)",
        labels=labels,
    )
    for job in jobs:
        values = [job["id"], job["dataset"], job["tenant"]]
        fetched.add_metric(values, job.get("bytes_fetched", 0))
        if job.get("fetched_per_served") is not None:
            amplification.add_metric(values, job["fetched_per_served"])
        tokens.add_metric(values, job["tokens_served"])
        batches.add_metric(values, job["batches_served"])
        retrans.add_metric(values, job["retransmits"])
        rate.add_metric(values, job["tokens_per_s"])
        workers.add_metric(values, job["workers"])
        served.add_metric(values, job["position"])
        if job["consumed_position"] is not None:
            consumed.add_metric(values, job["consumed_position"])
            consumed_rate.add_metric(values, job["consumed_tokens_per_s"])
    yield from (tokens, batches, retrans, rate, workers, served, consumed, consumed_rate)
    yield from (fetched, amplification)


def _cache_metrics(stats: dict[str, Any]) -> Iterator[Metric]:
    """The piece cache of an s3:// store, from :meth:`PieceCache.stats`."""
    gauges = {
        "capacity_bytes": "Most bytes the piece cache may hold",
        "size_bytes": "Bytes of verified pieces in the cache",
        "reserved_bytes": "Bytes held, being fetched or queued (never above the capacity)",
        "pieces": "Verified pieces in the cache",
        "fetching": "Pieces being fetched now",
        "wanted_pieces": "Pieces the prefetch plan wants",
    }
    for key, doc in gauges.items():
        yield GaugeMetricFamily(f"tokenfeed_cache_{key}", doc, value=stats[key])
    counters = {
        "hits": "Piece look-ups of reads that found the piece cached",
        "misses": "Piece look-ups of reads that waited for a fetch",
        "fetches": "Pieces fetched from object storage",
        "prefetches": "Pieces fetched ahead for the prefetch plan",
        "bytes_fetched": "Bytes fetched from object storage",
        "fetch_errors": "Failed GET attempts, each retried",
        "checksum_mismatches": "Fetched pieces that did not match the manifest",
        "unreadable": "Pieces given up on after the retries",
        "evictions": "Pieces evicted to make room",
    }
    for key, doc in counters.items():
        yield CounterMetricFamily(f"tokenfeed_cache_{key}", doc, value=stats[key])
    buckets = [(str(le), count) for le, count in stats["fetch_latency_buckets"]]
    buckets.append(("+Inf", stats["fetches"]))
    yield HistogramMetricFamily(
        "tokenfeed_cache_fetch_seconds",
        "Seconds per piece fetch (retries included)",
        buckets=buckets,
        sum_value=stats["fetch_latency_sum_s"],
    )


_STATUSES = ("ok", "degraded", "unavailable")
_FAULT_KINDS: tuple[FaultKind, ...] = ("unreachable", "missing", "damaged", "exhausted")


def _storage_metrics(health: StorageHealth | None, entries: list[DatasetEntry]) -> Iterator[Metric]:
    """Object storage faults (zero for a local store: the series exist on every server,
    so an alert need not know which kind it scrapes) and each dataset's status as a state
    set: one series per status, 1 for the current one."""
    errors = CounterMetricFamily(
        "tokenfeed_storage_errors",
        "Object storage faults seen, by kind (unreachable, missing, damaged, exhausted)",
        labels=["kind"],
    )
    counts = dict(health.errors) if health is not None else {}
    for kind in _FAULT_KINDS:
        errors.add_metric([kind], counts.get(kind, 0))
    yield errors
    yield CounterMetricFamily(
        "tokenfeed_storage_retries",
        "Object storage requests tried again after a transient fault",
        value=health.retries if health is not None else 0,
    )
    yield CounterMetricFamily(
        "tokenfeed_storage_wait_seconds",
        "Seconds requests spent waiting for object storage, summed over requests",
        value=health.wait_s if health is not None else 0.0,
    )
    status = GaugeMetricFamily(
        "tokenfeed_dataset_status",
        "1 for each dataset's current status (ok, degraded, unavailable), 0 for the others",
        labels=["dataset", "status"],
    )
    for entry in entries:
        for name in _STATUSES:
            status.add_metric([entry.name, name], 1 if entry.status == name else 0)
    yield status
