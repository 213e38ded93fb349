"""``shuffle="block"`` from the trainer's side, against a real server process.

Two ranks with two DataLoader workers each read two epochs and a bit in block order:
every window exactly once per epoch, a new order each epoch, exactly the order
:class:`tokenfeed.plan.Plan` gives for the block sizes the server derived from the
manifest (:func:`tokenfeed.plan.default_block_sizes`: never from its cache), and the rows
hold the store's tokens. The resume state carries the mode and the sizes; a state loads
only into the same mode and sizes, and then continues the same stream with another world
size. A mixture in block order derives sizes per source.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from live_server import LiveServer
from shard_data import BYTE
from tokenfeed import TokenFeedDataset, TokenFeedLoader
from tokenfeed.errors import ConfigError
from tokenfeed.mixture import Mixture, source_seed
from tokenfeed.plan import Plan, default_block_sizes, steps_to_cover
from tokenfeed_server.store import open_dataset, write_dataset

pytestmark = pytest.mark.network

SEQ, SEED = 8, 5
SHARD = 509  # tokens per shard (the writer cuts there): regions of ~63 windows


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    rng = np.random.default_rng(9)
    for name, count in (("alpha", 131), ("beta", 47)):
        docs = [
            rng.integers(0, 256, size=int(n), dtype=np.uint16) for n in rng.integers(5, 50, count)
        ]
        write_dataset(root, name, docs, tokenizer=BYTE, shuffle_seed=0, shard_tokens=SHARD)
    return root


@pytest.fixture(scope="module")
def server(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with LiveServer(store, log_path=tmp_path_factory.mktemp("logs") / "server.log") as srv:
        yield srv


def stored(store: Path, name: str) -> tuple[np.ndarray, tuple[int, int]]:
    """The dataset's tokens, and the block sizes its manifest implies for SEQ."""
    with open_dataset(store, name) as ds:
        shards = [s.tokens for s in ds.manifest.shards]
        return ds.read(0, ds.n_tokens).copy(), default_block_sizes(shards, SEQ)


def block_dataset(
    srv: LiveServer, rank: int, world: int, batch: int, **kw: Any
) -> TokenFeedDataset:
    return TokenFeedDataset(
        srv.zmq, kw.pop("dataset", "alpha"), seq_len=SEQ, batch_size=batch, seed=SEED,
        rank=rank, world_size=world, shuffle=kw.pop("shuffle", "block"), deadline=30.0, **kw,
    )  # fmt: skip


def global_stream(loaders: list[TokenFeedLoader]) -> dict[str, np.ndarray]:
    per_rank = [list(iter(loader)) for loader in loaders]
    steps = {len(b) for b in per_rank}
    assert len(steps) == 1, steps
    ordered = [per_rank[r][t] for t in range(steps.pop()) for r in range(len(loaders))]
    keys = ordered[0].keys()
    return {k: torch.cat([b[k] for b in ordered]).numpy() for k in keys}


def test_every_window_once_per_epoch_over_two_ranks_and_two_workers(
    server: LiveServer, store: Path
) -> None:
    tokens, (region, block) = stored(store, "alpha")
    n_windows = (len(tokens) - 1) // SEQ
    assert n_windows // region >= 4  # several regions, so blocks really are a subset
    end = 2 * n_windows + 37  # two epochs and part of a third
    loaders = [
        TokenFeedLoader(block_dataset(server, r, 2, 3, samples=end), num_workers=2,
                        pin_memory=False)
        for r in range(2)
    ]  # fmt: skip
    got = global_stream(loaders)
    assert set(got) == {"input_ids", "labels", "window_ids", "epoch"}  # no "source"
    assert loaders[0].dataset.block_sizes == {"alpha": (region, block)}

    windows, epochs = got["window_ids"], got["epoch"]
    for e in (0, 1):
        np.testing.assert_array_equal(np.sort(windows[epochs == e]), np.arange(n_windows))
    assert len(set(windows[epochs == 2])) == (epochs == 2).sum()  # partial, no repeats
    assert not np.array_equal(windows[epochs == 0], windows[epochs == 1])  # new order

    plan = Plan(len(tokens), SEQ, 1, seed=SEED, shuffle="block", region_windows=region,
                block_regions=block)  # fmt: skip
    want_w, want_e = plan.windows(np.arange(len(windows)))
    np.testing.assert_array_equal(windows, want_w)
    np.testing.assert_array_equal(epochs, want_e)
    rows = tokens[want_w[:, None] * SEQ + np.arange(SEQ + 1)]
    np.testing.assert_array_equal(got["input_ids"], rows[:, :-1])
    np.testing.assert_array_equal(got["labels"], rows[:, 1:])
    # not the global order: the mode reached the server
    global_w, _ = Plan(len(tokens), SEQ, 1, seed=SEED).windows(np.arange(n_windows))
    assert not np.array_equal(windows[:n_windows], global_w)


def test_the_state_carries_the_mode_and_sizes_and_pins_them(
    server: LiveServer, store: Path
) -> None:
    tokens, (region, block) = stored(store, "alpha")
    first = TokenFeedLoader(block_dataset(server, 0, 1, 4, samples=40), num_workers=2,
                            pin_memory=False)  # fmt: skip
    head = global_stream([first])
    state = json.loads(json.dumps(first.state_dict()))
    assert state["shuffle"] == "block"
    assert state["block_sizes"] == {"alpha": [region, block]}
    assert state["position"] == 40

    with pytest.raises(ConfigError, match="shuffle='block'"):
        block_dataset(server, 0, 1, 4, shuffle="global").load_state_dict(state)
    with pytest.raises(ConfigError, match=f"region_windows={region}"):
        block_dataset(server, 0, 1, 4, region_windows=region + 1).load_state_dict(state)
    with pytest.raises(ConfigError, match=f"block_regions={block}"):
        block_dataset(server, 0, 1, 4, block_regions=block + 1).load_state_dict(state)
    # and the other way round: a global state does not load into block order
    plain = block_dataset(server, 0, 1, 4, shuffle="global", samples=8)
    assert len(list(plain)) == 2
    with pytest.raises(ConfigError, match="shuffle='global'"):
        block_dataset(server, 0, 1, 4).load_state_dict(plain.state_dict())

    # Same mode (sizes left to the state, or given equal): another world size continues.
    end = 160
    resumed = []
    for r in range(3):
        sizes = {"region_windows": region} if r == 2 else {}
        ds = block_dataset(server, r, 3, 2, samples=end, **sizes)
        ds.load_state_dict(state)
        assert ds.job.region_windows == region and ds.job.block_regions == block
        resumed.append(TokenFeedLoader(ds, num_workers=0, pin_memory=False))
    tail = global_stream(resumed)
    stop = 40 + steps_to_cover(40, end, 6) * 6
    plan = Plan(len(tokens), SEQ, 1, seed=SEED, shuffle="block", region_windows=region,
                block_regions=block)  # fmt: skip
    want, _ = plan.windows(np.arange(stop))
    np.testing.assert_array_equal(np.concatenate([head["window_ids"], tail["window_ids"]]), want)


def test_sizes_given_by_the_trainer_are_used(server: LiveServer, store: Path) -> None:
    tokens, _ = stored(store, "alpha")
    ds = block_dataset(server, 0, 1, 4, samples=64, region_windows=7, block_regions=3)
    got = torch.cat([b["window_ids"] for b in ds]).numpy()
    assert ds.block_sizes == {"alpha": (7, 3)}
    plan = Plan(len(tokens), SEQ, 1, seed=SEED, shuffle="block", region_windows=7,
                block_regions=3)  # fmt: skip
    np.testing.assert_array_equal(got, plan.windows(np.arange(64))[0])


def test_a_mixture_in_block_order_derives_sizes_per_source(server: LiveServer, store: Path) -> None:
    mix = Mixture({"alpha": 2, "beta": 1})
    ds = block_dataset(server, 0, 1, 3, dataset=mix, samples=90)
    batches = list(ds)
    state = ds.state_dict()
    pos = np.arange(90)
    src, local = mix.locate(pos)
    want = np.empty_like(pos)
    for i, name in enumerate(mix.names):
        tokens, sizes = stored(store, name)
        assert state["block_sizes"][name] == list(sizes)
        plan = Plan(len(tokens), SEQ, 1, seed=source_seed(SEED, name), shuffle="block",
                    region_windows=sizes[0], block_regions=sizes[1])  # fmt: skip
        want[src == i] = plan.windows(local[src == i])[0]
    np.testing.assert_array_equal(torch.cat([b["window_ids"] for b in batches]).numpy(), want)
    np.testing.assert_array_equal(torch.cat([b["source"] for b in batches]).numpy(), src)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shuffle": "local"}, "shuffle must be one of 'global', 'block'"),
        ({"shuffle": "global", "region_windows": 4}, 'apply to shuffle="block" only'),
        ({"region_windows": 0}, "region_windows must be an integer >= 1"),
        ({"block_regions": True}, "block_regions must be an integer >= 1"),
    ],
)
def test_impossible_shuffle_settings_are_refused(kwargs: dict[str, Any], match: str) -> None:
    kwargs.setdefault("shuffle", "block")
    with pytest.raises(ConfigError, match=match):
        TokenFeedDataset("tcp://127.0.0.1:1", "alpha", seq_len=SEQ, batch_size=2, rank=0,
                         world_size=1, **kwargs)  # fmt: skip
