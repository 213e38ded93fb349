"""The HTTP API's response models: what each endpoint returns, field by field.

They are the contract published at ``/openapi.json`` (every field carries its
description) and checked by the schemathesis run in the tests. The data plane and the
store keep producing plain dicts; the API converts them here, at its boundary, so a key
that goes missing upstream fails loudly in the tests instead of silently in a client.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    # Frozen: a response is built once and sent. Unknown input keys are ignored so that a
    # producer may add a key before the API publishes it.
    model_config = ConfigDict(frozen=True)


class ErrorBody(_Model):
    """Every 4xx answer of the API."""

    detail: str = Field(description="What went wrong and, where it helps, what to do.")


class Health(_Model):
    """Liveness."""

    status: Literal["ok"] = Field(description="Always `ok`: the process is running.")


class Readiness(_Model):
    """Readiness: whether trainers can be served now.

    Ready once the store is open and both sockets are bound, and then as long as the store
    holds no dataset or at least one of them serves: a store with every dataset
    unavailable cannot serve anyone, an empty one is merely waiting for a ``prepare``
    (``compose up`` starts the server before anything is prepared).
    """

    status: Literal["ready", "not ready"] = Field(
        description="`ready` while the server can serve: the store is open, both sockets "
        "are bound, and the store holds no dataset or at least one that serves."
    )
    zmq: str | None = Field(
        default=None, description="The data plane's ZeroMQ endpoint; null while not ready."
    )
    reason: str | None = Field(
        default=None, description="Why the server is not ready; null when it is."
    )
    not_serving: list[str] = Field(
        default_factory=list,
        description="Datasets that do not serve now (status `unavailable`) that the caller "
        "may see: all of them on an open server or for the admin token, a tenant's own for "
        "its token, none without a token on an authenticated server.",
    )
    not_serving_count: int = Field(
        default=0,
        description="How many datasets do not serve now, whoever may see their names.",
    )


class TokenizerView(_Model):
    """The tokenizer a dataset was prepared with."""

    kind: str = Field(description="Tokenizer family, e.g. `byte` or `bpe`.")
    vocab_size: int = Field(description="Number of token ids, the EOS id included.")
    eos_id: int = Field(description="Id of the end-of-document token.")
    hash: str = Field(
        description="The tokenizer's identity, shared by every dataset prepared with an equal "
        "tokenizer whatever its `kind` label: `blake2b-128:` of the tokenizer file's hash "
        "(Hugging Face tokenizers) or of kind, vocabulary size and EOS id (byte), with the "
        "vocabulary size and EOS id. Two datasets mix only if their hashes are equal."
    )


#: A dataset's storage health (see :mod:`tokenfeed_server.store.health`).
DatasetStatus = Literal["ok", "degraded", "unavailable"]

_STATUS = (
    "`ok`; `degraded`: object storage fails transiently and is being retried (jobs wait; "
    "`error` is the last fault, `since` when the trouble began); `unavailable`: the "
    "dataset does not serve (it fails to open, an object it needs is missing or damaged "
    "(named in `objects`), or storage did not answer within the retry budget)."
)


class ObjectFaultView(_Model):
    """One object of a dataset that object storage lacks or holds damaged."""

    url: str = Field(description="The object's URL (`s3://BUCKET/KEY`).")
    kind: Literal["missing", "damaged"] = Field(
        description="`missing`: not in the bucket; `damaged`: its bytes fail the "
        "manifest's checksums (or its size differs)."
    )


class _DatasetEntry(_Model):
    """What every entry of ``/v1/datasets`` says, served or not: its name and health."""

    name: str = Field(description="Dataset name (its directory in the store).")
    ok: bool = Field(
        description="True while the dataset serves (status `ok` or `degraded`: a degraded "
        "dataset's jobs wait for storage); false when `unavailable`."
    )
    status: DatasetStatus = Field(default="ok", description=_STATUS)
    error: str | None = Field(
        default=None,
        description="What is wrong, with what to run (store paths only for the admin); "
        "null when `ok`.",
    )
    since: float | None = Field(
        default=None,
        description="When the trouble began as this server saw it (Unix time, seconds); "
        "null when `ok` or not known.",
    )
    objects: list[ObjectFaultView] = Field(
        default_factory=list,
        description="The missing or damaged objects known, named (empty when none is).",
    )
    fix: str | None = Field(
        default=None,
        description="What to run to make the named objects whole (`tokenfeed-server inspect "
        "NAME --store URL --verify --repair --source DIR`, or a `prepare --overwrite` with the "
        "same inputs); null when no object is named.",
    )
    version: str | None = Field(
        default=None,
        description="The dataset's current version (its build's fingerprint), which new "
        "jobs read; null when not known.",
    )
    versions_in_use: list[str] | None = Field(
        default=None,
        description="Older versions of the dataset that running jobs still read (kept "
        "until they end); null when not known.",
    )


class DatasetView(_DatasetEntry):
    """The manifest summary of a dataset that opened, with its storage health."""

    fingerprint: str = Field(description="Identity of this build; changes on every rebuild.")
    tokens: int = Field(description="Tokens in the dataset, EOS tokens included.")
    documents: int = Field(description="Documents in the dataset.")
    dtype: str = Field(description="Token storage type: `uint16` or `uint32`.")
    shards: int = Field(description="Number of shard files.")
    tokenizer: TokenizerView = Field(description="The tokenizer the dataset was prepared with.")
    shuffle_seed: int = Field(description="Seed of the document shuffle done at prepare time.")
    format_version: int = Field(description="Version of the on-disk format.")
    created: str = Field(description="When the dataset was written (ISO 8601, UTC).")


class BrokenDatasetView(_DatasetEntry):
    """A dataset in the store that fails to open and is not served."""

    ok: Literal[False] = Field(description="False: the dataset is not served.")
    status: Literal["unavailable"] = Field(default="unavailable", description=_STATUS)
    error: str = Field(description="Why it is refused (store paths only for the admin).")


class ScheduleSegmentView(_Model):
    """One segment of a mixture's schedule."""

    start: int = Field(description="Stream position where the segment's weights begin.")
    weights: dict[str, int] = Field(
        description="Reduced integer weight per dataset name (absent: weight 0); a period "
        "of `sum(weights)` rows holds each source exactly its weight times."
    )


class SourceProgressView(_Model):
    """One source of a mixture job: its plan and how far the job has read it."""

    name: str = Field(description="Dataset name of the source.")
    fingerprint: str = Field(description="The source's build the job reads.")
    epoch_windows: int = Field(description="Windows (rows) in one epoch of the source.")
    region_windows: int = Field(
        description="Windows per region of the source's block shuffle (0: global shuffle)."
    )
    block_regions: int = Field(
        description="Regions per block of the source's block shuffle (0: global shuffle)."
    )
    rows_served: int = Field(
        description="Rows of the stream up to the job's served position that come from "
        "this source (the source's own stream position)."
    )
    epoch: int = Field(description="The source's own epoch at the job's served position.")
    consumed_rows: int | None = Field(
        description="Rows of this source up to the consumed position; null until the "
        "trainer reports one."
    )
    consumed_epoch: int | None = Field(
        description="The source's own epoch at the consumed position; null until the "
        "trainer reports one."
    )


class JobView(_Model):
    """One training run as the server sees it.

    Two positions, side by side: ``position`` is how far the server has *sent* (the
    trainer's prefetch runs ahead of its training loop by the request window plus the
    DataLoader's prefetch); ``consumed_position`` is how far the training loop has
    *taken* batches, as the trainer reported it. Positions count windows (rows, samples
    of all ranks) from the start of the stream; epochs are laid end to end.

    The list is the data plane's snapshot (rebuilt every 0.5 s: ``snapshot_age_s`` says
    how old). A job whose trainer left has ``ended`` set and keeps its counters until it
    is forgotten (``--job-ttl-s``); ``?forgotten=true`` also lists the last 64 forgotten
    jobs with their final counters (``forgotten: true``).
    """

    id: str = Field(
        description="Job id, derived from the tenant, the dataset build and the plan inputs."
    )
    tenant: str = Field(description="Tenant that runs the job (`anonymous` on an open server).")
    dataset: str = Field(
        description="Name of the dataset the job reads; for a mixture its sources' names "
        "joined by `+` (cut near 200 characters, ending `+...(N more)`: see `sources`)."
    )
    kind: Literal["dataset", "mixture"] = Field(
        description="`dataset`: the job reads one dataset; `mixture`: several (`sources`, "
        "`schedule`, `current_weights`)."
    )
    run: str | None = Field(
        description="The launch's run id (one per training launch, shared by its ranks); "
        "null for a client from before run ids."
    )
    seq_len: int = Field(description="Tokens per row, before the one-token shift.")
    batch_size: int = Field(description="Rows per batch of one rank.")
    seed: int = Field(description="Seed of the job's sampling plan.")
    world_size: int = Field(description="Number of ranks sharing the plan.")
    weight: float = Field(description="The tenant's fair-share weight.")
    workers: int = Field(
        description="DataLoader workers attached now (distinct rank and worker indices)."
    )
    requests: int = Field(description="Requests answered.")
    batches_served: int = Field(description="Batches sent.")
    tokens_served: int = Field(description="Tokens sent.")
    bytes_fetched: int = Field(
        0,
        description="Bytes the server's piece cache fetched from object storage for this "
        "job (its requests' misses and its plan's prefetch; 0 for a local store).",
    )
    fetched_per_served: float | None = Field(
        None,
        description="`bytes_fetched` per byte served: about 1 or less for a block shuffle "
        "or a cache that holds the dataset; far more is read amplification (a global "
        "shuffle through a small cache). Null before anything was served.",
    )
    tokens_per_s: float = Field(
        description="Recent rate of tokens sent per second (`seq_len + 1` per window)."
    )
    position: int = Field(
        description="Furthest stream position served (prefetched by the trainer), in windows "
        "(rows) since the start of the stream; epochs are laid end to end."
    )
    epoch: int = Field(description="Epoch of the served position.")
    consumed_position: int | None = Field(
        description="Stream position up to which the trainer's training loop has taken "
        "batches, as last reported (it lags by at most the request window plus the "
        "DataLoader's prefetch while the loop runs, and is exact a few seconds after it "
        "pauses or ends); null until the trainer reports one."
    )
    consumed_epoch: int | None = Field(
        description="Epoch of the consumed position; null until the trainer reports one."
    )
    consumed_tokens_per_s: float = Field(
        description="Recent rate of input tokens the trainer consumed per second, all ranks "
        "together (`seq_len` per window: the tokens its model reads)."
    )
    epoch_windows: int = Field(
        description="Windows (rows) in one epoch of this job's plan, so the current epoch of "
        "a position ends at `(epoch + 1) * epoch_windows`. For a mixture: the sum over its "
        "sources (a nominal epoch; each source's own epoch is in `source_progress`)."
    )
    shuffle: Literal["global", "block"] = Field(
        description="The order: `global` (all windows shuffled per epoch) or `block` (regions "
        "of consecutive windows shuffled a block of regions at a time)."
    )
    region_windows: int = Field(
        description="Windows per region of the block shuffle (0: global shuffle, or a "
        "mixture: see `source_progress`)."
    )
    block_regions: int = Field(
        description="Regions per block of the block shuffle (0: global shuffle, or a "
        "mixture: see `source_progress`)."
    )
    sources: list[str] | None = Field(
        description="A mixture's datasets in source-index order; null for one dataset."
    )
    schedule: list[ScheduleSegmentView] | None = Field(
        description="A mixture's schedule, segment by segment; null for one dataset."
    )
    current_weights: dict[str, int] | None = Field(
        description="A mixture's weights in effect at the served position (the schedule "
        "segment that holds `position`; reduced integers, absent: 0); null for one dataset."
    )
    source_progress: list[SourceProgressView] | None = Field(
        description="A mixture's sources (in `sources` order): rows served and consumed and "
        "their own epochs; null for one dataset."
    )
    idle_s: float = Field(description="Seconds since the job's last request.")
    retransmits: int = Field(description="Requests for data that was already sent once.")
    queued: int = Field(description="Requests waiting for their turn.")
    created: float = Field(description="When the job was first seen (Unix time, seconds).")
    ended: float | None = Field(
        description="When the job's last connection left (bye, or silence past the peer "
        "timeout; Unix time, seconds); null while a worker is attached."
    )
    forgotten: bool = Field(
        description="True for a job the data plane no longer holds (its TTL ran out, or a "
        "new job of its tenant needed the room): listed with `?forgotten=true`, its "
        "counters are final. A trainer resuming it starts a new entry."
    )
    resumed_at: int | None = Field(
        description="The consumed position the job's first request to this server "
        "reported, when above 0: its training loop took batches before this server served "
        "it any (a failover from another replica, a restart of this server, or a resume "
        "from a checkpoint); null otherwise."
    )
    resumed_clients: int = Field(
        description="Clients (DataLoader workers) whose first request for this job to this "
        "server reported a consumed position above 0: they were training before, mostly "
        "failovers from another replica (a restart of this server or a resume from a "
        "checkpoint look the same). Summed over jobs in the `clients_resumed` counter."
    )
    skipped: list[list[int]] = Field(
        default_factory=list,
        description="Stream ranges the run skipped on purpose at a resume "
        "(`load_state_dict(state, skip_batches=N)`, after a loss spike), as "
        "`[position, samples]` pairs in the order they were skipped: the positions "
        "`position` to `position + samples - 1` were never served to training. Empty "
        "for a run that skipped nothing (or a client from before skipped ranges).",
    )
    snapshot_age_s: float | None = Field(
        default=None,
        description="Seconds since the data plane took the snapshot this view comes from "
        "(refreshed every 0.5 s); null before the first one.",
    )


class LimitsView(_Model):
    """What one client may ask of the server; beyond any of these it gets an error."""

    max_message_bytes: int = Field(description="Largest inbound ZeroMQ message, in bytes.")
    max_window: int = Field(description="Most requests one connection may have outstanding.")
    max_chunk_bytes: int = Field(description="Largest chunk one request may produce, in bytes.")
    max_batch_tokens: int = Field(description="Largest batch of one rank, in tokens.")
    max_connections: int = Field(description="Connections attached at once, in total.")
    max_connections_per_tenant: int = Field(description="Connections attached at once, per tenant.")
    max_jobs: int = Field(description="Jobs known at once; idle ones are forgotten first.")
    max_jobs_per_tenant: int = Field(
        description="Jobs one tenant may have at once (unless the tenants file sets its "
        "own); a new job makes room only from its own tenant's idle jobs."
    )


class ConfigView(_Model):
    """The server's settings as shown over HTTP (never a secret)."""

    store: str | None = Field(
        description="Store directory; null unless the caller is the admin (or the server is "
        "open, i.e. single-user)."
    )
    host: str = Field(description="Address the server listens on.")
    zmq_port: int = Field(description="Data port as configured (0: any free).")
    http_port: int = Field(description="HTTP port as configured (0: any free).")
    chunk_bytes: int = Field(description="Target size of one chunk, in bytes.")
    peer_timeout_s: float = Field(description="A silent connection is forgotten after this.")
    job_ttl_s: float = Field(description="A job with no connection is forgotten after this.")
    limits: LimitsView = Field(description="The limits every client is held to.")
    auth: Literal["tenants", "token", "open"] = Field(
        description="Authentication: a tenants file, one shared token, or none."
    )
    curve: bool = Field(description="True when data traffic is CURVE-encrypted.")
    max_tokens_per_s: int = Field(description="Cap on tokens sent per second; 0 for none.")
    cache_dir: str | None = Field(
        default=None,
        description="Piece cache directory of an s3:// store; null for a local store, or "
        "unless the caller is the admin.",
    )
    cache_size: int | None = Field(
        default=None, description="Bytes the piece cache may hold; null for a local store."
    )


class CacheView(_Model):
    """The piece cache of a store in object storage (see `tokenfeed_server.store.cache`)."""

    capacity_bytes: int = Field(description="Most bytes the cache may hold (--cache-size).")
    capacity_effective_bytes: int = Field(
        default=0,
        description="The capacity in effect: lower than --cache-size while the disk is "
        "nearly full (the cache shrinks instead of failing jobs; it grows back).",
    )
    size_bytes: int = Field(description="Bytes of verified pieces in the cache now.")
    reserved_bytes: int = Field(
        description="Bytes in use or reserved: pieces held, being fetched, or queued; "
        "never more than the capacity."
    )
    pieces: int = Field(description="Verified pieces in the cache now.")
    fetching: int = Field(description="Pieces being fetched now.")
    retrying: int = Field(
        default=0, description="Of those, pieces whose fetch waits for unreachable storage."
    )
    admission_queue: int = Field(
        description="Requests waiting for room in the cache before their pieces are fetched."
    )
    wanted_pieces: int = Field(description="Pieces the prefetch plan wants now.")
    hits: int = Field(description="Piece look-ups of reads that found the piece cached.")
    misses: int = Field(description="Piece look-ups of reads that had to wait for a fetch.")
    fetches: int = Field(description="Pieces fetched from object storage.")
    prefetches: int = Field(description="Of those, fetched ahead for the prefetch plan.")
    bytes_fetched: int = Field(description="Bytes fetched from object storage.")
    fetch_errors: int = Field(description="Failed GET attempts (each retried with backoff).")
    checksum_mismatches: int = Field(
        description="Fetched pieces whose bytes did not match the manifest (fetched again)."
    )
    unreadable: int = Field(
        description="Pieces given up on after the retries (their requests got an error)."
    )
    evictions: int = Field(description="Pieces evicted to make room.")
    verified_local: int = Field(
        description="Pieces found on disk at start-up and reused after hashing them."
    )
    fetch_latency_p50_s: float | None = Field(
        description="Median seconds per piece fetch (last 2048 fetches); null before any."
    )
    fetch_latency_p99_s: float | None = Field(
        description="99th percentile seconds per piece fetch (last 2048); null before any."
    )


class StatusView(_Model):
    """The server instance, its settings, connection count and event counters."""

    version: str = Field(description="tokenfeed-server version.")
    server: str = Field(description="Id of this server process; changes on every restart.")
    ready: bool = Field(description="True while serving.")
    started: float = Field(description="When this server process started (Unix time, seconds).")
    uptime_s: float = Field(description="Seconds since this server process started.")
    connections: int | None = Field(
        description="Data connections attached now (null for a caller who does not see "
        "every job: a tenant or no token on an authenticated server)."
    )
    unattached: int | None = Field(
        default=None,
        description="(null, as connections) Data connections open that have not said hello "
        "yet; closed after --hello-timeout-s, at most --max-unattached-connections.",
    )
    rings: int | None = Field(
        default=None,
        description="(null, as connections) Shared-memory rings open now: one per data "
        "connection of a trainer on the server's host that took one (see --ring-door).",
    )
    counters: dict[str, int] | None = Field(
        description="Data plane event counts since start (null, as connections)."
    )
    config: ConfigView = Field(description="The settings in effect.")
    cache: CacheView | None = Field(
        default=None, description="The piece cache of an s3:// store; null for a local store."
    )
    memory: dict[str, int] | None = Field(
        default_factory=dict,
        description="(null, as connections) Bytes the server holds by owner: row_buffers, "
        "window_blocks, "
        "mixture_tables (store), jobs, connections and ended_jobs (data plane records and "
        "the final views of the last 64 forgotten jobs, estimated).",
    )
