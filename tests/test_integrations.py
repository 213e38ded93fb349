"""Trainer integrations: ``examples/train_hf.py`` and torchdata's ``Stateful`` protocol.

The example trains a Hugging Face GPT-2 through ``TokenFeedLoader`` against a real
server; a run cut in two by a checkpoint (with another ``num_workers`` after the cut)
must train on exactly the windows of an uninterrupted run and end with the same
weights. The loader's ``state_dict`` / ``load_state_dict`` must be torchdata's
``Stateful`` protocol exactly (what trainers that checkpoint stateful loaders look for).

torchdata's own ``StatefulDataLoader`` over a ``TokenFeedDataset`` (real worker
processes) continues exactly after a state round trip: each worker's saved state says
what that worker yielded. What can not be resumed exactly is refused, never restarted.
``TokenFeedLoader`` leaves the dataset it is given as it was (its packing is its own).
"""

from __future__ import annotations

import inspect
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import Stateful, StatefulDataLoader

from live_server import LiveServer
from tokenfeed import TokenFeedDataset, TokenFeedLoader
from tokenfeed.errors import ConfigError
from tokenfeed_server.store import write_dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_hf  # the example script, imported from its folder
from shard_data import BYTE

pytestmark = [
    pytest.mark.network,
    # torchdata's StatefulDataLoader calls torch.set_vital, which newer torch deprecates
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("store")
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 256, size=int(n), dtype=np.uint16) for n in rng.integers(5, 400, 200)]
    write_dataset(root, "alpha", docs, tokenizer=BYTE, shuffle_seed=0, shard_tokens=9_000)
    with LiveServer(root, log_path=tmp_path_factory.mktemp("logs") / "server.log") as srv:
        yield srv


def train(server: LiveServer, checkpoint: Path, *args: str) -> dict[str, Any]:
    small = ["--seq-len", "32", "--batch-size", "4", "--d-model", "32", "--layers", "1"]
    return train_hf.run(
        [
            *("--endpoint", server.zmq, "--dataset", "alpha", "--checkpoint", str(checkpoint)),
            *("--log-every", "1", "--warmup", "2", *small, *args),
        ]
    )


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    state: dict[str, Any] = torch.load(checkpoint, weights_only=True)
    return state["model"]  # type: ignore[no-any-return]


def test_train_hf_resumes_exactly(server: LiveServer, tmp_path: Path) -> None:
    whole = train(server, tmp_path / "whole.pt", "--steps", "6", "--num-workers", "0")
    # a job cut after 3 of 6 steps, as a time limit would, then resumed
    first = train(
        server, tmp_path / "cut.pt", "--steps", "6", "--stop-after", "3", "--num-workers", "2"
    )
    rest = train(server, tmp_path / "cut.pt", "--steps", "6", "--num-workers", "0", "--resume")

    assert (first["step"], rest["step"], whole["step"]) == (3, 6, 6)
    assert len(whole["windows"]) == 6
    # the same data, step for step: nothing repeated or skipped across the cut
    assert first["windows"] + rest["windows"] == whole["windows"]
    # and the same training: model, optimizer and schedule came back from the checkpoint
    cut, straight = weights(tmp_path / "cut.pt"), weights(tmp_path / "whole.pt")
    assert cut.keys() == straight.keys()
    for name in straight:
        torch.testing.assert_close(cut[name], straight[name], msg=name)
    assert rest["last_loss"] == pytest.approx(whole["last_loss"], rel=1e-5)


def test_train_hf_resume_without_checkpoint_stops(server: LiveServer, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no checkpoint"):
        train(server, tmp_path / "missing.pt", "--steps", "2", "--resume")


@pytest.mark.slow
def test_train_hf_serves_the_demo_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No endpoint: the example prepares the demo dataset and serves it for the run.
    monkeypatch.delenv("TOKENFEED_ENDPOINT", raising=False)
    summary = train_hf.run(
        [
            *("--store", str(tmp_path / "store"), "--steps", "2", "--num-workers", "0"),
            *("--seq-len", "32", "--batch-size", "2", "--d-model", "32", "--layers", "1"),
        ]
    )
    assert summary["step"] == 2
    assert (tmp_path / "store" / "demo" / "manifest.json").exists()


# ------------------------------------------------------------------ Stateful protocol


def loader(server: LiveServer, samples: int) -> TokenFeedLoader:
    ds = TokenFeedDataset(
        server.zmq, "alpha", seq_len=32, batch_size=4, seed=1, samples=samples, deadline=20.0
    )
    return TokenFeedLoader(ds, num_workers=0, pin_memory=False)


def test_loader_is_torchdata_stateful(server: LiveServer) -> None:
    assert isinstance(loader(server, 8), Stateful)


@pytest.mark.parametrize("method", ["state_dict", "load_state_dict"])
@pytest.mark.parametrize("cls", [TokenFeedLoader, TokenFeedDataset])
def test_stateful_signatures_match_exactly(cls: type, method: str) -> None:
    # The same parameter names and kinds as the protocol: a caller passing the state by
    # keyword (load_state_dict(state_dict=...)) works on every Stateful object, ours too.
    def params(fn: Any) -> list[tuple[str, Any]]:
        return [
            (p.name, p.kind)
            for p in inspect.signature(fn).parameters.values()
            if p.default is inspect.Parameter.empty
        ]

    assert params(getattr(cls, method)) == params(getattr(Stateful, method))


def test_stateful_round_trip_continues_the_stream(server: LiveServer) -> None:
    whole = [b["window_ids"] for b in loader(server, 6 * 4)]
    first = loader(server, 6 * 4)
    head = [b["window_ids"] for _, b in zip(range(2), first, strict=False)]
    state = first.state_dict()
    assert type(state) is dict

    second = loader(server, 6 * 4)
    assert second.load_state_dict(state_dict=state) is None
    tail = [b["window_ids"] for b in second]
    assert len(whole) == 6
    for got, want in zip(head + tail, whole, strict=True):
        assert torch.equal(got, want)


# ------------------------------------------------------------------ StatefulDataLoader

STEPS = 24


def stateful_data(server: LiveServer, *, batches_per_item: int | None = None) -> TokenFeedDataset:
    return TokenFeedDataset(
        server.zmq, "alpha", seq_len=32, batch_size=4, seed=2, rank=0, world_size=1,
        samples=STEPS * 4, batches_per_item=batches_per_item, deadline=20.0,
    )  # fmt: skip


def stateful(server: LiveServer, num_workers: int, **kwargs: Any) -> StatefulDataLoader[Any]:
    return StatefulDataLoader(
        stateful_data(server, **kwargs), batch_size=None, num_workers=num_workers
    )


def cut(loader: StatefulDataLoader[Any], taken: int) -> tuple[list[Any], dict[str, Any]]:
    """The first ``taken`` items and the loader's state then, as a checkpoint holds it."""
    items = iter(loader)
    head = [next(items) for _ in range(taken)]
    state = pickle.loads(pickle.dumps(loader.state_dict()))  # what torch.save keeps
    del items  # its workers stop
    return head, state


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resumes_where_it_stopped(server: LiveServer, num_workers: int) -> None:
    whole = [b["window_ids"] for b in stateful(server, num_workers)]
    head, state = cut(stateful(server, num_workers), 7)
    resumed = stateful(server, num_workers)
    resumed.load_state_dict(state)
    tail = [b["window_ids"] for b in resumed]

    assert len(whole) == STEPS and len(tail) == STEPS - 7  # not a restart from batch 0
    for step, (got, want) in enumerate(
        zip([b["window_ids"] for b in head] + tail, whole, strict=True)
    ):
        assert torch.equal(got, want), f"step {step}"


def test_a_worker_state_does_not_load_into_a_whole_rank_loader(server: LiveServer) -> None:
    _, state = cut(stateful(server, 2), 3)
    worker_state = next(iter(state["_snapshot"]["_worker_snapshots"].values()))["dataset_state"]
    assert worker_state["worker"]["num_workers"] == 2
    loader = TokenFeedLoader(stateful_data(server), num_workers=0, pin_memory=False)
    with pytest.raises(ConfigError, match="StatefulDataLoader of num_workers=2"):
        loader.load_state_dict(worker_state)
    assert loader.position == 0  # refused before anything changed


def test_packed_worker_items_are_refused_on_resume_not_restarted(server: LiveServer) -> None:
    _, state = cut(stateful(server, 2, batches_per_item=2), 3)
    resumed = stateful(server, 2, batches_per_item=2)
    resumed.load_state_dict(state)
    with pytest.raises(ConfigError, match="TokenFeedLoader"):
        next(iter(resumed))


# ------------------------------------------------------------------ the given dataset


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_leaves_the_dataset_as_it_was_given(server: LiveServer, num_workers: int) -> None:
    ds = stateful_data(server)
    loader = TokenFeedLoader(ds, num_workers=num_workers, pin_memory=False)
    through_loader = [b["window_ids"] for b in loader]
    if num_workers:
        assert loader.batches_per_item > 1  # the loader packs its workers' items
    assert (ds.batches_per_item, ds.auto_batches_per_item) == (1, True)
    # reused in a DataLoader of its own: plain batches, not packed items
    again = [b["window_ids"] for b in StatefulDataLoader(ds, batch_size=None, num_workers=2)]
    assert len(through_loader) == len(again) == STEPS
    for got, want in zip(again, through_loader, strict=True):
        assert torch.equal(got, want)
