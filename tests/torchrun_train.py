"""The training loop ``tests/test_torchrun.py`` runs under ``torchrun`` (not a test module).

Every rank reads one epoch of ``tiny`` through a ``TokenFeedLoader`` with two worker
processes under a gloo process group, and writes what it got to ``OUT/rank{rank}.json``:
the window ids and epochs of every batch, its run id and torchrun's. With ``--save-at K``
rank 0 also writes the loader state after ``K`` batches to ``OUT/state.json``; with
``--state FILE`` the run resumes from it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tokenfeed import TokenFeedDataset, TokenFeedLoader

SEQ, BATCH, SEED = 16, 4, 9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("out", type=Path)
    parser.add_argument("--save-at", type=int, default=-1)
    parser.add_argument("--state", type=Path)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Every rank makes its dataset: rank 0's run id is broadcast to all of them here.
    dataset = TokenFeedDataset(
        args.endpoint, "tiny", seq_len=SEQ, batch_size=BATCH, seed=SEED, epochs=1, deadline=30.0
    )
    loader = TokenFeedLoader(dataset, num_workers=2)
    if args.state is not None:
        loader.load_state_dict(json.loads(args.state.read_text()))
    steps: list[dict[str, Any]] = []
    for batch in loader:
        steps.append({"windows": batch["window_ids"].tolist(), "epochs": batch["epoch"].tolist()})
        if len(steps) == args.save_at and rank == 0:  # the state counts this batch as taken
            (args.out / "state.json").write_text(json.dumps(loader.state_dict()))
    record = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "run": dataset.job.run,
        "torchrun": os.environ.get("TORCHELASTIC_RUN_ID"),
        "n_windows": dataset.n_windows,
        "steps": steps,
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
