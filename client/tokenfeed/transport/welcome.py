"""What the client checks in a ``welcome``: values a correct server never sends, and
whether the dataset build is the one the job reads (the words of a DatasetChanged)."""

from __future__ import annotations

import numpy as np

from tokenfeed import protocol
from tokenfeed.protocol import JobSpec

__all__ = ["changed_message", "source_changed_message", "welcome_problems"]


def welcome_problems(welcome: protocol.Welcome, job: JobSpec) -> list[str]:
    """What is impossible in ``welcome`` for ``job`` (empty: nothing); such values
    would fail later, obscurely."""
    problems = []
    for name in ("window", "max_count", "n_windows", "n_tokens"):
        value = getattr(welcome, name)
        if value < 1:
            problems.append(f"{name}={value} (must be >= 1)")
    dtype = protocol.DTYPES.get(welcome.dtype)
    if dtype is None:
        problems.append(f"dtype={welcome.dtype!r} (must be one of {sorted(protocol.DTYPES)})")
    elif not 0 <= welcome.eos_id <= np.iinfo(dtype).max:
        problems.append(f"eos_id={welcome.eos_id} (outside {welcome.dtype})")
    for name in ("job", "fingerprint", "server"):
        if not getattr(welcome, name):
            problems.append(f"{name} is empty")
    if job.is_mixture:
        n = len(job.sources)
        got = welcome.source_fingerprints
        if len(got) != n or not all(got):
            problems.append(
                f"source_fingerprints={list(got)} (must be {n} non-empty builds, one "
                f"per source of {list(job.sources)})"
            )
    if job.shuffle == "block":
        sizes = (
            welcome.source_region_windows + welcome.source_block_regions
            if job.is_mixture
            else (welcome.region_windows, welcome.block_regions)
        )
        if not sizes or min(sizes) < 1:
            problems.append(
                f"block sizes {list(sizes)} (a block shuffle needs every region_windows "
                "and block_regions >= 1)"
            )
    return problems


def source_changed_message(
    name: str, endpoint: str, expected: str, served: str | None, *, given: bool
) -> str:
    """What a DatasetChanged says for a mixture: which source, both builds, what to do.

    ``given``: the expected build came from a checkpoint (not this job's first welcome).
    """
    now = f"the server has {served}" if served else "the server has another build"
    if given:
        return (
            f"source {name!r} of this mixture on {endpoint} is not the build this "
            f"job reads (expected fingerprint {expected}, {now}): it was prepared "
            "again, and reading it would train on different data. Restore the old "
            "dataset, or start over on purpose: drop the loader state (a new run "
            "from position 0)"
        )
    return (
        f"source {name!r} of this mixture on {endpoint} was replaced while this "
        f"job was reading it (expected fingerprint {expected}, {now}); going on "
        "would mix two builds. Start a new run (or restore the old dataset)"
    )


def changed_message(
    dataset: str,
    endpoint: str,
    expected: str | None,
    served: str | None,
    *,
    given: bool,
    several: bool,
) -> str:
    """What a DatasetChanged says: which build was expected, which is served, what to do.

    ``given`` as for :func:`source_changed_message`; ``several``: the job has replicas.
    """
    now = f"the server has {served}" if served else "the server has another build"
    replicas = (
        ", or the replicas serve different builds (every replica of a job must serve "
        "the same prepared store)"
        if several
        else ""
    )
    if given:
        return (
            f"dataset {dataset!r} on {endpoint} is not the build this "
            f"job reads (expected fingerprint {expected}, {now}): it was "
            f"prepared again{replicas}, and reading it would train on different data. "
            "Restore the old dataset, or start over on purpose: drop the loader state "
            "(a new run from position 0)"
        )
    return (
        f"dataset {dataset!r} on {endpoint} was replaced while this job "
        f"was reading it{replicas} (expected fingerprint {expected}, {now}); "
        "going on would mix two datasets. Start a new run (or restore the old dataset)"
    )
