"""The loaders under comparison, and the trainer-side loop that times one of them.

Runs inside a fresh trainer process (``bench_loaders.py --child SPEC``), so that each
system's CPU time, memory and start-up are its own. Every system yields the same thing:
``input_ids`` and ``labels`` as contiguous int64 ``[batch, seq_len]`` tensors, drawn from
the same single-shard store, so the consumer loop does identical work for all of them.

The baselines a careful engineer writes (``ram_batch``, ``memmap_pack``) draw one global
shuffle of the store's ``seq_len + 1``-token windows, as tokenfeed does, and gather a whole
batch with one fancy index: no Python per sample. The per-sample ones (``ram``,
``memmap``: a map-style ``Dataset`` and the default collate, as in many tutorials) stay
for comparison and are labelled so.
"""

from __future__ import annotations

import json
import os
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
    """litdata ``optimize`` input ``i``: the i-th 16M-token slice of the shard (picklable).

    Yielded as uint16 numpy (litdata's ``no_header_numpy`` format), so its chunks hold two
    bytes per token like the store, not the four of an int32 tensor.
    """
    tokens = np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER, shape=(n,))
    lo = i * (1 << 24)
    yield np.array(tokens[lo : min(n, lo + (1 << 24))])


# -- batched baselines -------------------------------------------------------------------


def window_starts(n_tokens: int, seq_len: int, seed: int) -> np.ndarray:
    """Start offsets of every ``seq_len + 1``-token window (stride ``seq_len``), in one
    seeded global-shuffle order: each window once per pass, as tokenfeed serves them."""
    n_windows = (n_tokens - 1) // seq_len
    order = np.random.default_rng(seed).permutation(n_windows).astype(np.int64)
    return order * seq_len


def gather(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """The ``[len(starts), seq_len + 1]`` uint16 windows at ``starts``: one fancy index."""
    return tokens[starts[:, None] + np.arange(seq_len + 1)]


def to_xy(windows: np.ndarray) -> dict[str, Any]:
    """int64 ``input_ids``/``labels`` from ``[B, L+1]`` windows: one conversion each."""
    import torch

    return {
        "input_ids": torch.from_numpy(windows[:, :-1].astype(np.int64)),
        "labels": torch.from_numpy(windows[:, 1:].astype(np.int64)),
    }


def _starts_for(order: np.ndarray, first: int, count: int) -> np.ndarray:
    # Wraps into the next pass when a run asks for more windows than one pass holds.
    return order[np.arange(first, first + count) % len(order)]


def _batched(spec: dict[str, Any], in_ram: bool) -> Iterable[Any]:
    path, n_tokens = shard_region(spec["store"], spec["dataset"])
    L, B = spec["seq_len"], spec["batch_size"]
    order = window_starts(n_tokens, L, spec["seed"])
    if in_ram:  # the whole array in this process's memory, read once up front
        tokens = np.fromfile(path, dtype=np.uint16, count=n_tokens, offset=HEADER)
    else:
        tokens = np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER, shape=(n_tokens,))
    nw = spec["num_workers"]
    if nw == 0:
        return (
            to_xy(gather(tokens, _starts_for(order, k * B, B), L)) for k in range(spec["batches"])
        )
    if in_ram:
        raise SystemExit("ram_batch runs with num_workers=0 only")
    return _packed_loader(spec, path, n_tokens, order)


def _packed_loader(
    spec: dict[str, Any], path: Path, n_tokens: int, order: np.ndarray
) -> Iterator[dict[str, Any]]:
    """memmap with DataLoader workers: each item is ``batches_per_item`` batches of uint16
    windows gathered in a worker with one fancy index; the main process splits them and
    converts each batch to int64 (one item per batch would pay the DataLoader's per-item
    cost, ~1 ms, on every 128 KB batch)."""
    from torch.utils.data import DataLoader, Dataset

    L, B, k = spec["seq_len"], spec["batch_size"], spec.get("batches_per_item", 16)
    per_item = k * B

    class Packs(Dataset[Any]):
        def __init__(self) -> None:
            self.tokens: np.ndarray | None = None

        def __len__(self) -> int:
            return int(spec["batches"] + k - 1) // k

        def __getitem__(self, i: int) -> Any:
            import torch

            if self.tokens is None:  # mapped once per worker process
                self.tokens = np.memmap(
                    path, dtype=np.uint16, mode="r", offset=HEADER, shape=(n_tokens,)
                )
            return torch.from_numpy(
                gather(self.tokens, _starts_for(order, i * per_item, per_item), L)
            )

    loader = DataLoader(
        Packs(),
        batch_size=None,
        shuffle=False,
        num_workers=spec["num_workers"],
        prefetch_factor=spec["prefetch"],
    )
    left = spec["batches"]
    for pack in loader:
        windows = pack.numpy()
        for b in range(0, min(len(windows), left * B), B):
            yield to_xy(windows[b : b + B])
        left -= len(windows) // B


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

    if spec.get("tcp"):  # the loopback TCP path, without the shared-memory ring
        os.environ["TOKENFEED_SHARED_MEMORY"] = "0"

    ds = TokenFeedDataset(
        spec["endpoint"],
        spec["dataset"],
        seq_len=spec["seq_len"],
        batch_size=spec["batch_size"],
        seed=spec["seed"],
        rank=0,
        world_size=1,
        samples=spec["batches"] * spec["batch_size"],
        batches_per_item=spec.get("batches_per_item", 1),  # None: the loader chooses
    )
    return TokenFeedLoader(ds, num_workers=spec["num_workers"], pin_memory=False, prefetch=4)


def _litdata(spec: dict[str, Any]) -> Iterable[Any]:
    from litdata import StreamingDataLoader, StreamingDataset  # type: ignore[import-not-found]
    from litdata.streaming.item_loader import TokensLoader  # type: ignore[import-not-found]

    # As litdata's LLM pre-training example: TokensLoader(block_size=L + 1), shuffle,
    # drop_last, StreamingDataLoader (pin_memory off here, as for every system: no GPU).
    ds = StreamingDataset(
        spec["peer_dir"],
        item_loader=TokensLoader(block_size=spec["seq_len"] + 1),
        shuffle=True,
        drop_last=True,
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
    # Peers hand out [B, L+1] uint16 windows: the same conversion as the batched baselines.
    for n, batch in enumerate(batches):
        if n == limit:
            return
        t = batch["t"] if isinstance(batch, dict) else batch
        yield to_xy(t.numpy())


BUILDERS = {
    "tokenfeed": _tokenfeed,
    "ram_batch": lambda spec: _batched(spec, in_ram=True),
    "memmap_pack": lambda spec: _batched(spec, in_ram=False),
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


def descendants_cpu(pid: int | None = None) -> float:
    """CPU seconds the live descendants of ``pid`` (default: this process) used so far.

    Workers a loader keeps alive past the loop (not reaped, so not in
    ``RUSAGE_CHILDREN``) still did the loading; a server's children likewise.
    """
    import psutil

    total = 0.0
    for child in psutil.Process(pid).children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


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
    # A generator over a DataLoader (litdata, streaming, memmap_pack16 with workers) holds
    # its DataLoader iterator until closed: close it, so that its workers are joined too.
    close = getattr(loader, "close", None)
    if callable(close):
        close()
    cpu = _cpu_seconds() - cpu0 + descendants_cpu()
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
