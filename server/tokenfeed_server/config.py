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

import argparse
import functools
import ipaddress
import os
import re
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union, cast, get_args, get_origin

import annotated_types
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

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
    "Setting",
    "Spelling",
    "add_arguments",
    "explain",
    "load",
    "settings_of",
]

DEFAULT_ZMQ_PORT = 7400
DEFAULT_HTTP_PORT = 7401

Model = TypeVar("Model", bound=BaseModel)


@dataclass(frozen=True)
class Spelling:
    """Field metadata: a flag or variable name other than the one the field's name gives."""

    flag: str | None = None
    env: str | None = None


def _lower(value: object) -> object:
    return value.lower() if isinstance(value, str) else value


_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?[bB]|[bB])?\s*")
_SIZE_UNITS = {
    **{"": 1, "b": 1},
    **{u + "b": 1000 ** (i + 1) for i, u in enumerate("kmgt")},
    **{u + "ib": 1024 ** (i + 1) for i, u in enumerate("kmgt")},
}


def parse_size(text: str | int) -> int:
    """Bytes from ``123``, ``64MB`` (powers of 1000) or ``64MiB`` (powers of 1024).

    Raises ValueError naming the accepted forms.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a size must be >= 0 bytes, got {text}")
        return text
    match = _SIZE_RE.fullmatch(str(text))
    if match is None:
        raise ValueError(
            f"{text!r} is not a size: give bytes, or a number with KB/MB/GB/TB (powers of "
            "1000) or KiB/MiB/GiB/TiB (powers of 1024), e.g. 20GiB"
        )
    number, unit = match.group(1), (match.group(2) or "").lower()
    if "." in number and unit in ("", "b"):
        raise ValueError(f"{text!r}: a number of bytes must be whole")
    return int(float(number) * _SIZE_UNITS[unit])


def _fspath(value: object) -> object:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _size(value: object) -> object:
    return parse_size(value) if isinstance(value, str) else value


Port = Annotated[int, Field(ge=0, le=65535)]
LogLevel = Annotated[Literal["debug", "info", "warning", "error"], BeforeValidator(_lower)]


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
        default=256, ge=1, description="jobs known at once; idle ones are forgotten first"
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
        default=3, ge=1, description="GETs of a piece in all before it is reported unreadable"
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
        default=30.0,
        ge=0,
        description="seconds an unreadable piece is reported at once instead of fetched again",
    )
    cache_max_open: int = Field(default=1024, ge=16, description="piece files kept open at most")
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
        }

    def prefetch_options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`~tokenfeed_server.store.prefetch.Prefetcher`."""
        return {
            "blocks": self.prefetch_blocks,
            "share": self.prefetch_share,
            "active_s": self.prefetch_idle_s,
            "refresh_s": self.prefetch_refresh_s,
        }


class MemorySettings(BaseModel):
    """What the server keeps in memory between requests (see :mod:`~.store.memory`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    row_pool_bytes: Annotated[int, BeforeValidator(_size)] = Field(
        default=256 << 20, ge=0, description="bytes of row buffers (and views) kept for reuse"
    )
    window_blocks_bytes: Annotated[int, BeforeValidator(_size)] = Field(
        default=16 << 20, ge=0, description="bytes of stream order blocks kept for reuse"
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
    store: Annotated[str, BeforeValidator(_fspath)] = Field(
        min_length=1, description="store directory, or s3://BUCKET/PREFIX"
    )
    cache_dir: Path | None = Field(
        default=None,
        description="directory of the local piece cache (required for an s3:// store)",
    )
    cache_size: Annotated[int | None, BeforeValidator(_size)] = Field(
        default=None,
        ge=1,
        description="bytes the piece cache may hold, e.g. 20GiB or 50GB (required for an "
        "s3:// store)",
    )
    remote_scan_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="seconds between two listings of an s3:// store (new or replaced datasets)",
    )
    cache: CacheSettings = Field(default=CacheSettings())  # frozen: safe to share
    memory: MemorySettings = Field(default=MemorySettings())  # frozen: safe to share
    host: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="address to listen on (a token is required unless loopback)",
    )
    zmq_port: Port = Field(default=DEFAULT_ZMQ_PORT, description="data port (0: any free port)")
    http_port: Port = Field(default=DEFAULT_HTTP_PORT, description="HTTP port (0: any free port)")
    limits: Limits = Field(default=Limits())  # frozen: safe to share
    # the server tells clients how many batches fit in one chunk of this size
    chunk_bytes: int = Field(default=1 << 20, ge=1, description="target size of one chunk in bytes")
    peer_timeout_s: float = Field(
        default=60.0, gt=0, description="forget a connection silent for this many seconds"
    )
    job_ttl_s: float = Field(
        default=600.0, gt=0, description="forget a job with no connection after this many seconds"
    )
    verify_checksums: bool = Field(
        default=False, description="hash every shard at start-up (slow on big stores)"
    )
    log_level: LogLevel = Field(default="info", description="log level")
    tenants_file: Annotated[Path | None, Spelling(flag="--tenants")] = Field(
        default=None, description="TOML tenants file: tokens, datasets, caps, weights"
    )
    token: str | None = Field(
        default=None, min_length=16, repr=False, description="one shared client token (a secret)"
    )
    admin_token: str | None = Field(
        default=None, repr=False, description="token that sees every job and dataset over HTTP"
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
        description="keep unreferenced objects until they, and the manifest that dropped "
        "them, are this many seconds old",
    )
    dry_run: bool = Field(default=False, description="list what would be deleted; delete nothing")


# ---------------------------------------------------------------------------- the machinery


@dataclass(frozen=True)
class Setting:
    """One setting as the command line and the environment see it."""

    #: where the value goes in the model: ``("chunk_bytes",)``, ``("limits", "max_window")``
    path: tuple[str, ...]
    field: FieldInfo
    flag: str
    env: str

    @property
    def name(self) -> str:
        """The field's own name (also the argparse dest)."""
        return self.path[-1]

    @property
    def secret(self) -> bool:
        """Secrets (``repr=False``) are never echoed back in an error."""
        return not self.field.repr

    @property
    def switch(self) -> bool:
        """A boolean: a flag without a value (the environment says 1/0, true/false)."""
        return self.field.annotation is bool

    def metavar(self) -> str:
        """The value's placeholder in ``--help``: ``N``, ``PATH``, ``{debug,info,...}``."""
        kind = _without_none(self.field.annotation)
        if get_origin(kind) is Literal:
            return "{" + ",".join(str(v) for v in get_args(kind)) + "}"
        return {int: "N", float: "N", Path: "PATH"}.get(kind, self.name.upper())

    def valid(self) -> str:
        """What a valid value is, in words: ``an integer in 0..65535``."""
        return _valid(self.field)

    def help(self) -> str:
        """The ``--help`` text: the description, the twin, the range and the real default."""
        default = self.field.get_default(call_default_factory=True)
        if self.field.is_required():
            shown = "required"
        elif self.switch:
            shown = "default off"
        elif default is None:
            shown = "default none"
        else:
            shown = f"default {default}"
        rule = "" if self.switch else f"{self.valid()}; "
        text = f"{self.field.description} [{self.env}; {rule}{shown}]"
        return text.replace("%", "%%")


@functools.cache
def settings_of(model: type[BaseModel]) -> tuple[Setting, ...]:
    """Every setting of ``model``; a nested model's fields are settings of their own."""
    prefix: str = getattr(model, "ENV_PREFIX", "TOKENFEED_")
    found = []
    for path, field in _leaves(model):
        spelling = next((m for m in field.metadata if isinstance(m, Spelling)), Spelling())
        found.append(
            Setting(
                path=path,
                field=field,
                flag=spelling.flag or "--" + path[-1].replace("_", "-"),
                env=spelling.env or prefix + path[-1].upper(),
            )
        )
    return tuple(found)


def _leaves(model: type[BaseModel]) -> Iterator[tuple[tuple[str, ...], FieldInfo]]:
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            for sub, subfield in kind.model_fields.items():
                yield (name, sub), subfield
        else:
            yield (name,), field


def add_arguments(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """Declare one flag per setting of ``model``; an absent flag leaves no attribute."""
    for s in settings_of(model):
        common: dict[str, Any] = {"dest": s.name, "default": argparse.SUPPRESS, "help": s.help()}
        if s.switch:
            parser.add_argument(s.flag, action="store_true", **common)
        else:
            # the raw text goes to pydantic, so a flag and its twin are checked alike
            parser.add_argument(s.flag, metavar=s.metavar(), **common)


def load(model: type[Model], args: argparse.Namespace) -> Model:
    """``model`` from flags > ``TOKENFEED_*`` environment > defaults.

    Raises pydantic's ValidationError for a bad value; :func:`explain` says it in one line.
    """
    settings = settings_of(model)
    given = {s.env: getattr(args, s.name) for s in settings if hasattr(args, s.name)}
    merged = _sources(model)(**given)
    values: dict[str, Any] = {}
    for s in settings:
        node = values
        for part in s.path[:-1]:
            node = node.setdefault(part, {})
        node[s.name] = getattr(merged, s.name)
    return model.model_validate(values)


class _FlagsAndEnvironment(BaseSettings):
    """Values given at construction (the flags) beat the environment, which beats defaults."""

    model_config = SettingsConfigDict(
        frozen=True, extra="forbid", case_sensitive=True, env_ignore_empty=True
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # no .env file, no secrets directory: what is not a flag comes from the environment
        return init_settings, env_settings


@functools.cache
def _sources(model: type[BaseModel]) -> type[BaseSettings]:
    # One flat field per setting, named by its environment variable (the variable is the
    # validation alias, and flags are passed under the same key, so a flag replaces its twin).
    fields: dict[str, Any] = {
        s.name: (s.field.annotation, FieldInfo.merge_field_infos(s.field, validation_alias=s.env))
        for s in settings_of(model)
    }
    return create_model(f"{model.__name__}Sources", __base__=_FlagsAndEnvironment, **fields)


def explain(error: ValidationError, model: type[BaseModel]) -> str:
    """One line for the first problem: ``--chunk-bytes / TOKENFEED_CHUNK_BYTES: must be ...``."""
    by_key = {s.env: s for s in settings_of(model)} | {s.name: s for s in settings_of(model)}
    problems = error.errors()
    first = problems[0]
    more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
    key = first["loc"][0] if first["loc"] else ""
    setting = by_key.get(str(key))
    if setting is None:  # a rule across settings; none is declared today
        return f"invalid settings: {first['msg']}{more}"
    where = f"{setting.flag} / {setting.env}"
    if first["type"] == "missing":
        return f"{where}: required (pass {setting.flag} or set {setting.env}){more}"
    got = "" if setting.secret else f" (got {_shown(first['input'])})"
    return f"{where}: must be {setting.valid()}{got}{more}"


def _shown(value: object) -> str:
    if isinstance(value, str) and value and not any(c.isspace() for c in value):
        return value
    return repr(value)


def _without_none(kind: Any) -> Any:
    """``X`` for ``X | None`` (an optional setting is just absent), else ``kind``."""
    if get_origin(kind) in (Union, types.UnionType):
        return next(k for k in get_args(kind) if k is not type(None))
    return kind


def _valid(field: FieldInfo) -> str:
    kind = _without_none(field.annotation)
    if get_origin(kind) is Literal:
        return "one of " + ", ".join(str(v) for v in get_args(kind))
    if kind is bool:
        return "true or false (1/0, yes/no, on/off)"
    noun = {int: "an integer", float: "a number", Path: "a path"}.get(kind, "a string")
    low = high = None
    words = []
    for rule in field.metadata:
        if isinstance(rule, annotated_types.Ge):
            low = rule.ge
            words.append(f">= {rule.ge}")
        elif isinstance(rule, annotated_types.Gt):
            words.append(f"> {rule.gt}")
        elif isinstance(rule, annotated_types.Le):
            high = rule.le
            words.append(f"<= {rule.le}")
        elif isinstance(rule, annotated_types.Lt):
            high = cast(int, rule.lt) - 1 if kind is int else None
            words.append(f"< {rule.lt}")
        elif isinstance(rule, annotated_types.MinLen):
            if rule.min_length == 1:
                noun = "a non-empty string"
            else:
                words.append(f"of at least {rule.min_length} characters")
    if kind is int and low is not None and high is not None:
        return f"an integer in {low}..{high}"
    return " ".join([noun, *words])
