"""What the server does with damaged and replaced datasets: refuse them clearly, keep
serving the others, and never let a running job mix two versions of a dataset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from live_server import LiveServer
from tokenfeed import TokenFeedDataset
from tokenfeed.errors import DatasetChanged, UnknownDataset
from tokenfeed_server.store import TokenizerInfo, write_dataset

pytestmark = pytest.mark.network

BYTE = TokenizerInfo(kind="byte", vocab_size=257, eos_id=256)


def docs(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=500, dtype=np.uint16) for _ in range(100)]


def dataset(srv: LiveServer, name: str, **kw: object) -> TokenFeedDataset:
    args: dict[str, object] = {
        "seq_len": 64,
        "batch_size": 4,
        "rank": 0,
        "world_size": 1,
        "request_timeout": 0.5,
        "deadline": 20.0,
    }
    args.update(kw)
    return TokenFeedDataset(srv.zmq, name, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_dataset_is_refused_and_the_rest_served(tmp_path: Path, damage: str) -> None:
    store = tmp_path / "store"
    write_dataset(store, "good", docs(1), tokenizer=BYTE, shuffle_seed=0)
    write_dataset(store, "bad", docs(2), tokenizer=BYTE, shuffle_seed=0, shard_tokens=20_000)
    shard = sorted((store / "bad").glob("shard-*"))[0]
    raw = bytearray(shard.read_bytes())
    if damage == "truncate":
        shard.write_bytes(bytes(raw[:-100]))  # caught by the size check at open
    else:
        raw[200] ^= 0xFF  # same size: only the checksum sees it
        shard.write_bytes(bytes(raw))
    log = tmp_path / "server.log"
    with LiveServer(store, extra=["--verify-checksums"], log_path=log) as srv:
        with pytest.raises(UnknownDataset, match="damaged"):
            next(iter(dataset(srv, "bad")))
        assert sum(1 for _ in dataset(srv, "good", samples=40)) == 10
        listed = {d["name"]: d for d in srv.get("/v1/datasets").json()}
        assert listed["good"]["ok"] is True and listed["bad"]["ok"] is False
        assert srv.get("/readyz").status_code == 200
    assert shard.name in log.read_text()  # the operator's log names the file


def test_a_replaced_dataset_is_never_mixed_into_a_running_job(tmp_path: Path) -> None:
    store = tmp_path / "store"
    write_dataset(store, "d", docs(1), tokenizer=BYTE, shuffle_seed=0)
    log = tmp_path / "server.log"
    srv = LiveServer(store, log_path=log).start()
    ds = dataset(srv, "d", samples=4 * 60, chunk_bytes=1, window=1)
    it = iter(ds)
    try:
        for _ in range(5):
            next(it)
        # The operator rebuilds the dataset and restarts the server mid-run.
        write_dataset(store, "d", docs(2), tokenizer=BYTE, shuffle_seed=0, overwrite=True)
        ports = {"zmq_port": srv.zmq_port, "http_port": srv.http_port}
        srv.kill()
        srv = LiveServer(store, log_path=log, **ports).start()
        with pytest.raises(DatasetChanged, match="replaced"):
            for _ in it:
                pass
        # A new run on the new dataset is fine.
        assert sum(1 for _ in dataset(srv, "d", samples=16)) == 4
    finally:
        srv.stop()
