"""The settings layer: one declaration per setting, and the typed objects built from them.

Each setting is declared once, as a field of a frozen pydantic model (type, valid range,
help, default). From that declaration come its command-line flag (``--<name>``), its
environment twin (``TOKENFEED_<NAME>``, or ``TOKENFEED_PREPARE_<NAME>`` for prepare), the
default and the range that ``--help`` shows. :func:`add_arguments` declares the flags of
a model; :func:`load` merges flags > environment > defaults (pydantic-settings: values given
at construction beat the environment) and returns the model, validated. The CLI is the one
place that turns a refusal into a :class:`~tokenfeed.errors.ConfigError` (with
:func:`explain`: one line naming the flag, its twin and the valid range).

Only :func:`load` reads the environment: a :class:`ServerConfig` built in Python is exactly
what its arguments say.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from tokenfeed.protocol.constants import TOKEN, TOKEN_RULE
from tokenfeed_server.flags import (
    Setting,
    Spelling,
    add_arguments,
    as_path_text,
    as_size,
    explain,
    load,
    lowercase,
    parse_size,
    settings_of,
)

__all__ = [
    "parse_size",
    "DEFAULT_HTTP_PORT",
    "DEFAULT_ZMQ_PORT",
    "CacheSettings",
    "Limits",
    "GcSettings",
    "MemorySettings",
    "PrepareSettings",
    "ServerConfig",
    "StorageSettings",
    "Setting",
    "Spelling",
    "add_arguments",
    "explain",
    "load",
    "settings_of",
]

DEFAULT_ZMQ_PORT = 7400
DEFAULT_HTTP_PORT = 7401

Port = Annotated[int, Field(ge=0, le=65535)]


def token_rule(value: str | None) -> str | None:
    """A token as every port accepts it (see :data:`tokenfeed.protocol.TOKEN`); the
    refusal never shows the token."""
    if value is not None and not TOKEN.fullmatch(value):
        raise ValueError(f"a token must be {TOKEN_RULE}")
    return value


def read_token_file(path: Path) -> str:
    """The token in ``path`` (surrounding whitespace and a final newline stripped)."""
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the token file {path}: {exc}") from None


LogLevel = Annotated[Literal["debug", "info", "warning", "error"], BeforeValidator(lowercase)]


class Limits(BaseModel):
    """What one client may ask of the server. Beyond any of these: an ``err`` naming it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_message_bytes: int = Field(
        default=64 * 1024,
        ge=1,
        description="largest inbound message; libzmq drops a sender of more",
    )
    max_window: int = Field(
        default=16, ge=1, description="requests one connection may have in flight"
    )
    max_chunk_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1, description="largest chunk one request may produce"
    )
    max_batch_tokens: int = Field(
        default=1 << 24, ge=1, description="largest batch of one rank in tokens (batch*(seq_len+1))"
    )
    max_connections: int = Field(default=4096, ge=1, description="connections attached at once")
    max_connections_per_tenant: int = Field(
        default=1024, ge=1, description="connections one tenant may have attached at once"
    )
    max_jobs: int = Field(
        default=256,
        ge=1,
        description="jobs known at once; a tenant's own idle jobs make room for its new one, "
        "never another tenant's",
    )
    max_jobs_per_tenant: int = Field(
        default=64,
        ge=1,
        description="jobs one tenant may have at once (a tenants file may set its own); "
        "its idle ones are forgotten first",
    )

    def as_dict(self) -> dict[str, int]:
        """The limits as a plain mapping (for /v1/limits and the start-up log)."""
        return {name: int(value) for name, value in self.model_dump().items()}


class CacheSettings(BaseModel):
    """How the piece cache of an ``s3://`` store fetches, retries and prefetches."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cache_fetchers: int = Field(
        default=16, ge=1, description="threads fetching pieces from object storage"
    )
    cache_fetch_attempts: int = Field(
        default=3,
        ge=1,
        description="GETs of a piece in all after an error that is not a storage fault (refused "
        "credentials, a truncated object) before it is reported unreadable; unreachable "
        "storage is retried for --storage-retry-s instead",
    )
    cache_mismatch_attempts: int = Field(
        default=3,
        ge=1,
        description="fetches of a piece failing its checksum before the bucket copy is "
        "reported bad",
    )
    cache_backoff_s: float = Field(
        default=0.1, ge=0, description="seconds before the first retry of a fetch (doubled at each)"
    )
    cache_failure_ttl_s: float = Field(
        default=5.0,
        ge=0,
        description="seconds a piece found missing or damaged is reported at once instead of "
        "fetched again (unreachable storage is never remembered: see --storage-retry-s)",
    )
    cache_max_open: int = Field(default=1024, ge=16, description="piece files kept open at most")
    max_partial_read_bytes: Annotated[int, BeforeValidator(as_size)] = Field(
        default=64 << 20,  # cache_rounds.DEFAULT_MAX_PARTIAL_READ_BYTES
        ge=0,
        description="bytes of rows kept, per remote dataset, for requests read in rounds "
        "because their pieces do not fit in half the cache at once; beyond it the oldest "
        "such request starts over (slower, same data)",
    )
    prefetch_blocks: int = Field(
        default=2, ge=1, description="blocks of each active job's plan fetched ahead"
    )
    prefetch_share: float = Field(
        default=0.75, gt=0, le=1, description="largest share of the cache the prefetch may want"
    )
    prefetch_idle_s: float = Field(
        default=120.0, gt=0, description="no prefetch for a job that asked nothing this long"
    )
    prefetch_refresh_s: float = Field(
        default=5.0,
        gt=0,
        description="seconds between two hand-overs of an unchanged prefetch plan (refetches "
        "what was evicted)",
    )

    def cache_options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`~tokenfeed_server.store.cache.PieceCache`."""
        return {
            "fetchers": self.cache_fetchers,
            "attempts": self.cache_fetch_attempts,
            "mismatch_attempts": self.cache_mismatch_attempts,
            "backoff_s": self.cache_backoff_s,
            "failure_ttl_s": self.cache_failure_ttl_s,
            "max_open": self.cache_max_open,
            "max_partial_read_bytes": self.max_partial_read_bytes,
        }

    def prefetch_options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`~tokenfeed_server.store.prefetch.Prefetcher`."""
        return {
            "blocks": self.prefetch_blocks,
            "share": self.prefetch_share,
            "active_s": self.prefetch_idle_s,
            "refresh_s": self.prefetch_refresh_s,
        }


class StorageSettings(BaseModel):
    """How the server rides out object storage faults and tells ``gc`` what it reads."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    storage_retry_s: float = Field(
        default=900.0,
        gt=0,
        description="seconds a transient object storage fault (refused, reset, timeout, "
        "5xx, throttling) is retried before the jobs that need it fail",
    )
    lease_s: float = Field(
        default=600.0,
        gt=0,
        description="seconds a lease on the dataset versions this server's jobs read stays "
        "valid without a refresh (gc never deletes what a valid lease holds)",
    )
    read_only_store: bool = Field(
        default=False,
        description="write nothing to the store (credentials without write access): no "
        "leases, so gc falls back to --grace for versions in use",
    )


class MemorySettings(BaseModel):
    """What the server keeps in memory between requests (see :mod:`~.store.memory`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    row_pool_bytes: Annotated[int, BeforeValidator(as_size)] = Field(
        default=256 << 20, ge=0, description="bytes of row buffers (and views) kept for reuse"
    )
    window_blocks_bytes: Annotated[int, BeforeValidator(as_size)] = Field(
        default=64 << 20,
        ge=0,
        description="bytes of stream order blocks kept for reuse (128 KiB per job's current block)",
    )
    memory_idle_s: float = Field(
        default=60.0, gt=0, description="free kept buffers and blocks unused this long"
    )
    malloc_arenas: int = Field(
        default=2, ge=0, description="glibc malloc arenas at most (0: glibc's choice)"
    )


class ServerConfig(BaseModel):
    """Everything ``tokenfeed-server serve`` needs; built once at the edge, then read-only."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    #: environment twins are this prefix + the field's name in capitals
    ENV_PREFIX: ClassVar[str] = "TOKENFEED_"

    # A string, not a Path: a Path would collapse the '//' of s3://bucket/prefix.
    store: Annotated[str, BeforeValidator(as_path_text)] = Field(
        min_length=1, description="store directory, or s3://BUCKET/PREFIX"
    )
    cache_dir: Path | None = Field(
        default=None,
        description="directory of the local piece cache (required for an s3:// store)",
    )
    cache_size: Annotated[int | None, BeforeValidator(as_size)] = Field(
        default=None,
        ge=1,
        description="bytes the piece cache may hold, e.g. 20GiB or 50GB (required for an "
        "s3:// store)",
    )
    remote_scan_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="seconds between two polls of an s3:// store's catalog (new or replaced "
        "datasets; a store without a catalog is listed every 6th poll)",
    )
    cache: CacheSettings = Field(default=CacheSettings())  # frozen: safe to share
    memory: MemorySettings = Field(default=MemorySettings())  # frozen: safe to share
    storage: StorageSettings = Field(default=StorageSettings())  # frozen: safe to share
    host: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="address to listen on (a token is required unless loopback)",
    )
    zmq_port: Port = Field(default=DEFAULT_ZMQ_PORT, description="data port (0: any free port)")
    http_port: Port = Field(default=DEFAULT_HTTP_PORT, description="HTTP port (0: any free port)")
    limits: Limits = Field(default=Limits())  # frozen: safe to share
    # the server tells clients how many batches fit in one chunk of this size; 4 MiB: a
    # chunk's fixed cost (scheduling, the header, a send, a wake-up on each side) was a
    # quarter of the server's CPU per token at 1 MiB (benchmarks/bench_loaders.py)
    chunk_bytes: int = Field(default=4 << 20, ge=1, description="target size of one chunk in bytes")
    peer_timeout_s: float = Field(
        default=60.0, gt=0, description="forget a connection silent for this many seconds"
    )
    job_ttl_s: float = Field(
        default=600.0, gt=0, description="forget a job with no connection after this many seconds"
    )
    hello_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="close a data connection that has not said hello this many seconds "
        "after it was accepted",
    )
    max_unattached_connections: int = Field(
        default=1024,
        ge=1,
        description="data connections open at once that have not said hello; more are "
        "closed at once",
    )
    verify_checksums: bool = Field(
        default=False, description="hash every shard at start-up (slow on big stores)"
    )
    max_open_shards: int = Field(
        default=0,
        ge=0,
        description="shard files of local datasets open at once; the least recently used "
        "is closed to open another (0: 1024, or a quarter of the open-file limit if lower)",
    )
    ring_door: str = Field(
        default="auto",
        min_length=1,
        description="Unix socket where trainers on this host fetch their shared-memory "
        "rings ('auto': in a private temporary directory; a path: e.g. on a volume shared "
        "with trainer containers; 'off': every chunk over TCP)",
    )
    ring_size: Annotated[int, BeforeValidator(as_size)] = Field(
        default=32 << 20,  # room for several chunks of the default --chunk-bytes
        ge=1 << 20,
        description="bytes of one connection's shared-memory ring (memory of the trainer's "
        "and the server's, once written; a chunk that does not fit goes over TCP)",
    )
    log_level: LogLevel = Field(default="info", description="log level")
    tenants_file: Annotated[Path | None, Spelling(flag="--tenants")] = Field(
        default=None, description="TOML tenants file: tokens, datasets, caps, weights"
    )
    token: Annotated[str | None, AfterValidator(token_rule)] = Field(
        default=None,
        repr=False,
        description="one shared client token (a secret; prefer TOKENFEED_TOKEN or "
        "--token-file to the command line, which other users see in the process list)",
    )
    token_file: Path | None = Field(
        default=None, description="file holding the shared client token (instead of --token)"
    )
    admin_token: Annotated[str | None, AfterValidator(token_rule)] = Field(
        default=None, repr=False, description="token that sees every job and dataset over HTTP"
    )
    admin_token_file: Path | None = Field(
        default=None, description="file holding the admin token (instead of --admin-token)"
    )
    insecure: bool = Field(
        default=False, description="serve without authentication on a non-loopback address (loudly)"
    )
    curve_secret_key_file: Annotated[Path | None, Spelling(flag="--curve-secret-key")] = Field(
        default=None,
        description="CURVE secret key file (tokenfeed-server keygen): encrypts traffic",
    )
    max_tokens_per_s: int = Field(
        default=0, ge=0, description="cap on the tokens sent per second (0: none)"
    )
    http_header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="seconds a client has to send a request's headers on the HTTP port",
    )
    http_max_connections: int = Field(
        default=512, ge=1, description="HTTP connections open at once; more are closed at once"
    )
    http_allowed_hosts: str | None = Field(
        default=None,
        description="Host headers the HTTP port answers, comma-separated (default: on "
        "loopback only localhost, 127.0.0.1 and ::1, against DNS rebinding; else any)",
    )
    tls_cert_file: Path | None = Field(
        default=None,
        description="PEM certificate: serve HTTPS on the HTTP port (with --tls-key-file)",
    )
    tls_key_file: Path | None = Field(
        default=None, description="PEM private key of --tls-cert-file"
    )

    @model_validator(mode="after")
    def _tokens_from_files(self) -> ServerConfig:
        # A file's token replaces the field (the model is frozen: set it the one way
        # pydantic allows during validation); the same rule then applies to it.
        for name in ("token", "admin_token"):
            path = getattr(self, f"{name}_file")
            if path is None:
                continue
            flag = "--" + name.replace("_", "-")
            if getattr(self, name) is not None:
                raise ValueError(f"give {flag} or {flag}-file, not both")
            object.__setattr__(self, name, token_rule(read_token_file(path)))
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> ServerConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("give --tls-cert-file and --tls-key-file together")
        return self

    def is_loopback(self) -> bool:
        """True when the server listens on loopback only."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def public_view(self) -> dict[str, Any]:
        """The settings to log at start-up and to show over HTTP (never a secret)."""
        return {
            "store": str(self.store),
            "cache_dir": str(self.cache_dir) if self.cache_dir is not None else None,
            "cache_size": self.cache_size,
            "host": self.host,
            "zmq_port": self.zmq_port,
            "http_port": self.http_port,
            "chunk_bytes": self.chunk_bytes,
            "peer_timeout_s": self.peer_timeout_s,
            "job_ttl_s": self.job_ttl_s,
            "limits": self.limits.as_dict(),
            "auth": self.auth_mode(),
            "curve": self.curve_secret_key_file is not None,
            "max_tokens_per_s": self.max_tokens_per_s,
        }

    def auth_mode(self) -> str:
        """``tenants``, ``token``, or ``open`` (no authentication)."""
        if self.tenants_file is not None:
            return "tenants"
        return "token" if self.token else "open"


class PrepareSettings(BaseModel):
    """The settings of ``tokenfeed-server prepare`` (the CLI turns them into a PrepareConfig)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    ENV_PREFIX: ClassVar[str] = "TOKENFEED_PREPARE_"

    # a string, not a Path: Path("s3://b/p") would collapse to "s3:/b/p"
    store: Annotated[str, Spelling(env="TOKENFEED_STORE")] = Field(
        min_length=1, description="store directory, or s3://BUCKET/PREFIX"
    )
    dataset: str = Field(min_length=1, description="dataset name")
    tokenizer: str = Field(
        default="byte", min_length=1, description="byte, bpe:VOCAB, or the path of a tokenizer.json"
    )
    eos_token: str | None = Field(
        default=None, description="EOS token of a tokenizer.json (default: found by name)"
    )
    seed: int = Field(default=0, ge=0, lt=1 << 64, description="seed of the global pre-shuffle")
    text_field: str = Field(
        default="text", min_length=1, description="JSONL field / parquet column"
    )
    skip_bad: bool = Field(default=False, description="skip and count bad records")
    overwrite: bool = Field(default=False, description="replace an existing dataset")
    memory_mb: float = Field(default=512.0, gt=0, description="memory budget in MiB")
    workers: int = Field(
        default=0, ge=0, description="tokenizer processes (0: tokenize in this process)"
    )
    shard_tokens: int = Field(default=1 << 26, ge=1, description="tokens per shard")
    bpe_train_mb: float = Field(
        default=64.0, gt=0, description="cap on the MiB of text that bpe:VOCAB is trained on"
    )
    no_progress: bool = Field(default=False, description="no progress bar or progress lines")
    engine: Literal["local", "ray"] = Field(
        default="local",
        description="where to tokenize and shuffle: this process, or a Ray cluster "
        "(pip install 'tokenfeed-server[ray]'); the same bytes either way",
    )
    ray_address: str | None = Field(
        default=None,
        min_length=1,
        description="Ray cluster to join with --engine ray (else RAY_ADDRESS, "
        "else a local cluster on --workers CPUs, 0: all)",
    )
    scratch_dir: Path | None = Field(
        default=None,
        description="local directory for the work of a prepare from or into s3:// "
        "(downloaded inputs, the dataset before upload; default: the system temp dir)",
    )


class GcSettings(BaseModel):
    """The settings of ``tokenfeed-server gc``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    ENV_PREFIX: ClassVar[str] = "TOKENFEED_GC_"

    store: Annotated[str, Spelling(env="TOKENFEED_STORE")] = Field(
        min_length=1, description="store: s3://BUCKET/PREFIX, or a directory"
    )
    dataset: str | None = Field(
        default=None, min_length=1, description="only this dataset (default: every one)"
    )
    grace_s: Annotated[float, Spelling(flag="--grace")] = Field(
        default=3600.0,
        ge=0,
        description="besides the versions in use (server leases) and the newest "
        "--keep-versions, keep a version this many seconds after it stopped being current, "
        "and an unreferenced object until it is this old",
    )
    keep_versions: int = Field(
        default=3,
        ge=1,
        description="versions of each dataset kept, newest first, besides those a server's "
        "jobs hold",
    )
    dry_run: bool = Field(default=False, description="list what would be deleted; delete nothing")
