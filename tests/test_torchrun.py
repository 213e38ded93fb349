"""Several ranks for real: ``torchrun --nproc_per_node 2`` (gloo, CPU) against a live server.

Two rank processes, each with two DataLoader worker processes, read one epoch
(``tests/torchrun_train.py``): every window of the epoch reaches exactly one rank exactly
once, both ranks run the same number of steps, and all of them are one run (rank 0's run
id, broadcast) in one server job. Then the state rank 0 saved part-way through resumes in
one process: the batches before the save and those after it are the epoch, exactly.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from live_server import LiveServer
from shard_data import BYTE, random_docs
from tokenfeed_server.store import write_dataset

pytestmark = [pytest.mark.network, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("torchrun_train.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")
SAVE_AT = 6  # batches per rank before rank 0 saves the loader state


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("store")
    write_dataset(root, "tiny", random_docs(160, seed=3), tokenizer=BYTE, shuffle_seed=2,
                  shard_tokens=700)  # fmt: skip
    with LiveServer(root, log_path=root.parent / "server.log") as srv:
        yield srv


def torchrun(server: LiveServer, out: Path, nproc: int, *args: str) -> list[dict[str, Any]]:
    """Run the script on ``nproc`` ranks; what each rank wrote, in rank order."""
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TOKENFEED_RUN_ID"}
    env["OMP_NUM_THREADS"] = "1"  # two ranks and four workers share the CI's few cores
    command = [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", str(SCRIPT)]
    done = subprocess.run(
        [*command, server.zmq, str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def epoch_rows(steps: list[dict[str, Any]]) -> list[int]:
    """The window ids of epoch 0 in ``steps`` (the last step may reach into epoch 1)."""
    return [w for s in steps for w, e in zip(s["windows"], s["epochs"], strict=True) if e == 0]


def test_two_ranks_read_the_epoch_once_and_resume_on_one(
    server: LiveServer, tmp_path: Path
) -> None:
    ranks = torchrun(server, tmp_path / "two", 2, "--save-at", str(SAVE_AT))
    n_windows = ranks[0]["n_windows"]
    # Exactly once across both ranks and their workers; equal steps per rank.
    rows = epoch_rows(ranks[0]["steps"]) + epoch_rows(ranks[1]["steps"])
    assert sorted(rows) == list(range(n_windows))
    assert len(ranks[0]["steps"]) == len(ranks[1]["steps"]) > SAVE_AT
    # One run: rank 0's id, broadcast over the process group (before torchrun's own id).
    run = ranks[0]["run"]
    assert run and ranks[1]["run"] == run and run != ranks[0]["torchrun"]
    jobs = [j for j in server.get("/v1/jobs").json() if j["world_size"] == 2]
    assert len(jobs) == 1, jobs  # every rank and worker in one job

    state = json.loads((tmp_path / "two" / "state.json").read_text())
    assert state["run"] == run and state["position"] == SAVE_AT * 2 * 4
    (resumed,) = torchrun(
        server, tmp_path / "one", 1, "--state", str(tmp_path / "two" / "state.json")
    )
    assert resumed["run"] == run  # the resumed run keeps its id
    before = [s for r in ranks for s in r["steps"][:SAVE_AT]]
    union = collections.Counter(epoch_rows(before) + epoch_rows(resumed["steps"]))
    assert sorted(union) == list(range(n_windows)) and set(union.values()) == {1}
