"""The arguments of a :class:`~tokenfeed.training.dataset.TokenFeedDataset`, checked once.

:class:`DatasetConfig` holds exactly what the caller passed (frozen), refuses a bad
combination when it is made, and derives what the dataset runs on: the rank and world
size, the job every rank sends, the client options, the endpoints. Made once at the edge
of the dataset, so the dataset itself never sees an unchecked argument.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, TypeAlias, get_args

import torch

from tokenfeed.errors import ConfigError
from tokenfeed.mixture import Mixture, Schedule
from tokenfeed.protocol import RUN_ID, JobSpec
from tokenfeed.training.batches import LABEL_MODES, LabelMode
from tokenfeed.transport.options import ClientOptions
from tokenfeed.transport.replicas import parse_endpoints

__all__ = [
    "RUN_ID_ENV",
    "SHUFFLE_MODES",
    "DatasetArg",
    "DatasetConfig",
    "ShuffleMode",
    "distributed_defaults",
    "launch_run_id",
]

log = logging.getLogger("tokenfeed")

#: The environment variable that names the launch's run id for every process of it.
RUN_ID_ENV = "TOKENFEED_RUN_ID"
#: What torchrun sets to its rendezvous id: a fresh uuid per launch with ``--standalone``,
#: ``--rdzv-id`` otherwise (default ``"none"``, then no use as a run id).
_TORCHRUN_ID_ENV = "TORCHELASTIC_RUN_ID"

#: The order of windows within an epoch: ``"global"``: a permutation of every window of
#: the dataset; ``"block"``: regions of consecutive windows (about a shard each) visited
#: a few at a time, windows shuffled across each block (for stores read from object
#: storage through a cache smaller than the dataset; see :class:`tokenfeed.plan.Plan`).
ShuffleMode = Literal["global", "block"]
SHUFFLE_MODES: tuple[ShuffleMode, ...] = get_args(ShuffleMode)

#: What ``dataset=`` may be: a dataset name, or a mixture (a mapping of name to weight, a
#: schedule of ``(start, weights)`` segments, or a :class:`~tokenfeed.mixture.Mixture`).
DatasetArg: TypeAlias = "str | Mixture | Schedule"


@dataclass(frozen=True)
class DatasetConfig:
    """Every argument of :class:`~tokenfeed.training.dataset.TokenFeedDataset` (which
    says what each means), checked when made; the derived values are computed once."""

    endpoint: str | Sequence[str]
    dataset: DatasetArg
    seq_len: int
    batch_size: int
    seed: int = 0
    rank: int | None = None
    world_size: int | None = None
    epochs: int | None = None
    samples: int | None = None
    token: str | None = field(default=None, repr=False)  # a secret: never in a repr
    server_public_key: str | None = None
    client_secret_key: str | None = field(default=None, repr=False)  # a secret
    window: int = 4
    chunk_bytes: int = 4 << 20
    request_timeout: float = 10.0
    deadline: float = 120.0
    batches_per_item: int | None = None
    document_boundaries: bool = False
    labels: LabelMode = "shifted"
    shuffle: ShuffleMode = "global"
    region_windows: int | None = None
    block_regions: int | None = None
    run: str | None = None
    allow_read_amplification: bool = False

    def __post_init__(self) -> None:
        # Each derived value checks its own arguments; touching them here refuses a bad
        # configuration now, in the order a caller fixes them.
        _check_labels(self.labels)
        _ = self.placement
        if self.epochs is not None and self.samples is not None:
            raise ConfigError("give epochs or samples, not both")
        if self.batches_per_item is not None and self.batches_per_item < 1:
            raise ConfigError("batches_per_item must be >= 1")
        _ = self.block_sizes
        if self.mixture is not None and self.epochs is not None:
            raise ConfigError(
                "epochs= does not apply to a mixture: epochs belong to each source, which "
                "runs through its own at the rate its weight gives it. End the stream with "
                "samples= (global stream positions) instead"
            )
        _ = self.endpoints
        _ = self.options
        # Last: it may be a collective (every rank broadcasts rank 0's id), reached only
        # once the arguments are known good on this rank.
        _ = self.job

    @cached_property
    def placement(self) -> tuple[int, int]:
        """``(rank, world_size)``: as given, else from ``torch.distributed`` or the
        ``RANK``/``WORLD_SIZE`` environment variables, else 0 and 1."""
        default_rank, default_world = distributed_defaults()
        rank = default_rank if self.rank is None else self.rank
        world_size = default_world if self.world_size is None else self.world_size
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside [0, world_size={world_size})")
        return rank, world_size

    @cached_property
    def block_sizes(self) -> tuple[int, int]:
        """``(region_windows, block_regions)`` to send (0: the server derives it)."""
        return _check_shuffle(self.shuffle, self.region_windows, self.block_regions)

    @cached_property
    def mixture(self) -> Mixture | None:
        """The mixture read, or None for one dataset."""
        return None if isinstance(self.dataset, str) else Mixture.of(self.dataset)

    @cached_property
    def endpoints(self) -> tuple[str, ...]:
        """The endpoints, checked (one, or several replicas)."""
        return parse_endpoints(self.endpoint)

    @cached_property
    def job(self) -> JobSpec:
        """What every rank and worker of the run sends."""
        mix = self.mixture
        return JobSpec(
            "" if mix is not None else str(self.dataset),
            self.seq_len,
            self.batch_size,
            self.seed,
            self.placement[1],
            sources=mix.names if mix is not None else (),
            schedule=tuple(map(tuple, mix.to_wire())) if mix is not None else (),
            shuffle=self.shuffle,
            region_windows=self.block_sizes[0],
            block_regions=self.block_sizes[1],
            run=self.run_id,
        )

    @cached_property
    def run_id(self) -> str:
        """This launch's run id (see :func:`launch_run_id`), made once, here."""
        return launch_run_id(self.run, self.placement[1])

    @cached_property
    def options(self) -> ClientOptions:
        """The options of every client (the token defaults to ``TOKENFEED_TOKEN``; with a
        server key, the client key to ``TOKENFEED_CLIENT_KEY``)."""
        client_key = self.client_secret_key
        if client_key is None and self.server_public_key is not None:
            client_key = os.environ.get("TOKENFEED_CLIENT_KEY")
        return ClientOptions(
            window=self.window,
            chunk_bytes=self.chunk_bytes,
            request_timeout=self.request_timeout,
            deadline=self.deadline,
            token=self.token if self.token is not None else os.environ.get("TOKENFEED_TOKEN"),
            server_public_key=self.server_public_key,
            client_secret_key=client_key,
            allow_read_amplification=self.allow_read_amplification,
            shared_memory=_shared_memory_env(),
        )


def distributed_defaults() -> tuple[int, int]:
    """``(rank, world_size)`` of ``torch.distributed`` if initialised, else of the
    ``RANK``/``WORLD_SIZE`` environment variables (default 0 and 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as exc:
        raise ConfigError(f"RANK/WORLD_SIZE must be integers: {exc}") from None


def launch_run_id(given: str | None, world_size: int) -> str:
    """The id of this training launch, the same in every rank and DataLoader worker.

    The first that applies: ``given`` (the ``run=`` argument); the ``TOKENFEED_RUN_ID``
    environment variable; rank 0's fresh id broadcast to every rank when
    ``torch.distributed`` is initialised (a collective: every rank makes its dataset);
    torchrun's rendezvous id (``TORCHELASTIC_RUN_ID``: per launch with ``--standalone``,
    or the ``--rdzv-id`` given); a fresh id when this is the only rank. Workers get it
    with the pickled dataset. Several ranks with none of these can not agree on a fresh
    id: they warn and send none (``""``), so they share the job of their inputs, as
    every run did before run ids.
    """
    for where, value in (("run=", given), (RUN_ID_ENV, os.environ.get(RUN_ID_ENV))):
        if value is not None:
            if not RUN_ID.fullmatch(value):
                raise ConfigError(
                    f"{where} {value!r} is not a run id: use 1-128 characters of letters, "
                    "digits, '.', '_', ':' or '-', starting with a letter or digit"
                )
            return value
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        made = [uuid.uuid4().hex if dist.get_rank() == 0 else ""]
        dist.broadcast_object_list(made, src=0)
        return str(made[0])
    torchrun = os.environ.get(_TORCHRUN_ID_ENV, "none")
    if torchrun != "none" and RUN_ID.fullmatch(torchrun):
        return torchrun
    if world_size == 1:
        return uuid.uuid4().hex
    # Logged, not warned: a launcher that places ranks itself (rank=, world_size=) is
    # legitimate, and before run ids every run worked this way.
    log.warning(
        "%d ranks and no run id they share: set %s to one value for every rank (or "
        "initialise torch.distributed before making the dataset, or use torchrun "
        "--standalone). Without one this run shares its server job with any run of the "
        "same dataset, seed and shapes",
        world_size,
        RUN_ID_ENV,
    )
    return ""


def _check_labels(labels: object) -> None:
    if labels not in LABEL_MODES:
        raise ConfigError(
            f"labels must be one of {', '.join(map(repr, LABEL_MODES))}, got {labels!r}: "
            "'shifted' for a plain cross_entropy(logits, labels), 'unshifted' for "
            "Hugging Face causal LMs, which shift labels themselves"
        )


def _check_shuffle(
    shuffle: object, region_windows: int | None, block_regions: int | None
) -> tuple[int, int]:
    """The block sizes to send (0: the server derives them), once the arguments agree."""
    if shuffle not in SHUFFLE_MODES:
        raise ConfigError(
            f"shuffle must be one of {', '.join(map(repr, SHUFFLE_MODES))}, got {shuffle!r}: "
            "'global' shuffles all windows of an epoch, 'block' a few regions at a time"
        )
    sizes = (region_windows, block_regions)
    if shuffle == "global":
        if sizes != (None, None):
            raise ConfigError(
                'region_windows and block_regions apply to shuffle="block" only; leave them '
                'out with shuffle="global"'
            )
        return 0, 0
    for name, value in zip(("region_windows", "block_regions"), sizes, strict=True):
        if value is not None and (type(value) is not int or value < 1):
            raise ConfigError(f"{name} must be an integer >= 1 or None, got {value!r}")
    return region_windows or 0, block_regions or 0


def _shared_memory_env() -> bool | None:
    """``TOKENFEED_SHARED_MEMORY``: ``1`` asks the server for a shared-memory ring even
    when its endpoint does not look local (a container sharing the server's ring door
    on a volume), ``0`` never asks; unset: ask when the server is on this host."""
    value = os.environ.get("TOKENFEED_SHARED_MEMORY", "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(
        f"TOKENFEED_SHARED_MEMORY must be 1 (ask for a ring), 0 (TCP only) or auto, got {value!r}"
    )
