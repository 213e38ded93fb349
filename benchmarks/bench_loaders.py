"""tokenfeed against the loaders a careful engineer would otherwise write, in one run.

    pip install -r benchmarks/requirements.txt                 # once: psutil, matplotlib
    .venv/bin/python benchmarks/bench_loaders.py               # full run (~15 min on 2 cores)
    .venv/bin/python benchmarks/bench_loaders.py --quick       # smoke test (tiny store)

Generates a seeded synthetic store of Zipf-distributed token ids (one shard, so that the
baselines can map it; cached under benchmarks/results/stores), then runs every system in
interleaved rounds (each round runs every system once, in a rotated order, so that drift
on a shared box hits them alike), each run in fresh trainer processes: draw ``--batches``
batches of 8 x 2048 tokens (int64 ``input_ids``/``labels``) and time them. A tokenfeed
server is started for each tokenfeed run only. Each round draws a new seed, so before
each run the files the system reads are read into the page cache (unmeasured): otherwise
the first run of a round on a partly cached store reads that seed's windows from disk.

Systems, per group (no workers, 2 DataLoader workers, 4 trainer processes at once):
tokenfeed; ``ram_batch`` (the whole array in RAM, one fancy-indexed gather per batch of
globally shuffled windows); ``memmap_pack16`` (the same from ``np.memmap``; with workers,
16 batches per DataLoader item, split in the main process); litdata and MosaicML streaming
as their docs recommend, when installed; and the per-sample map-style loaders, labelled so.

Per system, medians over the rounds: tokens/s (steady state, after the first batch), CPU
seconds per billion tokens of the trainers (workers included), of the server, and their
total; the peak anonymous memory per trainer (workers summed), of the server and of all
processes; the store's bytes in the page cache, apart; time to first batch and p99 wait;
ratios of rate and total CPU against ``ram_batch`` and ``memmap_pack16`` of the same group.
The load average and cores at the start and end are printed and stored. Writes
``results/bench_loaders.{json,md,png}``; ``--publish`` also updates the docs and README.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from loader_measure import Server, machine_load, page_cache_bytes, run_once, warm_page_cache
from loader_report import chart, markdown, meta_line, publish, summarize

HERE = Path(__file__).resolve().parent
SEQ_LEN, BATCH, VOCAB, EOS = 2048, 8, 50257, 50256
HEADER = 64  # tokenfeed shard header size (see tokenfeed_server.store.format)


# -- the store -------------------------------------------------------------------------


def zipf_table(a: float = 1.1, size: int = 1 << 16) -> np.ndarray:
    """Token id for each of ``size`` equal-probability quantiles of a Zipf law over the vocab.

    Indexing it with uniform uint16 draws samples the (quantised) Zipf law at memory speed,
    so a multi-GB store is written in seconds rather than the minutes ``rng.zipf`` takes.
    """
    ranks = np.arange(1, VOCAB, dtype=np.float64)  # EOS is kept out of the body
    cdf = np.cumsum(ranks**-a)
    cdf /= cdf[-1]
    quantiles = (np.arange(size) + 0.5) / size
    return np.searchsorted(cdf, quantiles).astype(np.uint16)


def zipf_documents(
    n_tokens: int, rng: np.random.Generator, table: np.ndarray, *, block: int
) -> Iterator[np.ndarray]:
    """Documents of 64-4096 Zipf-distributed tokens (ids drawn through ``table``), about
    ``n_tokens`` in all counting one EOS each, drawn ``block`` tokens at a time."""
    left = n_tokens
    while left > 0:
        ids = table[rng.integers(0, 1 << 16, size=min(left, block), dtype=np.uint16)]
        lengths = rng.integers(64, 4096, size=len(ids) // 64 + 1)
        cuts = np.cumsum(lengths)
        cuts = cuts[cuts < len(ids)]
        yield from np.split(ids, cuts)
        left -= len(ids) + len(cuts) + 1  # documents each get an EOS


def make_store(root: Path, n_tokens: int, seed: int = 0) -> Path:
    """A cached one-shard store of about ``n_tokens`` tokens named ``bench``."""
    store = root / f"zipf-{n_tokens}-s{seed}"
    if (store / "bench" / "manifest.json").exists():
        return store
    from tokenfeed_server.store import TokenizerInfo, write_dataset

    rng = np.random.default_rng(seed)
    table = zipf_table()
    t0 = time.perf_counter()

    write_dataset(
        store,
        "bench",
        zipf_documents(n_tokens, rng, table, block=1 << 24),
        tokenizer=TokenizerInfo(kind="synthetic", vocab_size=VOCAB, eos_id=EOS),
        shuffle_seed=seed,
        shard_tokens=n_tokens + (1 << 20),
    )
    print(f"# wrote store {store} in {time.perf_counter() - t0:.1f}s", flush=True)
    return store


# -- the systems -----------------------------------------------------------------------


def peers_available() -> dict[str, str | None]:
    """Optional peers: None when importable, else why they are skipped."""
    import importlib.util

    how = {
        "litdata": "pip install --no-deps -r benchmarks/requirements.txt",
        "streaming": "it pins numpy<2.2: its own venv, see benchmarks/requirements-bench.txt",
    }
    return {
        name: None if importlib.util.find_spec(name) else f"not installed ({hint})"
        for name, hint in how.items()
    }


def prepare_peer(system: str, store: Path) -> Path:
    """Convert the store's shard into the peer's own format (cached beside the store)."""
    from systems import litdata_chunk, shard_region

    # (litdata's name changed with its format: the int32, 1024-row chunks of before are
    # not what its docs recommend, and must not be picked up from an old cache)
    out = store / ("litdata-u16-format" if system == "litdata" else f"{system}-format")
    if (out / "index.json").exists():  # both formats finish by writing their index
        return out
    shutil.rmtree(out, ignore_errors=True)  # a conversion that died half-way
    path, n = shard_region(str(store), "bench")
    tokens = np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER, shape=(n,))
    rows = (n - 1) // SEQ_LEN
    if system == "streaming":
        from streaming import MDSWriter

        with MDSWriter(out=str(out), columns={"tokens": "ndarray:uint16"}) as w:
            for i in range(rows):
                w.write({"tokens": np.array(tokens[i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN + 1])})
    else:
        from litdata import optimize
        from litdata.streaming.item_loader import TokensLoader

        # As litdata's LLM pre-training example: uint16 token arrays, TokensLoader, and
        # chunks of (block_size) x 8012 tokens (its README: "roughly 64MB of tokens").
        optimize(
            fn=functools.partial(litdata_chunk, path=str(path), n=n),
            inputs=list(range((n + (1 << 24) - 1) >> 24)),
            output_dir=str(out),
            chunk_size=(SEQ_LEN + 1) * 8012,
            item_loader=TokensLoader(),
            num_workers=1,
        )
    return out


def system_list(args: argparse.Namespace) -> list[tuple[str, dict[str, Any], int]]:
    """(label, spec, concurrent trainers) for every system, in table order."""
    k = args.batches_per_item
    out: list[tuple[str, dict[str, Any], int]] = []
    for nw in (0, 2):
        group: list[tuple[str, dict[str, Any]]] = [
            # with workers: the loader's own packing (about 2 MiB of raw tokens per item,
            # 64 batches here), as a user gets it
            ("tokenfeed", {"system": "tokenfeed", "batches_per_item": None if nw else 1}),
            # the same server without the shared-memory ring: chunks over loopback TCP
            ("tokenfeed tcp", {"system": "tokenfeed", "batches_per_item": None if nw else 1}),
            ("ram_batch", {"system": "ram_batch"}),
            ("memmap_pack16", {"system": "memmap_pack", "batches_per_item": k}),
            # the same loader packing as many batches per item as tokenfeed's default
            ("memmap_pack64", {"system": "memmap_pack", "batches_per_item": 64}),
            ("litdata", {"system": "litdata"}),
            ("streaming", {"system": "streaming"}),
            ("ram per-sample", {"system": "ram"}),
            ("memmap per-sample", {"system": "memmap"}),
        ]
        for name, spec in group:
            if nw and name == "ram_batch":  # forked workers would share its array: no new case
                continue
            if not nw and name == "memmap_pack64":  # packing matters with workers only
                continue
            tcp = {"tcp": True} if name.endswith("tcp") else {}
            out.append((f"{name} nw={nw}", {**spec, **tcp, "num_workers": nw}, 1))
    for name, system in (
        ("tokenfeed", "tokenfeed"),
        ("tokenfeed tcp", "tokenfeed"),
        ("ram_batch", "ram_batch"),
        ("memmap_pack16", "memmap_pack"),
        ("litdata", "litdata"),
    ):
        tcp = {"tcp": True} if name.endswith("tcp") else {}
        out.append((f"{name} x4", {"system": system, "num_workers": 0, **tcp}, 4))
    return out


def store_files(spec: dict[str, Any]) -> list[Path]:
    """The files a system reads: warmed into the page cache before its runs, and counted
    in the page-cache column after them."""
    if "peer_dir" in spec:
        return sorted(p for p in Path(spec["peer_dir"]).rglob("*") if p.is_file())
    from systems import shard_region

    return [shard_region(spec["store"], spec["dataset"])[0]]


# -- main ------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    """The command line (``--quick``: a tiny store and few batches, for the smoke test)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny store, few batches (CI smoke)")
    ap.add_argument("--runs", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--batches", type=int, help="per run (default: one pass over the store)")
    ap.add_argument(
        "--per-sample-batches", type=int, default=2000, help="per run of the per-sample loaders"
    )
    ap.add_argument("--store-gb", type=float, default=0.5)
    ap.add_argument("--big-gb", type=float, default=4.0, help="store for the memory figure")
    ap.add_argument("--batches-per-item", type=int, default=16, help="with DataLoader workers")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--stores", type=Path, default=HERE / "results" / "stores")
    ap.add_argument("--only", help="comma-separated substrings of the systems to run")
    ap.add_argument("--publish", action="store_true", help="update the docs and README")
    ap.add_argument("--note", default="", help="a sentence put before the published table")
    ap.add_argument(
        "--publish-from", type=Path, help="publish this results JSON (and its .png), run nothing"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.runs, args.batches, args.per_sample_batches = 1, 20, 20
        args.store_gb, args.big_gb = 0.004, min(args.big_gb, 0.008)
    return args


def plan(
    args: argparse.Namespace, store: Path, base: dict[str, Any]
) -> tuple[list[tuple[str, dict[str, Any], int]], dict[str, dict[str, Any]]]:
    """The systems to run (label, spec, trainers) and those skipped, with why."""
    missing = peers_available()
    skipped: dict[str, dict[str, Any]] = {}
    systems = []
    for label, own, clients in system_list(args):
        if args.only and not any(word in label for word in args.only.split(",")):
            continue
        why = missing.get(own["system"])
        if why:
            skipped[label] = {"skipped": why}
            continue
        spec = {**base, **own, "store": str(store)}
        if "per-sample" in label:
            spec["batches"] = min(spec["batches"], args.per_sample_batches)
        if spec["system"] in ("litdata", "streaming"):
            spec["peer_dir"] = str(prepare_peer(spec["system"], store))
        systems.append((label, spec, clients))
    return systems, skipped


def run_system(
    spec: dict[str, Any], clients: int, store: Path, log: Path, seed: int, *, warm: bool = True
) -> dict[str, Any]:
    """One run; tokenfeed gets a fresh server that lives only as long as the run.

    ``warm``: first read the files the system reads into the page cache, so that every
    run starts on a cached store (the rate runs); the memory-only run skips it.
    """
    files = store_files(spec)
    start = warm_page_cache(files) if warm else page_cache_bytes(files)
    size = sum(f.stat().st_size for f in files)
    if warm and start < 0.99 * size:
        print(
            f"# warning: only {start / 2**20:.0f} of {size / 2**20:.0f} MB of the store stay "
            "in the page cache: runs read from disk, and their rates are not comparable",
            flush=True,
        )
    server = Server(store, log) if spec["system"] == "tokenfeed" else None
    try:
        endpoint = server.zmq if server else ""
        full = {**spec, "seed": seed, "endpoint": endpoint}
        result = run_once(full, clients, server, files)
    finally:
        if server:
            server.stop()
    return {**result, "page_cache_mb_start": start / 2**20}


def rounds(
    args: argparse.Namespace, systems: list[tuple[str, dict[str, Any], int]], store: Path, log: Path
) -> dict[str, list[dict[str, Any]]]:
    """``args.runs`` rounds; each runs every system once, the order rotated each round."""
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in systems}
    for r in range(args.runs):
        shift = r % max(1, len(systems))
        for label, spec, clients in systems[shift:] + systems[:shift]:
            result = run_system(spec, clients, store, log, seed=r)
            runs[label].append(result)
            print(
                f"# round {r} {label}: {result['tokens_per_s'] / 1e6:.1f} Mtok/s, total CPU "
                f"{result['total_cpu_s_per_gtok']:.2f} s/Gtok, load {result['load1_start']}, "
                f"store cached at start {result['page_cache_mb_start']:.0f} MB",
                flush=True,
            )
    return runs


def memory_vs_size(
    args: argparse.Namespace, big: Path, base: dict[str, Any], summary: dict[str, Any], log: Path
) -> dict[str, Any]:
    """Trainer memory does not grow with the store: the same trainers on a larger one."""
    memory: dict[str, Any] = {"small_store_gb": args.store_gb, "big_store_gb": args.big_gb}
    for nw in (0, 2):
        spec = {
            **base,
            "system": "tokenfeed",
            "num_workers": nw,
            "batches": min(base["batches"], 4000),
            "batches_per_item": None if nw else 1,
            "store": str(big),
        }
        res = run_system(spec, 1, big, log, seed=0, warm=False)  # its memory only
        memory[f"tokenfeed nw={nw}"] = {
            "trainer_anon_mb_small": summary.get(f"tokenfeed nw={nw}", {}).get("trainer_anon_mb"),
            "trainer_anon_mb_big": res["trainer_anon_mb"],
        }
    return memory


def main() -> None:
    """Run the benchmark, print the table, write the results (and publish them)."""
    args = parse_args()
    if args.child:
        from systems import run_child

        print(json.dumps(run_child(json.loads(args.child))), flush=True)
        return
    if args.publish_from:
        saved = json.loads(args.publish_from.read_text())
        publish(saved, args.publish_from.parent, args.publish_from.stem, args.note)
        return
    load_start = machine_load()
    print(f"# machine at start: {load_start}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "bench_loaders_quick" if args.quick else "bench_loaders"
    n_tokens = int(args.store_gb * 2**30) // 2
    small = make_store(args.stores, n_tokens)
    big = make_store(args.stores, int(args.big_gb * 2**30) // 2) if args.big_gb else None
    batches = args.batches or (n_tokens - 1) // SEQ_LEN // BATCH  # one global-shuffle pass
    base = {
        "seq_len": SEQ_LEN,
        "batch_size": BATCH,
        "batches": batches,
        "prefetch": 4,
        "dataset": "bench",
        "barrier": True,
    }
    systems, skipped = plan(args, small, base)
    log = args.out / f"{name}.server.log"
    runs = rounds(args, systems, small, log)
    order = [label for label, _, _ in system_list(args) if label in runs or label in skipped]
    summary = {label: skipped.get(label) or summarize(runs[label]) for label in order}
    memory = memory_vs_size(args, big, base, summary, log) if big else {}
    meta = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.date.today().isoformat(),
        "batch": [BATCH, SEQ_LEN],
        "batches_per_run": batches,
        "per_sample_batches_per_run": min(batches, args.per_sample_batches),
        "runs": args.runs,
        "cpus": load_start["cpus"],
        "cpus_usable": load_start["cpus_usable"],
        "load_start": load_start,
        "load_end": machine_load(),
        "store_tokens": n_tokens,
    }
    report(args, name, summary, memory, meta)


def report(
    args: argparse.Namespace,
    name: str,
    summary: dict[str, dict[str, Any]],
    memory: dict[str, Any],
    meta: dict[str, Any],
) -> None:
    """Print the table and write ``{name}.json``, ``.md`` and ``.png`` (and publish)."""
    text = markdown(summary)
    print(f"\n{text}\n\nMeasured {meta_line(meta)}.")
    for key, m in memory.items():
        if isinstance(m, dict):
            small_mb, big_mb = m["trainer_anon_mb_small"] or 0, m["trainer_anon_mb_big"]
            print(
                f"trainer anon MB, {args.store_gb:g} GB vs {args.big_gb:g} GB store, {key}: "
                f"{small_mb:.0f} vs {big_mb:.0f}"
            )
    result = {
        "meta": meta,
        "systems": summary,
        "memory_vs_store_size": memory,
        "markdown": text,
    }
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{name}.md").write_text(f"{text}\n\nMeasured {meta_line(meta)}.\n")
    chart(summary, meta, args.out / f"{name}.png")
    print(f"\nwrote {args.out / name}.json, .md and .png", flush=True)
    if args.publish:
        publish(result, args.out, name, args.note)


if __name__ == "__main__":
    main()
