"""The loader benchmark's report: medians, ratios to the careful baselines, tables, chart.

Every ratio is against the batched baselines of the same group (``nw=0``, ``nw=2`` or
``x4``): ``ram_batch`` (the whole token array in RAM) and ``memmap_pack16`` (a memory map,
batched; 16 batches per DataLoader item with workers). ``--publish`` writes the chart,
the raw JSON and the table into the docs, and the one-line summary into the README,
between the ``<!-- bench_loaders:... -->`` markers, so that what they show is the last
full run's and nothing is copied by hand.
"""

from __future__ import annotations

import re
import shutil
import statistics
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RAM, MEMMAP = "ram_batch", "memmap_pack16"

# (key, markdown header, scale, decimals)
COLUMNS = [
    ("trainer_cpu_s_per_gtok", "trainer CPU s/Gtok", 1, 1),
    ("server_cpu_s_per_gtok", "server CPU s/Gtok", 1, 1),
    ("total_cpu_s_per_gtok", "total CPU s/Gtok", 1, 1),
    ("trainer_anon_mb", "anon MB per trainer", 1, 0),
    ("server_anon_mb", "server anon MB", 1, 0),
    ("total_anon_mb", "anon MB, all processes", 1, 0),
    ("page_cache_mb", "page cache MB (apart)", 1, 0),
    ("ttfb_ms", "TTFB ms", 1, 1),
    ("wait_p99_ms", "p99 wait ms", 1, 1),
]
MEDIAN_KEYS = [
    "tokens_per_s",
    "trainer_cpu_s_per_gtok",
    "server_cpu_s_per_gtok",
    "total_cpu_s_per_gtok",
    "page_cache_mb",
    "ttfb_ms",
    "wait_p50_ms",
    "wait_p99_ms",
]
PEAK_KEYS = ["trainer_anon_mb", "server_anon_mb", "total_anon_mb"]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the runs (memory: the worst run), and the rate's min and max."""
    out: dict[str, Any] = {"runs": runs}
    for key in MEDIAN_KEYS:
        out[key] = statistics.median(r[key] for r in runs)
    for key in PEAK_KEYS:
        out[key] = max(r[key] for r in runs)
    rates = [r["tokens_per_s"] for r in runs]
    out["tokens_per_s_min"], out["tokens_per_s_max"] = min(rates), max(rates)
    return out


def group(label: str) -> str:
    """``nw=0``, ``nw=2`` or ``x4``: the last word of a label."""
    return label.rsplit(" ", 1)[1]


def ratios(summary: dict[str, dict[str, Any]], label: str) -> dict[str, float | None]:
    """Rate and total CPU of ``label`` over each baseline's in the same group."""
    s, out = summary[label], {}
    for base in (RAM, MEMMAP):
        b = summary.get(f"{base} {group(label)}", {})
        ok = "tokens_per_s" in s and "tokens_per_s" in b
        out[f"rate_x_{base}"] = s["tokens_per_s"] / b["tokens_per_s"] if ok else None
        out[f"cpu_x_{base}"] = (
            s["total_cpu_s_per_gtok"] / b["total_cpu_s_per_gtok"]
            if ok and b["total_cpu_s_per_gtok"] > 0
            else None
        )
    return out


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def markdown(summary: dict[str, dict[str, Any]]) -> str:
    """The results as a markdown table (tokenfeed rows in bold)."""
    head = ["system", "Mtok/s median (min-max)", f"x {RAM}", f"x {MEMMAP}"]
    head += [h for _, h, _, _ in COLUMNS[:3]] + [f"CPU x {RAM}", f"CPU x {MEMMAP}"]
    head += [h for _, h, _, _ in COLUMNS[3:]]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for label, s in summary.items():
        if "skipped" in s:
            lines.append(f"| {label} | skipped: {s['skipped']} |" + " |" * (len(head) - 2))
            continue
        r = ratios(summary, label)
        rate = f"{s['tokens_per_s'] / 1e6:.1f} ({s['tokens_per_s_min'] / 1e6:.1f}-"
        rate += f"{s['tokens_per_s_max'] / 1e6:.1f})"
        name = f"**{label}**" if label.startswith("tokenfeed") else label
        cells = [name, rate, _x(r[f"rate_x_{RAM}"]), _x(r[f"rate_x_{MEMMAP}"])]
        cells += [f"{s[k] * sc:.{d}f}" for k, _, sc, d in COLUMNS[:3]]
        cells += [_x(r[f"cpu_x_{RAM}"]), _x(r[f"cpu_x_{MEMMAP}"])]
        cells += [f"{s[k] * sc:.{d}f}" for k, _, sc, d in COLUMNS[3:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def meta_line(meta: dict[str, Any]) -> str:
    """When, where and under what load the table was measured."""
    start, end = meta["load_start"], meta["load_end"]
    return (
        f"{meta['date']}, {meta['cpus_usable']} of {meta['cpus']} cores, load average "
        f"(1/5/15 min) {'/'.join(map(str, start['loadavg']))} at the start and "
        f"{'/'.join(map(str, end['loadavg']))} at the end; {meta['runs']} interleaved "
        f"rounds of {meta['batches_per_run']} batches of {meta['batch'][0]} x "
        f"{meta['batch'][1]} tokens per system, {meta['store_tokens'] / 1e6:.0f}M-token "
        f"store; `{meta['command']}`"
    )


def readme_line(summary: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    """The README's one line: tokenfeed against the careful baselines, from the results."""
    parts = []
    for label, base in (
        ("tokenfeed nw=0", RAM),
        ("tokenfeed nw=2", MEMMAP),
        ("tokenfeed x4", MEMMAP),
    ):
        if "tokens_per_s" not in summary.get(label, {}):
            continue
        r = ratios(summary, label)
        s = summary[label]
        cpu = "total CPU s/Gtok (trainer + server)" if not parts else "s/Gtok"
        parts.append(
            f"{label}: {s['tokens_per_s'] / 1e6:.0f} Mtok/s at {s['total_cpu_s_per_gtok']:.1f} "
            f"{cpu}, {_x(r[f'rate_x_{base}'])} the rate and {_x(r[f'cpu_x_{base}'])} the CPU "
            f"of {base}"
        )
    where = f"{meta['cpus_usable']}-core box, load {meta['load_start']['loadavg'][0]}"
    link = "[loader benchmark](docs/benchmarks/loaders.md)"
    return f"On the {link} ({meta['date']}, {where}): " + "; ".join(parts) + "."


def chart(summary: dict[str, dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    """Rate, total CPU (trainer + server) and anonymous memory of the fair systems (the
    per-sample baselines are left out: no careful engineer ships them)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib not installed: no chart", flush=True)
        return
    done = {k: v for k, v in summary.items() if "skipped" not in v and "per-sample" not in k}
    labels = list(done)
    fig, axes = plt.subplots(1, 3, figsize=(18, 0.45 * len(labels) + 2), sharey=True)
    y = np.arange(len(labels))
    palette = {"tokenfeed": "tab:green", RAM: "tab:blue", MEMMAP: "tab:gray"}
    colors = [palette.get(k.split(" ")[0], "tab:olive") for k in labels]
    rates = np.array([done[k]["tokens_per_s"] for k in labels]) / 1e6
    lo = rates - np.array([done[k]["tokens_per_s_min"] for k in labels]) / 1e6
    hi = np.array([done[k]["tokens_per_s_max"] for k in labels]) / 1e6 - rates
    axes[0].barh(y, rates, xerr=[lo, hi], color=colors)
    axes[0].set_xlabel("M tokens/s (median, min-max)")
    trainer = [done[k]["trainer_cpu_s_per_gtok"] for k in labels]
    axes[1].barh(y, trainer, color=colors)
    axes[1].barh(
        y, [done[k]["server_cpu_s_per_gtok"] for k in labels], left=trainer, color="tab:orange"
    )
    axes[1].set_xlabel("CPU s per G tokens: trainer (+ server, orange)")
    axes[2].barh(y, [done[k]["total_anon_mb"] for k in labels], color=colors)
    axes[2].set_xlabel("anonymous MB, all processes (page cache apart)")
    axes[0].set_yticks(y, labels)
    axes[0].invert_yaxis()
    load = meta["load_start"]["loadavg"][0], meta["load_end"]["loadavg"][0]
    fig.suptitle(
        f"batches of {meta['batch'][0]} x {meta['batch'][1]} tokens, medians of "
        f"{meta['runs']} interleaved rounds, {meta['cpus_usable']} cores, load {load[0]}-"
        f"{load[1]}; green: tokenfeed, blue: {RAM}, gray: {MEMMAP}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _replace_between(path: Path, name: str, body: str) -> None:
    text = path.read_text(encoding="utf-8")
    start, end = f"<!-- bench_loaders:{name} -->", f"<!-- /bench_loaders:{name} -->"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path}: no {start} ... {end} markers to publish into")
    path.write_text(pattern.sub(lambda _: f"{start}\n{body}\n{end}", text), encoding="utf-8")


def publish(result: dict[str, Any], out: Path, name: str, note: str) -> None:
    """Copy the chart and JSON into the docs; rewrite the docs table and the README line."""
    docs = ROOT / "docs"
    if (out / f"{name}.png").exists():
        shutil.copyfile(out / f"{name}.png", docs / "img" / "bench_loaders.png")
    shutil.copyfile(out / f"{name}.json", docs / "benchmarks" / "bench_loaders.json")
    body = f"{note + ' ' if note else ''}Measured {meta_line(result['meta'])}.\n\n"
    body += result["markdown"]
    _replace_between(docs / "benchmarks" / "loaders.md", "table", body)
    line = readme_line(result["systems"], result["meta"])
    _replace_between(ROOT / "README.md", "line", line)  # the README stays short: no note
    print("# published: docs/img/bench_loaders.png, docs/benchmarks/loaders.md, README.md")
