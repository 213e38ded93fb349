"""The block shuffle built the slow, obvious way (lists, no O(1) arithmetic), to check the
fast one against; shared by the order and plan tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenfeed.order import blocks
from tokenfeed.order.feistel import permute
from tokenfeed.order.splitmix import splitmix64


@dataclass
class RefBlock:
    start: int  # first epoch-local position
    regions: list[int]  # in slot order
    order: list[int]  # window ids, position by position


def reference_epoch(w: int, r: int, k: int, seed: int, epoch: int) -> list[RefBlock]:
    """The block shuffle of one epoch built the slow, obvious way from the public
    ``permute``/``splitmix64`` and the block module's key tags: lists, no O(1) arithmetic."""
    r = min(r, w)
    m = -(-w // r)
    k = min(k, m)
    nb = -(-m // k)
    region_windows = [list(range(i * r, min((i + 1) * r, w))) for i in range(m)]
    short = splitmix64(splitmix64(seed ^ blocks.TAG_SHORT) ^ epoch) % m
    seed_regions = splitmix64(seed ^ blocks.TAG_REGIONS)
    seed_block = splitmix64(seed ^ blocks.TAG_BLOCK)
    slots = []
    for s in range(m):
        if s == short:
            slots.append(m - 1)
        else:
            slots.append(int(permute(np.array([s - (s > short)]), m - 1, seed_regions, epoch)[0]))
    assert sorted(slots) == list(range(m))
    out, start = [], 0
    for b in range(nb):
        regions = slots[b * k : (b + 1) * k]
        members = [win for reg in regions for win in region_windows[reg]]
        perm = permute(np.arange(len(members)), len(members), seed_block, epoch * nb + b)
        out.append(RefBlock(start, regions, [members[i] for i in perm.tolist()]))
        start += len(members)
    assert start == w
    return out


def reference_windows(w: int, r: int, k: int, seed: int, positions: np.ndarray) -> np.ndarray:
    cache: dict[int, list[int]] = {}
    ids = []
    for p in positions.tolist():
        e, q = divmod(p, w)
        if e not in cache:
            cache[e] = [x for blk in reference_epoch(w, r, k, seed, e) for x in blk.order]
        ids.append(cache[e][q])
    return np.array(ids, dtype=np.int64)


def merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
