"""Received rows to the batches a model takes: int64 inputs and labels, provenance.

An :class:`~tokenfeed.transport.answer.Answer` holds raw tokens ``[rows, seq_len + 1]``
in the store's dtype; a batch is their inputs and labels as int64 plus ``window_ids``,
``epoch`` (and a mixture's ``source``). Between processes items travel *packed* (raw
tokens of several batches, :func:`pack`), and :func:`unpack` makes the batches where the
model is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal, get_args

import numpy as np
import torch

from tokenfeed.training.documents import document_fields
from tokenfeed.transport.answer import Answer

__all__ = [
    "LABEL_MODES",
    "Batch",
    "LabelMode",
    "batch_at",
    "batches_in",
    "batches_of",
    "pack",
    "unpack",
]

#: One batch: field name to tensor (``input_ids``, ``labels``, ``window_ids``, ...).
Batch = dict[str, torch.Tensor]

#: What ``labels`` holds: ``"shifted"``: the next token of each input (``labels[:, t] ==
#: token t + 1``), for a plain ``cross_entropy(logits, labels)``; ``"unshifted"``: a copy of
#: ``input_ids``, for models that shift inside their loss (Hugging Face causal LMs).
LabelMode = Literal["shifted", "unshifted"]
LABEL_MODES: tuple[LabelMode, ...] = get_args(LabelMode)


def from_rows(
    rows: np.ndarray,
    window_ids: torch.Tensor,
    epochs: torch.Tensor,
    eos_id: int | None,
    labels: LabelMode,
    *,
    sources: torch.Tensor | None = None,
) -> Batch:
    """One batch from its raw rows ``[batch_size, seq_len + 1]`` and provenance."""
    # The model wants contiguous int64 ids: convert straight from the received tokens, one
    # pass each for inputs and labels, and no other copy. Unshifted labels are a copy, not
    # the same tensor: masking labels in place (labels[...] = -100) must not edit inputs.
    input_ids = rows[:, :-1].astype(np.int64)
    targets = rows[:, 1:].astype(np.int64) if labels == "shifted" else input_ids.copy()
    batch = {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(targets),
        "window_ids": window_ids,
        "epoch": epochs,
    }
    if sources is not None:
        batch["source"] = sources
    if eos_id is not None:
        position_ids, cu_seqlens = document_fields(input_ids, eos_id)
        batch["position_ids"] = torch.from_numpy(position_ids)
        batch["cu_seqlens"] = torch.from_numpy(cu_seqlens)
    return batch


def batch_at(
    answer: Answer, b: int, batch_size: int, eos_id: int | None, labels: LabelMode
) -> Batch:
    """Batch ``b`` of an answer, converted."""
    rows = slice(b * batch_size, (b + 1) * batch_size)
    return from_rows(
        answer.tokens[rows],
        torch.from_numpy(answer.window_ids[rows].copy()),  # the received buffer is read-only
        torch.from_numpy(answer.epochs[rows].copy()),
        eos_id,
        labels,
        sources=None if answer.sources is None else torch.from_numpy(answer.sources[rows].copy()),
    )


def batches_of(
    answer: Answer, batch_size: int, eos_id: int | None = None, labels: LabelMode = "shifted"
) -> Iterator[Batch]:
    """The batches of one received answer, converted one at a time as they are taken.

    With ``eos_id``, each batch also carries ``position_ids`` and ``cu_seqlens``
    (see :func:`tokenfeed.training.documents.document_fields`); ``labels`` as in
    :class:`~tokenfeed.training.dataset.TokenFeedDataset`.
    """
    return (batch_at(answer, b, batch_size, eos_id, labels) for b in range(answer.request.count))


def pack(
    pieces: list[tuple[Answer, int, int]],
    batch_size: int,
    eos_id: int | None,
    labels: LabelMode,
) -> Batch:
    """One packed item of the batches ``[lo, hi)`` of each ``(answer, lo, hi)`` piece."""

    # One copy of the raw rows into a fresh (writable, shareable) array per item.
    def rows(field: str) -> np.ndarray:
        parts = [getattr(c, field)[lo * batch_size : hi * batch_size] for c, lo, hi in pieces]
        return np.concatenate(parts) if len(parts) > 1 else parts[0].copy()

    tokens = rows("tokens")
    n = len(tokens) // batch_size
    item = {
        "tokens": torch.from_numpy(tokens.reshape(n, batch_size, -1)),
        "window_ids": torch.from_numpy(rows("window_ids").reshape(n, batch_size)),
        "epoch": torch.from_numpy(rows("epochs").reshape(n, batch_size)),
    }
    if pieces[0][0].sources is not None:  # a mixture: every answer of the job has them
        item["source"] = torch.from_numpy(rows("sources").reshape(n, batch_size))
    if eos_id is not None:  # boundaries are computed where the item is unpacked
        item["eos_id"] = torch.tensor(eos_id)
    if labels == "unshifted":  # so is the label mode: the item says which one it wants
        item[_UNSHIFTED] = torch.tensor(True)
    return item


# Marks a packed item whose batches want unshifted labels (absent: shifted, as before).
_UNSHIFTED = "unshifted_labels"


def unpack(item: Batch) -> list[Batch]:
    """The batches of one packed item (``batches_per_item > 1``), as the model wants them.

    ``TokenFeedLoader`` calls this for you; call it yourself only if you put a
    ``TokenFeedDataset`` with ``batches_per_item > 1`` into your own DataLoader.
    """
    tokens = item["tokens"].numpy()
    eos_id = int(item["eos_id"]) if "eos_id" in item else None
    labels: LabelMode = "unshifted" if _UNSHIFTED in item else "shifted"
    sources = item.get("source")
    return [
        from_rows(
            tokens[i],
            item["window_ids"][i],
            item["epoch"][i],
            eos_id,
            labels,
            sources=None if sources is None else sources[i],
        )
        for i in range(tokens.shape[0])
    ]


def batches_in(item: Batch, batches_per_item: int) -> int:
    """How many batches an item of a dataset with ``batches_per_item`` holds."""
    return 1 if batches_per_item == 1 else int(item["tokens"].shape[0])
