"""Checking a saved resume state against the dataset that loads it.

A state continues a stream only under the same plan inputs, the same order (shuffle and
block sizes) and the same dataset builds; each check here refuses a state that would not,
saying what differs and what to pass instead, before the dataset changes anything.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from tokenfeed.errors import ConfigError, TokenFeedError
from tokenfeed.mixture import Mixture
from tokenfeed.protocol import RUN_ID, JobSpec, Welcome

__all__ = [
    "check_block_sizes",
    "check_dataset",
    "check_mixture",
    "check_plan",
    "check_required_block_sizes",
    "check_run",
    "check_skipped",
    "welcome_block_sizes",
]


def check_plan(state_dict: dict[str, Any], job: JobSpec) -> int:
    """The state's position, once its plan inputs and order are this job's."""
    for key in ("seq_len", "seed"):
        mine = getattr(job, key)
        if state_dict.get(key) != mine:
            raise ConfigError(
                f"state was saved for {key}={state_dict.get(key)!r} but this dataset has "
                f"{key}={mine!r}; resuming would not continue the same stream"
            )
    position = state_dict.get("position")
    if type(position) is not int or position < 0:
        raise ConfigError(f"state has no valid 'position': {position!r}")
    shuffle = state_dict.get("shuffle", "global")  # older states: only global existed
    if shuffle != job.shuffle:
        raise ConfigError(
            f"state was saved with shuffle={shuffle!r} but this dataset has "
            f"shuffle={job.shuffle!r}; another order would not continue the same "
            f"stream: pass shuffle={shuffle!r}"
        )
    return position


def check_skipped(state_dict: dict[str, Any]) -> list[tuple[int, int]]:
    """The stream ranges a run skipped on purpose, ``[(position, samples), ...]`` in the
    order they were skipped (none for a state saved before skipping existed)."""
    skipped = state_dict.get("skipped", [])
    ok = isinstance(skipped, list) and all(
        isinstance(r, (list, tuple)) and len(r) == 2 and all(type(v) is int and v >= 0 for v in r)
        for r in skipped
    )
    if not ok:
        raise ConfigError(
            f"state has no valid 'skipped' (a list of [position, samples]): {skipped!r}"
        )
    return [(int(a), int(n)) for a, n in skipped]


def check_run(state_dict: dict[str, Any]) -> str | None:
    """The run id a state continues (None: a state from before run ids, which keeps the
    loading launch's own id; ``""``: a run that had none)."""
    run = state_dict.get("run")
    if run is None:
        return None
    if not isinstance(run, str) or (run and not RUN_ID.fullmatch(run)):
        raise ConfigError(f"state has no valid 'run': {run!r}")
    return run


def check_block_sizes(saved: object, job: JobSpec) -> dict[str, tuple[int, int]]:
    """The block sizes of a state, checked: they must be those given to this dataset."""
    if not isinstance(saved, Mapping):
        raise ConfigError(f"state has no valid 'block_sizes': {saved!r}")
    out: dict[str, tuple[int, int]] = {}
    given = (job.region_windows, job.block_regions)
    for name, sizes in saved.items():
        if (
            not isinstance(name, str)
            or not isinstance(sizes, Sequence)
            or len(sizes) != 2
            or not all(type(v) is int and v >= 1 for v in sizes)
        ):
            raise ConfigError(f"state has invalid block sizes for {name!r}: {sizes!r}")
        r, b = sizes
        # 0: not given (the server derives it, the state then pins it)
        if any(mine and mine != saved for mine, saved in zip(given, sizes, strict=True)):
            raise ConfigError(
                f"state was saved with block sizes region_windows={r}, block_regions={b} "
                f"for {name!r} but this dataset has region_windows={given[0] or None}, "
                f"block_regions={given[1] or None}; another order would not continue the same "
                "stream: pass the state's sizes (or leave them to the state: None)"
            )
        out[name] = (r, b)
    return out


def check_dataset(state_dict: dict[str, Any], job: JobSpec) -> str | None:
    """The build a one-dataset state pins (None: an old state without one, warned)."""
    if "schedule" in state_dict:
        raise ConfigError(
            "state was saved for a mixture (it has a 'schedule') but this dataset reads "
            f"the one dataset {job.dataset!r}; pass the mixture to resume it"
        )
    if state_dict.get("dataset") != job.dataset:
        raise ConfigError(
            f"state was saved for dataset={state_dict.get('dataset')!r} but this dataset "
            f"has dataset={job.dataset!r}; resuming would not continue the same stream"
        )
    fingerprint = state_dict.get("fingerprint")
    if fingerprint is None:
        warnings.warn(
            "the loaded state carries no dataset fingerprint (saved by an older tokenfeed "
            "or before the first batch): resuming can not check that the server still "
            f"has the same build of {job.dataset!r}. Save a new state to get the check",
            stacklevel=3,
        )
    elif not isinstance(fingerprint, str) or not fingerprint:
        raise ConfigError(f"state has no valid 'fingerprint': {fingerprint!r}")
    return fingerprint


def check_mixture(state_dict: dict[str, Any], position: int, mixture: Mixture) -> dict[str, str]:
    """The source builds a mixture's state pins, once its schedule is known to agree
    with this dataset's up to the saved position."""
    assert mixture is not None
    if "schedule" not in state_dict:
        raise ConfigError(
            f"state was saved for the one dataset {state_dict.get('dataset')!r}, not a "
            "mixture: its position is not a place in this mixture's stream"
        )
    try:
        saved = Mixture.from_state(state_dict["schedule"])
    except TokenFeedError as exc:
        raise ConfigError(f"state has no valid 'schedule': {exc}") from None
    try:
        saved.check_continuation(mixture, position)
    except ConfigError as exc:
        raise ConfigError(
            f"this mixture's schedule does not continue the saved one at position {position}: {exc}"
        ) from None
    fingerprints = state_dict.get("fingerprints")
    if not isinstance(fingerprints, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and v for k, v in fingerprints.items()
    ):
        raise ConfigError(f"state has no valid 'fingerprints': {fingerprints!r}")
    unpinned = [n for n in saved.names if n not in fingerprints]
    if position > 0 and unpinned:
        warnings.warn(
            f"the loaded state carries no fingerprint for {unpinned} (saved before the "
            "first batch): resuming can not check that the server still has the same "
            "build of them. Save a new state to get the check",
            stacklevel=3,
        )
    return dict(fingerprints)


def welcome_block_sizes(welcome: Welcome, names: Sequence[str]) -> dict[str, tuple[int, int]]:
    """``(region_windows, block_regions)`` per dataset name, as the welcome says."""
    if welcome.source_region_windows:
        pairs = zip(welcome.source_region_windows, welcome.source_block_regions, strict=True)
        return dict(zip(names, pairs, strict=True))
    return {names[0]: (welcome.region_windows, welcome.block_regions)}


def check_required_block_sizes(
    used: Mapping[str, tuple[int, int]], required: Mapping[str, tuple[int, int]]
) -> None:
    """Refuse a server whose block sizes differ from those a loaded state requires."""
    for name, sizes in required.items():
        if name in used and used[name] != sizes:
            raise ConfigError(
                f"the loaded state was saved with block sizes (region_windows, "
                f"block_regions) = {sizes} for {name!r}, but the server now uses "
                f"{used[name]}: the block order would change under the run. Pass "
                f"region_windows={sizes[0]}, block_regions={sizes[1]}"
            )
