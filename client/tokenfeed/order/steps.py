"""Global steps, resume positions and DataLoader workers: which positions a step covers.

Global step ``t`` counted from a resume position ``start`` covers the stream positions
``[start + t*G, start + (t+1)*G)`` (``G = world_size * batch_size``), so a job resumed
with another ``G`` continues the identical stream: positions, not step numbers, are what
count. A torch DataLoader takes items from its workers round-robin, starting at worker 0
on every ``iter()``; :func:`worker_steps` hands each worker the steps that make the loader
yield local steps ``0, 1, 2, ...`` in order.
"""

from __future__ import annotations

from collections.abc import Iterator

from tokenfeed.errors import PlanError
from tokenfeed.order.ints import INT64_MAX, check_int

__all__ = ["step_position", "steps_to_cover", "worker_steps"]


def step_position(start: int, step: int, global_batch: int) -> int:
    """Stream position of global step ``step`` counted from resume point ``start``:
    ``start + step * global_batch``."""
    start = check_int("start", start, 0, INT64_MAX)
    step = check_int("step", step, 0, INT64_MAX)
    global_batch = check_int("global_batch", global_batch, 1, INT64_MAX)
    p = start + step * global_batch
    if p > INT64_MAX:
        raise PlanError(f"step {step} from position {start} overflows int64")
    return p


def steps_to_cover(start: int, end: int, global_batch: int) -> int:
    """Global steps from ``start`` needed to serve every position below ``end``:
    ``ceil((end - start) / global_batch)``, 0 if ``end <= start``.

    Every rank gets this same number of steps; the last global batch may run past
    ``end`` into the next epoch (nothing is dropped to even it out).
    """
    start = check_int("start", start, 0, INT64_MAX)
    end = check_int("end", end, 0, INT64_MAX)
    global_batch = check_int("global_batch", global_batch, 1, INT64_MAX)
    return max(0, -((start - end) // global_batch))


def worker_steps(
    worker: int,
    num_workers: int,
    n_steps: int | None,
    batches_per_item: int = 1,
    *,
    ramp: bool = False,
) -> Iterator[list[int]]:
    """The local steps DataLoader worker ``worker`` of ``num_workers`` produces, item by item.

    Item ``g`` carries steps ``[g*k, (g+1)*k)`` (``k = batches_per_item``; the last item is
    shorter when ``n_steps`` is finite) and worker ``w`` produces items ``w, w+K, ...``, so
    the loader's round-robin over workers yields local steps ``0, 1, 2, ...`` in order.
    ``num_workers=0`` means the main process produces everything; ``n_steps=None`` is
    endless.

    With ``ramp``, round ``r`` of items (each worker's ``r``-th) carries ``min(k, 2**r)``
    steps instead of ``k``: the first item of every worker is a single batch, so the
    first batch reaches the trainer as soon as one batch is received, and items grow to
    ``k`` within a few rounds. The order is the same; only the item boundaries move.
    """
    num_workers = check_int("num_workers", num_workers, 0, INT64_MAX)
    n_workers = max(1, num_workers)
    worker = check_int("worker", worker, 0, INT64_MAX)
    if worker >= n_workers:
        raise PlanError(
            f"worker {worker} is out of range for num_workers {num_workers}; "
            f"workers are 0..{n_workers - 1}"
        )
    if n_steps is not None:
        n_steps = check_int("n_steps", n_steps, 0, INT64_MAX)
    k = check_int("batches_per_item", batches_per_item, 1, INT64_MAX)
    return _worker_steps(worker, n_workers, n_steps, k, 1 if ramp else k)


def _worker_steps(
    w: int, n_workers: int, n_steps: int | None, k: int, size: int
) -> Iterator[list[int]]:
    round_start = 0  # first step of the current round of items (one item per worker)
    while True:
        first = round_start + w * size
        if n_steps is not None and first >= n_steps:
            return
        last = first + size if n_steps is None else min(first + size, n_steps)
        yield list(range(first, last))
        round_start += n_workers * size
        size = min(k, 2 * size)
