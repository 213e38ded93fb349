"""Resuming after the dataset was rebuilt continues on the build the state was saved on
while the store keeps it, and is refused, not silently trained on other data, once not.

The whole path as a user walks it: ``prepare`` a corpus, serve it, train a few batches,
save ``loader.state_dict()``, ``prepare --overwrite`` another corpus under the same name,
restart the server, load the state, iterate: the state carries the dataset's fingerprint,
which names its version, kept by the overwrite; the batches are those the first build
gives. Once that version is removed from the store, the same step raises
:class:`DatasetChanged` naming both builds and how to start over.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest

from live_server import LiveServer
from tokenfeed import TokenFeedDataset, TokenFeedLoader
from tokenfeed.errors import DatasetChanged
from tokenfeed_server.store import open_dataset
from tokenfeed_server.store.versions import local_version_dir

pytestmark = pytest.mark.network


def prepare(store: Path, corpus: Path, *, overwrite: bool = False) -> str:
    """Run ``tokenfeed-server prepare`` on ``corpus``; return the new build's fingerprint."""
    cmd = [
        sys.executable, "-m", "tokenfeed_server.cli", "prepare", "--store", str(store),
        "--dataset", "alpha", "--no-progress", str(corpus),
    ]  # fmt: skip
    if overwrite:
        cmd.append("--overwrite")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return str(open_dataset(store, "alpha").fingerprint)


def corpus(root: Path, words: str) -> Path:
    root.mkdir()
    for i in range(8):
        (root / f"part-{i}.txt").write_text(f"{words} {i} " * 300)
    return root


def make_loader(endpoint: str, workers: int) -> TokenFeedLoader:
    ds = TokenFeedDataset(
        endpoint, "alpha", seq_len=32, batch_size=2, rank=0, world_size=1, deadline=20.0
    )
    return TokenFeedLoader(ds, num_workers=workers, pin_memory=False)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_after_a_rebuild_continues_on_its_version_while_kept(
    tmp_path: Path, workers: int
) -> None:
    store = tmp_path / "store"
    first = prepare(store, corpus(tmp_path / "a", "the first corpus"))
    with LiveServer(store, log_path=tmp_path / "log") as srv:
        reference = [b["input_ids"] for b in islice(iter(make_loader(srv.zmq, 0)), 6)]
        loader = make_loader(srv.zmq, workers)
        assert len(list(islice(iter(loader), 3))) == 3
        state = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint stores it
    assert state["fingerprint"] == first and state["position"] == 6

    second = prepare(store, corpus(tmp_path / "b", "another text"), overwrite=True)
    assert second != first
    with LiveServer(store, log_path=tmp_path / "log") as srv:
        resumed = make_loader(srv.zmq, workers)
        resumed.load_state_dict(state)
        tail = [b["input_ids"] for b in islice(iter(resumed), 3)]
        assert all((a == b).all() for a, b in zip(tail, reference[3:], strict=True))
        assert resumed.state_dict()["fingerprint"] == first
        # A fresh loader (no state) reads the new build.
        fresh = make_loader(srv.zmq, workers)
        assert len(list(islice(iter(fresh), 2))) == 2
        assert fresh.state_dict()["fingerprint"] == second

    shutil.rmtree(local_version_dir(store, "alpha", first))  # what gc does, in time
    with LiveServer(store, log_path=tmp_path / "log") as srv:
        resumed = make_loader(srv.zmq, workers)
        resumed.load_state_dict(state)
        with pytest.raises(DatasetChanged) as info:
            next(iter(resumed))
        message = str(info.value)
        assert first in message  # what the state expects
        assert second in message  # what the server has now
        assert "no longer kept" in message
        assert "drop the loader state" in message  # how to start over on purpose


def test_resume_of_the_same_build_continues(tmp_path: Path) -> None:
    store = tmp_path / "store"
    prepare(store, corpus(tmp_path / "a", "one corpus"))
    with LiveServer(store, log_path=tmp_path / "log") as srv:
        reference = [b["input_ids"] for b in islice(iter(make_loader(srv.zmq, 0)), 6)]
        loader = make_loader(srv.zmq, 0)
        head = [b["input_ids"] for b in islice(iter(loader), 2)]
        resumed = make_loader(srv.zmq, 2)
        resumed.load_state_dict(loader.state_dict())
        tail = [b["input_ids"] for b in islice(iter(resumed), 4)]
    assert all((a == b).all() for a, b in zip(head + tail, reference, strict=True))


def test_a_state_without_fingerprint_loads_with_a_warning(tmp_path: Path) -> None:
    store = tmp_path / "store"
    prepare(store, corpus(tmp_path / "a", "one corpus"))
    with LiveServer(store, log_path=tmp_path / "log") as srv:
        loader = make_loader(srv.zmq, 0)
        list(islice(iter(loader), 2))
        old = loader.state_dict()
        del old["fingerprint"]  # as saved before states carried one
        resumed = make_loader(srv.zmq, 0)
        with pytest.warns(UserWarning, match="carries no dataset fingerprint"):
            resumed.load_state_dict(old)
        assert len(list(islice(iter(resumed), 2))) == 2
        assert resumed.state_dict()["position"] == 8
