"""A mixture end to end: real server process, real DataLoader workers, a resume.

Three datasets of odd sizes, prepared with one tokenizer (each from its own range of
byte values, so a row's tokens also say which source it came from), blended by a
schedule whose weights change mid-epoch of a source. Two ranks with two DataLoader
workers each read the first part of the stream; the run stops, saves its state, and
resumes with three ranks, another batch size, other worker counts (the background
thread, one batch per item, packed items) and a schedule changed after the saved
position (an anneal decided at the resume). The concatenated global stream must be
exactly the one the plan math gives in one process (``Mixture.locate``, then each
source's own ``Plan`` with ``source_seed``), and every row must hold its source's tokens
as the store has them. A schedule that rewrites the past is refused, so is ``epochs=``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from live_server import LiveServer
from shard_data import BYTE
from tokenfeed import Mixture, TokenFeedDataset, TokenFeedLoader
from tokenfeed.errors import ConfigError, DatasetChanged
from tokenfeed.mixture import source_seed
from tokenfeed.plan import Plan, steps_to_cover
from tokenfeed_server.store import open_dataset, write_dataset

pytestmark = pytest.mark.network

SEQ, SEED = 8, 11
# Disjoint byte ranges per source: a row's tokens alone say where it came from.
RANGES = {"web": (0, 90), "code": (90, 180), "math": (180, 256)}
# Odd sizes (documents of odd lengths): windows are not multiples of anything here.
DOCS = {"web": (37, 29), "code": (23, 31), "math": (13, 27)}
FIELDS = ("input_ids", "labels", "window_ids", "epoch", "source")

# The anneal the run started with, and the one decided at the resume (position 160):
# identical up to 160, different after it. "math" joins only in the second segment.
FIRST = Mixture([(0, {"web": 3, "code": 2}), (101, {"web": 2, "code": 1, "math": 1}),
                 (300, {"web": 1, "code": 1, "math": 1})])  # fmt: skip
ANNEAL = Mixture([(0, {"web": 3, "code": 2}), (101, {"web": 2, "code": 1, "math": 1}),
                  (233, {"web": 1, "code": 1, "math": 5})])  # fmt: skip
PAUSE, END = 160, 480


@dataclass
class Source:
    tokens: np.ndarray  # the dataset's whole stream, as the store has it
    n_windows: int


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    for i, (name, (count, length)) in enumerate(DOCS.items()):
        lo, hi = RANGES[name]
        rng = np.random.default_rng(i)
        docs = [rng.integers(lo, hi, size=length + k % 5, dtype=np.uint16) for k in range(count)]
        write_dataset(root, name, docs, tokenizer=BYTE, shuffle_seed=i, shard_tokens=300)
    return root


@pytest.fixture(scope="module")
def sources(store: Path) -> dict[str, Source]:
    out = {}
    for name in DOCS:
        with open_dataset(store, name) as ds:
            n = ds.n_tokens
            out[name] = Source(ds.read(0, n).copy(), (n - 1) // SEQ)
    return out


@pytest.fixture(scope="module")
def server(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with LiveServer(store, log_path=tmp_path_factory.mktemp("logs") / "server.log") as srv:
        yield srv


def reference(mix: Mixture, sources: dict[str, Source], stop: int) -> dict[str, np.ndarray]:
    """The global stream ``[0, stop)`` from the plan math alone, in one process."""
    pos = np.arange(stop, dtype=np.int64)
    src, local = mix.locate(pos)
    window, epoch = np.empty_like(pos), np.empty_like(pos)
    rows = np.empty((stop, SEQ + 1), dtype=np.int64)
    for i, name in enumerate(mix.names):
        sel = src == i
        n_tokens = len(sources[name].tokens)
        plan = Plan(n_tokens, SEQ, 1, seed=source_seed(SEED, name))
        window[sel], epoch[sel] = plan.windows(local[sel])
        starts = window[sel] * SEQ
        rows[sel] = sources[name].tokens[starts[:, None] + np.arange(SEQ + 1)]
    return {
        "input_ids": rows[:, :-1],
        "labels": rows[:, 1:],
        "window_ids": window,
        "epoch": epoch,
        "source": src,
    }


def dataset(
    srv: LiveServer, mix: Any, rank: int, world: int, batch: int, **kw: Any
) -> TokenFeedDataset:
    return TokenFeedDataset(
        srv.zmq, mix, seq_len=SEQ, batch_size=batch, seed=SEED, rank=rank, world_size=world,
        samples=kw.pop("samples", END), deadline=30.0, **kw,
    )  # fmt: skip


def run_ranks(loaders: list[TokenFeedLoader]) -> dict[str, np.ndarray]:
    """Every rank's batches to the end, interleaved into the global stream."""
    per_rank = [list(iter(loader)) for loader in loaders]
    steps = {len(batches) for batches in per_rank}
    assert len(steps) == 1, f"ranks ended at different steps: {steps}"
    for batches in per_rank:
        for b in batches:
            assert set(b) == set(FIELDS), sorted(b)
            assert all(b[k].dtype == torch.int64 for k in FIELDS)
    ordered = [per_rank[r][t] for t in range(steps.pop()) for r in range(len(loaders))]
    return {k: torch.cat([b[k] for b in ordered]).numpy() for k in FIELDS}


def check_stream(got: dict[str, np.ndarray], want: dict[str, np.ndarray], start: int) -> None:
    n = len(got["source"])
    for key in FIELDS:
        np.testing.assert_array_equal(got[key], want[key][start : start + n], err_msg=key)


def test_two_ranks_then_three_continue_the_one_process_stream(
    server: LiveServer, sources: dict[str, Source]
) -> None:
    # The first schedule change falls mid-epoch of every source that read before it.
    counts = FIRST.counts(101)
    for name, count in zip(FIRST.names, counts, strict=True):
        assert count == 0 or count % sources[name].n_windows, (name, count)

    # -- 2 ranks x 2 DataLoader workers (packed items), up to the pause ------------------
    first = [
        TokenFeedLoader(dataset(server, FIRST, r, 2, 4, samples=PAUSE), num_workers=2,
                        pin_memory=False)
        for r in range(2)
    ]  # fmt: skip
    assert first[0].batches_per_item > 1  # items cross the process boundary packed
    head = run_ranks(first)
    state = json.loads(json.dumps(first[0].state_dict()))  # as a checkpoint stores it
    assert state["position"] == PAUSE == len(head["source"])
    assert state["schedule"] == FIRST.to_state()
    assert set(state["fingerprints"]) == set(FIRST.names)
    assert state["shuffle"] == "global" and state["block_sizes"] == {}

    # -- resume: 3 ranks, batch 5, workers 0 / 1 (one batch per item) / 2, new anneal -----
    second = []
    for r, workers in enumerate([0, 1, 2]):
        per_item = {"batches_per_item": 1} if r == 1 else {}
        ds = dataset(server, ANNEAL, r, 3, 5, **per_item)
        loader = TokenFeedLoader(ds, num_workers=workers, pin_memory=False)
        loader.load_state_dict(state)
        second.append(loader)
    tail = run_ranks(second)
    stop = PAUSE + steps_to_cover(PAUSE, END, 15) * 15
    assert len(tail["source"]) == stop - PAUSE

    want = reference(ANNEAL, sources, stop)
    check_stream(head, want, 0)
    check_stream(tail, want, PAUSE)
    np.testing.assert_array_equal(
        want["source"][:PAUSE], reference(FIRST, sources, PAUSE)["source"]
    )  # the anneal did not touch the past

    # Rows hold their source's tokens (also by value range), and within every source
    # each complete epoch holds each window exactly once.
    rows = np.concatenate([head["input_ids"], tail["input_ids"]])
    src = np.concatenate([head["source"], tail["source"]])
    windows = np.concatenate([head["window_ids"], tail["window_ids"]])
    epochs = np.concatenate([head["epoch"], tail["epoch"]])
    for i, name in enumerate(ANNEAL.names):
        lo, hi = RANGES[name]
        mine = rows[src == i]
        assert mine.size and ((mine >= lo) & (mine < hi) | (mine == BYTE.eos_id)).all(), name
        n_windows = sources[name].n_windows
        for e in range(int(epochs[src == i].max())):  # the last epoch may be partial
            seen = np.sort(windows[(src == i) & (epochs == e)])
            np.testing.assert_array_equal(seen, np.arange(n_windows), err_msg=f"{name} {e}")
    # the anneal shows: math's share after 233 is 5/7
    late = src[233 + 7 * 10 : 233 + 7 * 20]
    assert (late == ANNEAL.names.index("math")).sum() == 50


def test_a_schedule_that_rewrites_the_past_is_refused(server: LiveServer) -> None:
    loader = TokenFeedLoader(dataset(server, FIRST, 0, 1, 4, samples=PAUSE), num_workers=0,
                             pin_memory=False)  # fmt: skip
    batches = list(iter(loader))
    assert len(batches) == PAUSE // 4
    state = loader.state_dict()
    head = [(0, {"web": 3, "code": 2})]
    rewrites = {
        "an earlier boundary": Mixture([*head, (90, {"web": 2, "code": 1, "math": 1})]),
        "other weights before the position": Mixture(
            [*head, (101, {"web": 1, "code": 1, "math": 1})]
        ),
        "a new segment before the position": Mixture(
            [*head, (101, {"web": 2, "code": 1, "math": 1}), (150, {"web": 1, "math": 1})]
        ),
    }
    for what, mix in rewrites.items():
        resumed = dataset(server, mix, 0, 1, 4)
        with pytest.raises(ConfigError, match="does not continue the saved one") as info:
            resumed.load_state_dict(state)
        assert "segment" in str(info.value), what
        assert resumed.position == 0, what  # nothing half-loaded
    # A plain mapping is a one-segment schedule: it rewrites the boundary at 101.
    with pytest.raises(ConfigError, match="does not continue"):
        dataset(server, {"web": 3, "code": 2}, 0, 1, 4).load_state_dict(state)
    # The same dataset as one name is not this stream at all.
    with pytest.raises(ConfigError, match="mixture"):
        dataset(server, "web", 0, 1, 4).load_state_dict(state)
    # Changed only after the position: accepted, and it reads on.
    later = dataset(server, ANNEAL, 0, 1, 4, samples=PAUSE + 8)
    later.load_state_dict(state)
    assert [int(b["source"].numel()) for b in later] == [4, 4]


def test_another_build_of_one_source_is_refused_naming_it(server: LiveServer) -> None:
    ds = dataset(server, FIRST, 0, 1, 4, samples=8)
    assert len(list(ds)) == 2
    state = ds.state_dict()
    state["fingerprints"]["code"] = "0" * 32  # as if "code" was prepared again since
    resumed = dataset(server, FIRST, 0, 1, 4)
    resumed.load_state_dict(state)
    with pytest.raises(DatasetChanged, match="'code'") as info:
        next(iter(resumed))
    assert "0" * 32 in str(info.value)


def test_a_mapping_of_weights_is_a_mixture_and_direct_iteration_carries_source(
    server: LiveServer, sources: dict[str, Source]
) -> None:
    weights = {"web": 7, "code": 2, "math": 1}
    ds = dataset(server, weights, 0, 1, 5, samples=50)
    batches = list(ds)
    assert ds.mixture is not None and ds.mixture.names == ("web", "code", "math")
    got = {k: torch.cat([b[k] for b in batches]).numpy() for k in FIELDS}
    check_stream(got, reference(Mixture.of(weights), sources, 50), 0)
    assert np.bincount(got["source"], minlength=3).tolist() == [35, 10, 5]  # exact shares
    assert ds.state_dict()["position"] == 50


def test_packed_items_carry_source_and_single_datasets_do_not(server: LiveServer) -> None:
    mixed = TokenFeedLoader(dataset(server, FIRST, 0, 1, 2, samples=40, batches_per_item=4),
                            num_workers=2, pin_memory=False)  # fmt: skip
    assert all("source" in b for b in islice(iter(mixed), 20))
    single = TokenFeedLoader(
        TokenFeedDataset(server.zmq, "web", seq_len=SEQ, batch_size=2, rank=0, world_size=1,
                         samples=16, batches_per_item=4),
        num_workers=2, pin_memory=False,
    )  # fmt: skip
    batches = list(iter(single))
    assert len(batches) == 8
    assert all(set(b) == {"input_ids", "labels", "window_ids", "epoch"} for b in batches)
    assert "schedule" not in single.state_dict()


def test_epochs_is_refused_for_a_mixture() -> None:
    with pytest.raises(ConfigError, match=r"epochs belong to each source.*samples="):
        TokenFeedDataset("tcp://127.0.0.1:1", {"web": 1, "code": 1}, seq_len=SEQ,
                         batch_size=2, rank=0, world_size=1, epochs=1)  # fmt: skip
