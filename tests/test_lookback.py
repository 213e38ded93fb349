"""Loss-spike tools: what a step saw, read again from the state alone; resume that skips.

A real server on a prepared store and real loaders with worker processes: a run records
what each step trained on and saves its state; ``tokenfeed batches`` (and
:func:`look_at_step`) must show exactly those rows for a chosen step, and a resume with
``skip_batches`` must leave out exactly those batches and read everything else once,
with the skip recorded in the state and the step numbering of later looks still right.
"""

from __future__ import annotations

import json
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest
import torch

from live_server import LiveServer
from tokenfeed import TokenFeedDataset, TokenFeedLoader
from tokenfeed.lookback import look_at_step, step_position
from tokenfeed.tokenizer import decode_bytes

pytestmark = pytest.mark.network

SEQ, BATCH, WORLD = 16, 2, 2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    root = tmp_path_factory.mktemp("lookback")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc-{i}.txt").write_text(f"document {i} says " + "word " * (40 + 7 * i))
    cmd = [sys.executable, "-m", "tokenfeed_server.cli", "prepare", "--store",
           str(root / "store"), "--dataset", "text", "--no-progress", str(corpus)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    with LiveServer(root / "store", log_path=root / "log") as srv:
        yield srv


def loader(srv: LiveServer, rank: int, workers: int = 2) -> TokenFeedLoader:
    ds = TokenFeedDataset(srv.zmq, "text", seq_len=SEQ, batch_size=BATCH, seed=3, rank=rank,
                          world_size=WORLD, deadline=30.0, run="lookback-run")  # fmt: skip
    return TokenFeedLoader(ds, num_workers=workers, pin_memory=False)


def run(
    srv: LiveServer, steps: int, state: dict | None = None, skip: int = 0
) -> tuple[list[list[torch.Tensor]], dict]:
    """Each step's input_ids per rank, and rank 0's state after ``steps`` steps."""
    seen: list[list[torch.Tensor]] = [[] for _ in range(steps)]
    final: dict = {}
    for rank in range(WORLD):
        ld = loader(srv, rank)
        if state is not None:
            ld.load_state_dict(json.loads(json.dumps(state)), skip_batches=skip)
        for step, batch in enumerate(islice(iter(ld), steps)):
            seen[step].append(batch["input_ids"])
        if rank == 0:
            final = json.loads(json.dumps(ld.state_dict()))
    return seen, final


def rows_of(view_rows: list, rank: int) -> torch.Tensor:
    return torch.tensor([r.tokens[:-1] for r in view_rows if r.rank == rank])


def test_look_at_a_step_shows_exactly_what_it_trained_on(server: LiveServer) -> None:
    seen, state = run(server, 6)
    assert state["position"] == 6 * BATCH * WORLD
    for step in (0, 4):
        view = look_at_step(server.zmq, state, step, decode=lambda _, ids: decode_bytes(ids))
        assert view.position == step * BATCH * WORLD
        assert view.versions == {"text": state["fingerprint"]}
        for rank in range(WORLD):
            assert torch.equal(rows_of(view.rows, rank), seen[step][rank])
        assert all(r.dataset == "text" and r.text == decode_bytes(r.tokens) for r in view.rows)
        assert any("word" in (r.text or "") for r in view.rows)
    # a look is a job of its own: the run's job (and its consumed count) is left alone
    assert look_at_step(server.zmq, state, 2, ranks=[1]).rows[0].rank == 1


def test_skip_batches_leaves_out_exactly_those_and_is_recorded(server: LiveServer) -> None:
    whole, _ = run(server, 10)
    _, state = run(server, 3)
    resumed, after = run(server, 4, state=state, skip=2)
    # steps 3 and 4 of the undisturbed stream are skipped; the rest follows once
    for k in range(4):
        for rank in range(WORLD):
            assert torch.equal(resumed[k][rank], whole[5 + k][rank])
    g = BATCH * WORLD
    assert after["skipped"] == [[3 * g, 2 * g]]
    assert after["position"] == 9 * g
    # trained step 3 of the resumed run is stream position 5g; looks agree
    assert step_position(after, 3) == 5 * g and step_position(after, 2) == 2 * g
    view = look_at_step(server.zmq, after, 3)
    assert torch.equal(rows_of(view.rows, 0), resumed[0][0])
    # skipping again keeps the earlier range
    _, again = run(server, 1, state=after, skip=1)
    assert again["skipped"] == [[3 * g, 2 * g], [9 * g, g]]


def test_the_command_line(server: LiveServer, tmp_path: Path) -> None:
    seen, state = run(server, 3)
    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    (checkpoint / "tokenfeed_loader.json").write_text(json.dumps(state))
    cmd = [sys.executable, "-m", "tokenfeed.cli", "batches", "--endpoint", server.zmq,
           "--state", str(checkpoint), "--step", "1", "--http", server.http]  # fmt: skip
    shown = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith(f"step 1: stream position {BATCH * WORLD}")
    assert state["fingerprint"] in lines[0]
    assert len(lines) == 1 + BATCH * WORLD and lines[1].startswith("rank 0 row 0 text window")
    as_json = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=120,
                             check=False)  # fmt: skip
    rows = json.loads(as_json.stdout)["rows"]
    assert torch.equal(torch.tensor([r["tokens"][:-1] for r in rows if r["rank"] == 1]),
                       seen[1][1])  # fmt: skip
    bad = subprocess.run([*cmd[:7], str(tmp_path / "nope.json"), "--step", "1"],
                         capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert bad.returncode == 2 and "does not exist" in bad.stderr
