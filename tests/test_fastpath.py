"""The fast path (``batches_per_item > 1``) changes the transport, never the batches.

A real server process and real DataLoader workers: with several batches per DataLoader
item, the loader must hand out exactly the batch sequence of ``batches_per_item=1``
(same windows, same tokens, same order), with ``num_workers`` 0 and 2, and a saved
``state_dict`` must resume exactly, whatever the item size and worker count on resume.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import numpy as np
import pytest
import torch

from live_server import LiveServer
from shard_data import BYTE
from tokenfeed import TokenFeedDataset, TokenFeedLoader
from tokenfeed.dataset import unpack
from tokenfeed_server.store import write_dataset

pytestmark = pytest.mark.network

SEQ, BATCH, STEPS = 32, 3, 23  # 23 steps: not a multiple of any item size or worker count


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("store")
    rng = np.random.default_rng(11)
    docs = [
        rng.integers(0, 256, size=int(n), dtype=np.uint16) for n in rng.integers(5, 300, size=200)
    ]
    write_dataset(root, "alpha", docs, tokenizer=BYTE, shuffle_seed=0, shard_tokens=9_000)
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with LiveServer(root, log_path=log) as srv:
        yield srv


def loader(
    server: LiveServer, *, k: int, workers: int, samples: int = STEPS * BATCH
) -> TokenFeedLoader:
    ds = TokenFeedDataset(
        server.zmq,
        "alpha",
        seq_len=SEQ,
        batch_size=BATCH,
        seed=5,
        rank=0,
        world_size=1,
        samples=samples,
        batches_per_item=k,
        request_timeout=2.0,
        deadline=20.0,
        # small chunks (5 batches), so that one item's batches span several messages
        chunk_bytes=1000,
    )
    return TokenFeedLoader(ds, num_workers=workers, pin_memory=False, prefetch=2)


Batch = dict[str, torch.Tensor]


def assert_same(got: list[Batch], want: list[Batch]) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.keys() == b.keys(), step
        for key in a:
            assert a[key].shape == b[key].shape, (step, key)
            assert a[key].dtype == b[key].dtype, (step, key)
            assert torch.equal(a[key], b[key]), (step, key)


@pytest.fixture(scope="module")
def reference(server: LiveServer) -> list[Batch]:
    return list(loader(server, k=1, workers=0))


def test_reference_is_the_plan(reference: list[Batch]) -> None:
    assert len(reference) == STEPS
    assert all(b["input_ids"].shape == (BATCH, SEQ) for b in reference)
    ids = torch.cat([b["window_ids"] for b in reference])
    assert len(set(ids.tolist())) == len(ids)  # fewer samples than one epoch: no repeats


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_items_of_k_batches_give_the_same_batches(
    server: LiveServer, reference: list[Batch], workers: int, k: int
) -> None:
    got = list(loader(server, k=k, workers=workers))
    assert_same(got, reference)
    for b in got:  # what a model wants: contiguous int64 rows
        assert b["input_ids"].is_contiguous() and b["labels"].is_contiguous()
        assert b["input_ids"].dtype == torch.int64


@pytest.mark.parametrize(
    ("k", "workers", "k2", "workers2", "cut"),
    [(4, 2, 4, 2, 9), (4, 2, 1, 0, 6), (3, 0, 5, 2, 10), (1, 2, 4, 2, 1)],
)
def test_resume_is_exact(
    server: LiveServer,
    reference: list[Batch],
    k: int,
    workers: int,
    k2: int,
    workers2: int,
    cut: int,
) -> None:
    first = loader(server, k=k, workers=workers)
    head = list(islice(iter(first), cut))  # stop mid-item: the rest of it is not consumed
    state = first.state_dict()
    assert state["position"] == cut * BATCH
    second = loader(server, k=k2, workers=workers2)
    second.load_state_dict(state)
    assert_same(head + list(second), reference)


def test_second_epoch_of_iter_continues(server: LiveServer, reference: list[Batch]) -> None:
    # Re-iterating the same loader continues from where the last iteration stopped.
    ld = loader(server, k=4, workers=2)
    head = list(islice(iter(ld), 5))
    assert_same(head + list(ld), reference)


def test_dataset_iterated_directly_yields_packed_items(server: LiveServer) -> None:
    ds = loader(server, k=4, workers=0).dataset
    items = list(ds)
    # items ramp up (1, 2, 4, ...) so the first batch is not held back, then stay at 4
    assert [int(i["batches"]) for i in items] == [1, 2] + [4] * 5
    batches = [b for i in items for b in unpack(i)]
    assert [b["input_ids"].shape for b in batches] == [(BATCH, SEQ)] * STEPS
    assert ds.position == STEPS * BATCH
