"""What a step of a run saw: its rows, their windows, their text, from the state alone.

After a loss spike the question is which data the step saw. A run's saved state (what
``TokenFeedLoader.state_dict()`` or ``TokenFeedTrainer`` wrote) pins everything the
stream is a function of: the dataset build (``fingerprint``), the order (seed, shuffle,
block sizes), the global batch and the ranges skipped on purpose. So step ``s`` is stream
position ``s * G`` plus the skipped samples before it (:func:`step_position`), and
:func:`look_at_step` reads that global batch again from the server, every rank's rows,
from the same build (the server keeps the versions jobs or checkpoints may need; it
refuses clearly once one is gone), as a job of its own that leaves the run's alone.

The mapping assumes the global batch did not change during the run (resuming at another
world size or batch size changes ``G`` from that step on); give ``position=`` directly
for such a run. ``tokenfeed batches`` is the command-line face (see :mod:`tokenfeed.cli`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenfeed.errors import ConfigError
from tokenfeed.mixture import Mixture
from tokenfeed.training import resume

__all__ = ["StepRow", "StepView", "look_at_step", "step_position"]


@dataclass(frozen=True)
class StepRow:
    """One row of one rank's batch: where it comes from and its tokens."""

    rank: int
    row: int
    #: the row's window in its dataset's order, and the epoch it belongs to
    window: int
    epoch: int
    #: the dataset the row comes from (a mixture's source)
    dataset: str
    tokens: list[int]
    #: decoded text, when a tokenizer was at hand
    text: str | None = None


@dataclass(frozen=True)
class StepView:
    """A step's global batch as read again: the build, the position and every row."""

    step: int
    position: int
    global_batch: int
    #: dataset name -> the build (fingerprint) read
    versions: dict[str, str]
    rows: list[StepRow] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-friendly values."""
        return {
            "step": self.step,
            "position": self.position,
            "global_batch": self.global_batch,
            "versions": self.versions,
            "rows": [row.__dict__ for row in self.rows],
        }


def step_position(state: Mapping[str, Any], step: int) -> int:
    """The stream position global batch ``step`` (0-based) of the run began at: ``step *
    G`` plus every range the run skipped before it (``skipped`` in the state)."""
    if type(step) is not int or step < 0:
        raise ConfigError(f"step must be an integer >= 0, got {step!r}")
    for key in ("batch_size", "world_size"):
        if type(state.get(key)) is not int or state[key] < 1:
            raise ConfigError(f"state has no valid {key!r}: {state.get(key)!r}")
    position = step * int(state["batch_size"]) * int(state["world_size"])
    for start, samples in sorted(resume.check_skipped(dict(state))):
        if start <= position:
            position += samples
    return position


def look_at_step(
    endpoint: str | Sequence[str],
    state: Mapping[str, Any],
    step: int | None = None,
    *,
    position: int | None = None,
    ranks: Sequence[int] | None = None,
    token: str | None = None,
    decode: Any = None,
) -> StepView:
    """Read again the global batch of ``step`` (or at stream ``position``) of the run
    that saved ``state``: every rank's rows (or only ``ranks``'), from the build the
    state pins. ``decode(dataset, ids) -> str`` adds each row's text when given."""
    from tokenfeed.training.dataset import TokenFeedDataset  # torch: only when used

    if (step is None) == (position is None):
        raise ConfigError("give exactly one of step= and position=")
    at = step_position(state, step) if step is not None else position
    assert at is not None
    world = int(state["world_size"])
    view = StepView(step if step is not None else -1, at, world * int(state["batch_size"]), {})
    for rank in ranks if ranks is not None else range(world):
        ds = TokenFeedDataset(
            endpoint,
            _dataset_arg(state),
            seq_len=int(state["seq_len"]),
            batch_size=int(state["batch_size"]),
            seed=int(state["seed"]),
            rank=rank,
            world_size=world,
            token=token,
            shuffle=state.get("shuffle", "global"),
            run=f"look-{uuid.uuid4().hex[:16]}",  # a job of its own (see read_at)
        )
        ds.load_state_dict(dict(state))
        answer = ds.read_at(at)
        names = ds.names
        view.versions.update(
            ds.source_fingerprints if ds.mixture is not None else {names[0]: ds.fingerprint or ""}
        )
        for i, ids in enumerate(answer.tokens.tolist()):
            source = names[int(answer.sources[i])] if answer.sources is not None else names[0]
            text = decode(source, ids) if decode is not None else None
            window, epoch = int(answer.window_ids[i]), int(answer.epochs[i])
            view.rows.append(StepRow(rank, i, window, epoch, source, ids, text))
    return view


def _dataset_arg(state: Mapping[str, Any]) -> str | Mixture:
    if "schedule" in state:
        return Mixture.from_state(state["schedule"])
    name = state.get("dataset")
    if not isinstance(name, str) or not name:
        raise ConfigError(
            "state names no dataset and no mixture schedule: is it a tokenfeed state?"
        )
    return name
