"""The loaders under comparison, and the trainer-side loop that times one of them.

Runs inside a fresh trainer process (``bench_loaders.py --child SPEC``), so that each
system's CPU time, memory and start-up are its own. Every system yields the same thing:
``input_ids`` and ``labels`` as contiguous int64 ``[batch, seq_len]`` tensors, drawn from
the same single-shard store, so the consumer loop does identical work for all of them.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

HEADER = 64  # tokenfeed shard header size (see tokenfeed_server.store.format)


def shard_region(store: str, dataset: str) -> tuple[Path, int]:
    """The single shard file of ``dataset`` and its token count (the baselines map it)."""
    manifest = json.loads((Path(store) / dataset / "manifest.json").read_text())
    shards = manifest["shards"]
    if len(shards) != 1:
        raise SystemExit(f"benchmark store must have one shard, {dataset} has {len(shards)}")
    return Path(store) / dataset / shards[0]["name"], int(shards[0]["tokens"])


def litdata_chunk(i: int, path: str, n: int) -> Iterator[Any]:
    """litdata ``optimize`` input ``i``: the i-th 16M-token slice of the shard (picklable)."""
    import torch

    tokens = np.memmap(path, dtype=np.uint16, mode="r", offset=64, shape=(n,))
    lo = i * (1 << 24)
    yield torch.from_numpy(np.array(tokens[lo : min(n, lo + (1 << 24))]).astype(np.int32))


def _windows_dataset(tokens_fn: Any, n_tokens: int, seq_len: int) -> Any:
    from torch.utils.data import Dataset

    class Windows(Dataset[dict[str, Any]]):
        """nanoGPT's get_batch as a map-style Dataset: window ``i`` is ``i*L .. i*L+L+1``."""

        def __init__(self) -> None:
            self.data: np.ndarray | None = None

        def __len__(self) -> int:
            return (n_tokens - 1) // seq_len

        def __getitem__(self, i: int) -> dict[str, Any]:
            import torch

            if self.data is None:  # mapped lazily, once per worker process
                self.data = tokens_fn()
            start = i * seq_len
            x = torch.from_numpy(self.data[start : start + seq_len].astype(np.int64))
            y = torch.from_numpy(self.data[start + 1 : start + seq_len + 1].astype(np.int64))
            return {"input_ids": x, "labels": y}

    return Windows()


def _map_style(spec: dict[str, Any], in_ram: bool) -> Iterable[Any]:
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    path, n_tokens = shard_region(spec["store"], spec["dataset"])
    if in_ram:
        # The classic tutorial: read every token into the trainer's memory up front.
        tokens = np.fromfile(path, dtype=np.uint16, count=n_tokens, offset=HEADER)

        def tokens_fn() -> np.ndarray:
            return tokens
    else:

        def tokens_fn() -> np.ndarray:
            return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER, shape=(n_tokens,))

    ds = _windows_dataset(tokens_fn, n_tokens, spec["seq_len"])
    if in_ram:
        ds.data = tokens
    gen = torch.Generator().manual_seed(spec["seed"])
    sampler = RandomSampler(ds, num_samples=spec["batches"] * spec["batch_size"], generator=gen)
    nw = spec["num_workers"]
    return DataLoader(
        ds,
        batch_size=spec["batch_size"],
        sampler=sampler,
        num_workers=nw,
        prefetch_factor=spec["prefetch"] if nw else None,
        pin_memory=False,
    )


def _tokenfeed(spec: dict[str, Any]) -> Iterable[Any]:
    from tokenfeed import TokenFeedDataset, TokenFeedLoader

    ds = TokenFeedDataset(
        spec["endpoint"],
        spec["dataset"],
        seq_len=spec["seq_len"],
        batch_size=spec["batch_size"],
        seed=spec["seed"],
        rank=0,
        world_size=1,
        samples=spec["batches"] * spec["batch_size"],
        batches_per_item=spec.get("batches_per_item", 1),
    )
    return TokenFeedLoader(ds, num_workers=spec["num_workers"], pin_memory=False, prefetch=4)


def _litdata(spec: dict[str, Any]) -> Iterable[Any]:
    from litdata import StreamingDataLoader, StreamingDataset  # type: ignore[import-not-found]
    from litdata.streaming.item_loader import TokensLoader  # type: ignore[import-not-found]

    ds = StreamingDataset(
        spec["peer_dir"],
        item_loader=TokensLoader(block_size=spec["seq_len"] + 1),
        shuffle=True,
        seed=spec["seed"],
    )
    loader = StreamingDataLoader(ds, batch_size=spec["batch_size"], num_workers=spec["num_workers"])
    return _xy(loader, spec["batches"])


def _streaming(spec: dict[str, Any]) -> Iterable[Any]:
    from streaming import StreamingDataset  # type: ignore[import-not-found]
    from torch.utils.data import DataLoader

    ds = StreamingDataset(
        local=spec["peer_dir"],
        shuffle=True,
        shuffle_seed=spec["seed"],
        batch_size=spec["batch_size"],
    )
    loader = DataLoader(ds, batch_size=spec["batch_size"], num_workers=spec["num_workers"])
    return _xy(({"t": b["tokens"]} for b in loader), spec["batches"])


def _xy(batches: Iterable[Any], limit: int) -> Iterator[dict[str, Any]]:
    # Peers hand out [B, L+1] windows; split them as their docs do, and stop at ``limit``.
    for n, batch in enumerate(batches):
        if n == limit:
            return
        t = batch["t"] if isinstance(batch, dict) else batch
        t = t.long()
        yield {"input_ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}


BUILDERS = {
    "tokenfeed": _tokenfeed,
    "memmap": lambda spec: _map_style(spec, in_ram=False),
    "ram": lambda spec: _map_style(spec, in_ram=True),
    "litdata": _litdata,
    "streaming": _streaming,
}


def _cpu_seconds() -> float:
    # Self plus reaped children: DataLoader workers are joined when the iterator is
    # dropped, so their whole CPU time (start-up included) lands in RUSAGE_CHILDREN.
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the system, wait for the parent's go, draw ``batches`` batches, and time them."""
    import torch

    torch.set_num_threads(1)  # the trainer's compute threads would otherwise spin here
    loader = BUILDERS[spec["system"]](spec)
    print(json.dumps({"event": "loaded"}), flush=True)
    if spec.get("barrier"):
        sys.stdin.readline()  # all concurrent trainers start together
    cpu0 = _cpu_seconds()
    wall0 = time.time()
    t0 = time.perf_counter()
    it = iter(loader)
    waits: list[float] = []
    tokens = 0
    prev = t0
    for batch in it:
        now = time.perf_counter()
        waits.append(now - prev)
        ids = batch["input_ids"]
        tokens += ids.numel()
        if len(waits) == spec["batches"]:
            break
        prev = time.perf_counter()
    t_end = time.perf_counter()
    # Dropping the iterator joins DataLoader workers, so their CPU time is counted. (No
    # gc.collect(): with torch loaded a full collection costs ~0.1 s, which would be
    # charged to every system as if it were loading cost.)
    del it, batch, ids
    cpu = _cpu_seconds() - cpu0
    ttfb = waits[0]
    steady = t_end - t0 - ttfb
    return {
        "batches": len(waits),
        "tokens": tokens,
        "ttfb_s": ttfb,
        "elapsed_s": t_end - t0,
        "tokens_per_s": (tokens - tokens // len(waits)) / steady if steady > 0 else 0.0,
        "wait_p50_s": float(np.percentile(waits[1:] or waits, 50)),
        "wait_p99_s": float(np.percentile(waits[1:] or waits, 99)),
        "trainer_cpu_s": cpu,
        "wall_start": wall0,
        "wall_end": wall0 + (t_end - t0),
    }
