"""Received rows to the batches a model takes: int64 inputs and labels, provenance.

An :class:`~tokenfeed.transport.answer.Answer` holds raw tokens ``[rows, seq_len + 1]``
in the store's dtype; a batch is their inputs and labels as int64 plus ``window_ids``,
``epoch`` (and a mixture's ``source``). Between processes items travel *packed* (raw
tokens of several batches, :func:`pack`), and :func:`unpack` makes the batches where the
model is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal, get_args

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
) -> dict[str, Any]:
    """One packed item of the batches ``[lo, hi)`` of each ``(answer, lo, hi)`` piece.

    Everything in one tensor: a DataLoader hands each tensor of an item to the main
    process separately (with torch's default sharing, a descriptor passed over a fresh
    authenticated connection per tensor, most of the main process's time at two workers),
    so the provenance rows (int64, first, aligned) and the raw tokens share one uint8
    buffer, and the layout travels as plain values.
    """
    n = sum(hi - lo for _, lo, hi in pieces)
    first = pieces[0][0]
    fields = [f for f in _FIELDS if getattr(first, f) is not None]
    cols, dtype = first.tokens.shape[1], first.tokens.dtype
    rows = n * batch_size
    buf = np.empty(rows * (8 * len(fields) + cols * dtype.itemsize), dtype=np.uint8)
    parts = _views(buf, fields, rows, cols, dtype)
    for name, part in zip([*fields, "tokens"], parts, strict=True):
        at = 0
        for answer, lo, hi in pieces:  # one copy of the received rows into the item
            block = getattr(answer, name)[lo * batch_size : hi * batch_size]
            part[at : at + len(block)] = block
            at += len(block)
    return {  # plain values pass through a DataLoader as they are
        _PACKED: torch.from_numpy(buf),
        "batches": n,
        "batch_size": batch_size,
        "layout": (tuple(fields), cols, dtype.str),
        "eos_id": eos_id,
        "labels": labels,
    }


# The provenance an answer may carry, in item order (int64 each, one per row).
_FIELDS = ("window_ids", "epochs", "sources")
# The batch keys they become.
_BATCH_KEYS = {"window_ids": "window_ids", "epochs": "epoch", "sources": "source"}
_PACKED = "packed"


def _views(
    buf: np.ndarray, fields: list[str], rows: int, cols: int, dtype: np.dtype[Any]
) -> list[np.ndarray]:
    """The item buffer's parts: one int64 row per field, then tokens ``[rows, cols]``."""
    parts: list[np.ndarray] = []
    at = 0
    for _ in fields:
        parts.append(buf[at : at + 8 * rows].view(np.int64))
        at += 8 * rows
    parts.append(buf[at:].view(dtype).reshape(rows, cols))
    return parts


def unpack(item: dict[str, Any]) -> list[Batch]:
    """The batches of one packed item (``batches_per_item > 1``), as the model wants them.

    ``TokenFeedLoader`` calls this for you; call it yourself only if you put a
    ``TokenFeedDataset`` with ``batches_per_item > 1`` into your own DataLoader.
    """
    fields, cols, dtype = item["layout"]
    b, n = int(item["batch_size"]), int(item["batches"])
    *provenance, tokens = _views(item[_PACKED].numpy(), list(fields), n * b, cols, np.dtype(dtype))
    got = {_BATCH_KEYS[f]: torch.from_numpy(p) for f, p in zip(fields, provenance, strict=True)}
    sources = got.get("source")
    return [
        from_rows(
            tokens[i * b : (i + 1) * b],
            got["window_ids"][i * b : (i + 1) * b],
            got["epoch"][i * b : (i + 1) * b],
            item["eos_id"],
            item["labels"],
            sources=None if sources is None else sources[i * b : (i + 1) * b],
        )
        for i in range(n)
    ]


def batches_in(item: dict[str, Any], batches_per_item: int) -> int:
    """How many batches an item of a dataset with ``batches_per_item`` holds."""
    return 1 if batches_per_item == 1 else int(item["batches"])
