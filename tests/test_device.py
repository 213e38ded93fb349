"""Host-to-device staging without a GPU: pass-through, and one clear warning for pinning."""

from __future__ import annotations

import warnings

import pytest
import torch

from tokenfeed import TokenFeedDataset, TokenFeedLoader
from tokenfeed.training.device import stage


def batches(n: int) -> list[dict[str, torch.Tensor]]:
    return [
        {"input_ids": torch.full((2, 3), i), "epoch": torch.zeros(2, dtype=torch.int64)}
        for i in range(n)
    ]


def test_cpu_stage_is_a_pass_through() -> None:
    out = list(stage(iter(batches(5)), torch.device("cpu")))
    assert [int(b["input_ids"][0, 0]) for b in out] == [0, 1, 2, 3, 4]
    assert all(b["input_ids"].device.type == "cpu" for b in out)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_pin_memory_without_cuda_warns_once_and_carries_on() -> None:
    ds = TokenFeedDataset("tcp://127.0.0.1:9", "x", seq_len=8, batch_size=2, rank=0, world_size=1)
    with pytest.warns(UserWarning, match="CUDA is not available") as record:
        loader = TokenFeedLoader(ds, num_workers=0, pin_memory=True)
    assert len(record) == 1
    assert loader.pin_memory is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = TokenFeedLoader(ds, num_workers=0)  # the default pins only with CUDA
    assert quiet.pin_memory is False
