"""The documented import path of :class:`TokenFeedDataset` (it lives in
:mod:`tokenfeed.training.dataset`, with the rest of the torch face)."""

from __future__ import annotations

from tokenfeed.training.batches import Batch, LabelMode, batches_of, unpack
from tokenfeed.training.config import DatasetArg, ShuffleMode
from tokenfeed.training.dataset import TokenFeedDataset

__all__ = [
    "Batch",
    "DatasetArg",
    "LabelMode",
    "ShuffleMode",
    "TokenFeedDataset",
    "batches_of",
    "unpack",
]
