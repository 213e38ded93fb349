"""Document boundaries in packed rows: by hand, and against the store's document index."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from live_server import LiveServer
from shard_data import BYTE
from tokenfeed import TokenFeedDataset, TokenFeedLoader
from tokenfeed.training.documents import document_fields
from tokenfeed_server.store import open_dataset, write_dataset

EOS = 9


def test_by_hand() -> None:
    rows = np.array([[1, 2, EOS, 3, 4, EOS, 5], [EOS, EOS, 6, 7, 8, 1, 2]])
    positions, cu = document_fields(rows, EOS)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 0], [0, 0, 0, 1, 2, 3, 4]]
    # pieces: [0,3) [3,6) [6,7) | row 2 starts at 7: [7,8) [8,9) [9,14)
    assert cu.tolist() == [0, 3, 6, 7, 8, 9, 14]
    assert cu.dtype == np.int32 and positions.dtype == np.int64


def test_no_eos_is_one_document_per_row() -> None:
    positions, cu = document_fields(np.ones((3, 4), dtype=np.int64), EOS)
    assert positions.tolist() == [[0, 1, 2, 3]] * 3
    assert cu.tolist() == [0, 4, 8, 12]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("store")
    rng = np.random.default_rng(11)
    docs = [rng.integers(0, 256, size=int(n), dtype=np.uint16) for n in rng.integers(1, 90, 400)]
    write_dataset(
        root,
        "docs",
        docs,
        shuffle_seed=0,
        shard_tokens=5000,
        tokenizer=BYTE,
    )
    with LiveServer(root) as srv:
        yield srv


@pytest.mark.network
@pytest.mark.parametrize(("workers", "per_item"), [(0, None), (2, 1), (2, None)])
def test_boundaries_match_the_store_document_index(
    server: LiveServer, workers: int, per_item: int | None
) -> None:
    seq = 64
    ds = TokenFeedDataset(
        server.zmq,
        "docs",
        seq_len=seq,
        batch_size=4,
        rank=0,
        world_size=1,
        samples=4 * 30,
        document_boundaries=True,
        batches_per_item=per_item,
    )
    assert server.store is not None
    store = open_dataset(server.store, "docs")
    checked = 0
    for batch in TokenFeedLoader(ds, num_workers=workers, pin_memory=False):
        positions = batch["position_ids"].numpy()
        for row, w in enumerate(batch["window_ids"].tolist()):
            start = w * seq
            # a document starts at every index entry inside the row's inputs
            starts = store.document_starts(start + 1, start + seq) - start
            zeros = np.flatnonzero(positions[row] == 0)
            assert zeros.tolist() == [0, *starts.tolist()]
            checked += 1
        cu = batch["cu_seqlens"].numpy()
        assert cu[0] == 0 and cu[-1] == positions.size
        assert int((positions.ravel() == 0).sum()) == len(cu) - 1
    assert checked == 4 * 30
    store.close()
