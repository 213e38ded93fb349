"""The server's one configuration object, built once at the edge (the CLI) and passed down.

Precedence is flags > ``TOKENFEED_*`` environment variables > the defaults below; the CLI
does the merging, so nothing here reads the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenfeed.errors import ConfigError

DEFAULT_ZMQ_PORT = 7400
DEFAULT_HTTP_PORT = 7401


@dataclass(frozen=True)
class Limits:
    """What one client may ask of the server. Beyond any of these: an ``err`` naming it."""

    #: largest inbound ZeroMQ message; larger ones drop the connection inside libzmq
    max_message_bytes: int = 64 * 1024
    #: most requests one connection may have outstanding (its credit window)
    max_window: int = 16
    #: largest chunk one request may produce
    max_chunk_bytes: int = 16 * 1024 * 1024
    #: largest batch of one rank, in tokens (batch_size * (seq_len + 1))
    max_batch_tokens: int = 1 << 24
    #: connections attached at once, in total and per tenant
    max_connections: int = 4096
    max_connections_per_tenant: int = 1024
    #: jobs known at once; idle ones are forgotten first to make room
    max_jobs: int = 256

    def as_dict(self) -> dict[str, int]:
        """The limits as a plain mapping (for /v1/limits and the start-up log)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``tokenfeed-server serve`` needs."""

    store: Path
    host: str = "127.0.0.1"
    zmq_port: int = DEFAULT_ZMQ_PORT
    http_port: int = DEFAULT_HTTP_PORT
    limits: Limits = field(default_factory=Limits)
    #: target size of one chunk; the server tells clients how many batches fit in it
    chunk_bytes: int = 1 << 20
    #: a connection silent for this long is forgotten (its queued requests dropped)
    peer_timeout_s: float = 60.0
    #: a job with no connection for this long disappears from /v1/jobs
    job_ttl_s: float = 600.0
    verify_checksums: bool = False
    log_level: str = "info"
    #: TOML file of tenants (tokens, datasets, caps, weights); see tokenfeed_server.auth
    tenants_file: Path | None = None
    #: one shared token for every client (instead of a tenants file); a secret
    token: str | None = field(default=None, repr=False)
    #: token that sees every job and dataset over HTTP; a secret
    admin_token: str | None = field(default=None, repr=False)
    #: serve without authentication on a non-loopback address (loudly)
    insecure: bool = False
    #: file with the server's CURVE secret key (``tokenfeed-server keygen``): encrypts
    curve_secret_key_file: Path | None = None
    #: cap on the tokens the server sends per second, 0 for none (shares a busy box)
    max_tokens_per_s: int = 0

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


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``tokenfeed-server serve``; each falls back to ``TOKENFEED_<FLAG>``."""
    parser.add_argument("--store", type=Path, help="store directory [TOKENFEED_STORE]")
    parser.add_argument("--host", help="address to listen on [TOKENFEED_HOST, 127.0.0.1]")
    parser.add_argument(
        "--zmq-port",
        type=int,
        help=f"data port, 0 = any free [TOKENFEED_ZMQ_PORT, {DEFAULT_ZMQ_PORT}]",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        help=f"HTTP port, 0 = any free [TOKENFEED_HTTP_PORT, {DEFAULT_HTTP_PORT}]",
    )
    parser.add_argument("--chunk-bytes", type=int, help="target chunk size [1048576]")
    parser.add_argument(
        "--verify-checksums",
        action="store_true",
        default=None,
        help="hash every shard at start-up (slow on big stores)",
    )
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--peer-timeout-s", type=float, help="forget a silent connection after this long [60]"
    )
    parser.add_argument(
        "--job-ttl-s", type=float, help="forget a job with no connection after this long [600]"
    )
    parser.add_argument(
        "--tenants",
        type=Path,
        dest="tenants_file",
        help="TOML tenants file [TOKENFEED_TENANTS_FILE]",
    )
    parser.add_argument("--token", help="one shared client token [TOKENFEED_TOKEN]")
    parser.add_argument("--admin-token", help="HTTP admin token [TOKENFEED_ADMIN_TOKEN]")
    parser.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="allow no authentication on a non-loopback address",
    )
    parser.add_argument(
        "--curve-secret-key",
        type=Path,
        dest="curve_secret_key_file",
        help="CURVE secret key file, encrypts traffic [TOKENFEED_CURVE_SECRET_KEY_FILE]",
    )
    parser.add_argument(
        "--max-tokens-per-s", type=int, help="cap on tokens sent per second, 0 = none [0]"
    )
    for name, default in Limits().as_dict().items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            dest=name,
            help=f"limit [TOKENFEED_{name.upper()}, {default}]",
        )


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> ServerConfig:
    """Merge flags > environment > defaults into one ServerConfig."""

    def pick(name: str, default: Any, kind: Callable[[str], Any] = str) -> Any:
        value = getattr(args, name, None)
        if value is not None:
            return value
        raw = environ.get(f"TOKENFEED_{name.upper()}")
        if raw is None or raw == "":
            return default
        try:
            return kind(raw)
        except ValueError:
            raise ConfigError(f"TOKENFEED_{name.upper()}={raw!r} is not a valid {name}") from None

    store = pick("store", None, Path)
    if store is None:
        raise ConfigError("no store given: pass --store DIR or set TOKENFEED_STORE")
    defaults = ServerConfig(store=store)
    limits = Limits(
        **{name: pick(name, default, int) for name, default in Limits().as_dict().items()}
    )
    for name, value in limits.as_dict().items():
        if value < 1:
            raise ConfigError(f"limit {name} must be >= 1, got {value}")
    return ServerConfig(
        store=store,
        host=pick("host", defaults.host),
        zmq_port=pick("zmq_port", defaults.zmq_port, int),
        http_port=pick("http_port", defaults.http_port, int),
        limits=limits,
        chunk_bytes=pick("chunk_bytes", defaults.chunk_bytes, int),
        peer_timeout_s=pick("peer_timeout_s", defaults.peer_timeout_s, float),
        job_ttl_s=pick("job_ttl_s", defaults.job_ttl_s, float),
        verify_checksums=bool(pick("verify_checksums", False, _flag)),
        log_level=pick("log_level", defaults.log_level),
        tenants_file=pick("tenants_file", None, Path),
        token=pick("token", None) or None,
        admin_token=pick("admin_token", None) or None,
        insecure=bool(pick("insecure", False, _flag)),
        curve_secret_key_file=pick("curve_secret_key_file", None, Path),
        max_tokens_per_s=pick("max_tokens_per_s", 0, int),
    )


def _flag(raw: str) -> bool:
    if raw.lower() in {"1", "true", "yes", "on"}:
        return True
    if raw.lower() in {"0", "false", "no", "off"}:
        return False
    raise ValueError(raw)
