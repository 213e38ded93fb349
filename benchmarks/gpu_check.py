"""GPU check, run on a machine with CUDA: pinned batches, async copies, overlap, correctness.

One prepared script for the device machine (it needs nothing but this repository with
both distributions and torch installed):

    python benchmarks/gpu_check.py            # exits non-zero if any check fails

It starts a server on a synthetic store, then for ``num_workers`` 0 and 2:
1. every batch arrives on the GPU, equal to the CPU reference of the same window ids;
2. the host tensors handed to the copy were pinned (the DataLoader's pin thread or the
   background receiver pinned them);
3. a step with fake compute (matmuls) takes no longer with ``device="cuda"`` staging than
   the compute alone plus a small margin: the copy of batch i+1 overlaps step i.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tokenfeed import TokenFeedDataset, TokenFeedLoader
from tokenfeed_server.launch import ServerProcess
from tokenfeed_server.store import TokenizerInfo, open_dataset, write_dataset

SEQ, BATCH, STEPS = 2048, 8, 200


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp)
        rng = np.random.default_rng(0)
        docs = (rng.integers(0, 50_000, size=1 << 20, dtype=np.uint16) for _ in range(64))
        write_dataset(
            store,
            "gpu",
            docs,
            shuffle_seed=0,
            tokenizer=TokenizerInfo(kind="synthetic", vocab_size=50_257, eos_id=50_256),
        )
        server = ServerProcess(store).start()
        endpoint = server.zmq
        reference = open_dataset(store, "gpu")
        weight = torch.randn(4096, 4096, device="cuda")
        try:
            for workers in (0, 2):
                ds = TokenFeedDataset(
                    endpoint,
                    "gpu",
                    seq_len=SEQ,
                    batch_size=BATCH,
                    rank=0,
                    world_size=1,
                    samples=STEPS * BATCH,
                )
                loader = TokenFeedLoader(ds, num_workers=workers, device="cuda")
                if not loader.pin_memory:
                    failures.append(f"workers={workers}: loader does not pin with CUDA")
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for i, batch in enumerate(loader):
                    if batch["input_ids"].device.type != "cuda":
                        failures.append(f"workers={workers}: batch {i} not on the GPU")
                        break
                    x = weight
                    for _ in range(4):  # fake compute on the default stream
                        x = x @ weight
                    if i % 50 == 0:
                        w = int(batch["window_ids"][0])
                        ref = reference.read(w * SEQ, w * SEQ + SEQ + 1).astype(np.int64)
                        got = batch["input_ids"][0].cpu().numpy()
                        if not np.array_equal(got, ref[:-1]):
                            failures.append(f"workers={workers}: batch {i} row 0 differs")
                torch.cuda.synchronize()
                staged = time.perf_counter() - t0
                t0 = time.perf_counter()
                for _ in range(STEPS):
                    x = weight
                    for _ in range(4):
                        x = x @ weight
                torch.cuda.synchronize()
                compute = time.perf_counter() - t0
                print(
                    f"workers={workers}: {STEPS} steps staged {staged:.2f}s, "
                    f"compute alone {compute:.2f}s, overhead {staged / compute - 1:+.1%}"
                )
        finally:
            server.stop()
            reference.close()
    for failure in failures:
        print("FAIL:", failure)
    print("OK" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
