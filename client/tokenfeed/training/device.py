"""Host-to-GPU staging: pinned buffers and asynchronous copies on a side stream.

:func:`stage` moves each batch to the device one step ahead of the consumer: the copy of
batch ``i+1`` is issued on a side stream while the model computes on batch ``i``. A ring
of ``depth`` (>= 2) pinned host buffers feeds the copies; a buffer is reused only after
the CUDA event recorded behind its last copy has completed, so a copy never reads memory
that is being overwritten. The consumer's stream waits on the batch's event before use,
and ``record_stream`` keeps the caching allocator from recycling the device memory early.

Without CUDA (or for a CPU device) this is a plain pass-through.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from tokenfeed.training.batches import Batch

__all__ = ["stage"]


def stage(batches: Iterable[Batch], device: torch.device, depth: int = 2) -> Iterator[Batch]:
    """Yield ``batches`` on ``device``, copying the next one while the current is used."""
    if device.type != "cuda":
        for batch in batches:
            yield {k: v.to(device) for k, v in batch.items()}
        return
    if depth < 2:
        raise ValueError("depth must be >= 2: one buffer in use, one being filled")
    stream = torch.cuda.Stream(device)
    ring: list[Batch] = [{} for _ in range(depth)]
    events: list[torch.cuda.Event | None] = [None] * depth
    ahead: tuple[Batch, torch.cuda.Event] | None = None
    for i, batch in enumerate(batches):
        slot = i % depth
        done = events[slot]
        if done is not None:
            done.synchronize()  # the copy that last read this pinned buffer has finished
        host = _pinned(ring[slot], batch)
        with torch.cuda.stream(stream):
            on_device = {k: v.to(device, non_blocking=True) for k, v in host.items()}
            event = torch.cuda.Event()
            event.record(stream)
        events[slot] = event
        if ahead is not None:
            yield _ready(*ahead, device)
        ahead = (on_device, event)
    if ahead is not None:
        yield _ready(*ahead, device)


def _pinned(buffers: Batch, batch: Batch) -> Batch:
    out = {}
    for key, value in batch.items():
        if value.is_pinned():
            out[key] = value  # the DataLoader's pin thread already did it
            continue
        # Flat buffers that only grow: fields whose size changes from batch to batch
        # (cu_seqlens) reuse them instead of pinning new memory every step.
        buf = buffers.get(key)
        if buf is None or buf.dtype != value.dtype or buf.numel() < value.numel():
            buf = buffers[key] = torch.empty(
                max(value.numel(), 1), dtype=value.dtype, device="cpu"
            ).pin_memory()
        out[key] = buf[: value.numel()].view(value.shape).copy_(value)
    return out


def _ready(batch: Batch, event: torch.cuda.Event, device: torch.device) -> Batch:
    current = torch.cuda.current_stream(device)
    current.wait_event(event)
    for tensor in batch.values():
        tensor.record_stream(current)
    return batch
