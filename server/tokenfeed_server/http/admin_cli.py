"""``tokenfeed-server jobs|datasets|status``: the JSON API as aligned tables.

Each command reads one server's HTTP API (``--url``, default ``$TOKENFEED_URL`` or the
local default port) with an optional bearer token (``--token``, default
``$TOKENFEED_TOKEN``) and prints what that token may see: the same answer as the API,
as a table, or as the API's JSON with ``--json`` for scripts. A server that cannot be
reached, a refused token or an error answer is one line on stderr and exit status 2.
Only the standard library speaks HTTP here; rich draws the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from tokenfeed.errors import TokenFeedError
from tokenfeed_server.config import DEFAULT_HTTP_PORT

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.table import Table
    from rich.text import Text

__all__ = ["add_admin_commands", "fetch_json"]

DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_HTTP_PORT}"
TIMEOUT_S = 10.0


def fetch_json(url: str, path: str, token: str | None) -> Any:
    """GET ``url + path`` and decode its JSON; any failure is one TokenFeedError line."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise TokenFeedError(f"--url {url!r} is not an http(s) URL, e.g. {DEFAULT_URL}")
    request = urllib.request.Request(url.rstrip("/") + path, headers={"Accept": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
            body = answer.read()
    except urllib.error.HTTPError as exc:
        raise TokenFeedError(_http_error(exc, path, token)) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TokenFeedError(
            f"cannot reach the server at {url}: {reason}; is it running? (--url or TOKENFEED_URL)"
        ) from None
    try:
        return json.loads(body)
    except ValueError:
        raise TokenFeedError(
            f"{url}{path} did not answer JSON: is it a tokenfeed server?"
        ) from None


def _http_error(exc: urllib.error.HTTPError, path: str, token: str | None) -> str:
    try:
        detail = str(json.loads(exc.read())["detail"])
    except (ValueError, KeyError, TypeError, OSError):
        detail = exc.reason
    if exc.code == 401:
        if token:
            return "the server refused the token (--token or TOKENFEED_TOKEN): " + detail
        return "the server wants a token: pass --token T (or set TOKENFEED_TOKEN)"
    return f"GET {path}: HTTP {exc.code}: {detail}"


# ---------------------------------------------------------------------------- rendering


def _console() -> Console:
    from rich.console import Console  # rich is imported by these commands only

    # A pipe gets no colour and a wide line: a table must not wrap inside a script's log.
    tty = sys.stdout.isatty()
    return Console(highlight=False, soft_wrap=False, width=None if tty else 240, no_color=not tty)


def _table(*columns: str, right: Sequence[str] = ()) -> Table:
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name in columns:
        table.add_column(name, justify="right" if name in right else "left", no_wrap=True)
    return table


def _cells(*values: object) -> list[Text]:
    from rich.text import Text

    # Text, not str: a name such as "[bold]x" from the API stays literal, never markup.
    return [Text(str(v)) for v in values]


def _count(n: int) -> str:
    return f"{n:,}"


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.0f}s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _or_admin_only(value: object) -> object:
    """A figure the server shows only to callers who see everything."""
    return "(admin only)" if value is None else value


def _uptime(seconds: float) -> str:
    s = int(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    return f"{days}d {hours}h {minutes}m" if days else f"{hours}h {minutes}m {s}s"


#: Printed under the jobs table: what the two positions mean and why they differ.
SERVED_VS_CONSUMED = (
    "SERVED: positions the server sent, prefetched by the trainer's loader; CONSUMED: "
    "positions that reached the training loop. SERVED runs ahead by the request window "
    "and the DataLoader's prefetch."
)


def render_jobs(jobs: list[dict[str, Any]]) -> Table:
    """One row per job: who, what (KIND: one dataset, or a mixture with each source's
    weight at the served position), the run and plan, and how far its training loop is
    (CONSUMED, EPOCH, EPOCH %, TOKENS/S are the trainer's; SERVED is what the server sent,
    the loader's prefetch). SKIPPED: the global steps the run skipped on purpose at a
    resume (after a loss spike). A job that ended says so in LAST REQUEST; a forgotten
    one's counters are final."""
    table = _table(
        "TENANT", "DATASET", "KIND", "RUN", "SKIPPED", "SEQ", "BATCH", "WORLD", "SEED", "WORKERS",
        "CONSUMED", "SERVED", "EPOCH", "EPOCH %", "TOKENS/S", "RETRANSMITS", "LAST REQUEST",
        "JOB",
        right=("SEQ", "BATCH", "WORLD", "SEED", "WORKERS", "CONSUMED", "SERVED", "EPOCH",
               "EPOCH %", "TOKENS/S", "RETRANSMITS"),
    )  # fmt: skip
    order = lambda j: (bool(j.get("forgotten")), j["tenant"], j["dataset"], j["id"])  # noqa: E731
    for job in sorted(jobs, key=order):
        at, epoch, windows = job["consumed_position"], job["consumed_epoch"], job["epoch_windows"]
        done = "-" if at is None else f"{100 * (at - epoch * windows) / windows:.1f}"
        table.add_row(
            *_cells(
                job["tenant"], job["dataset"], _kind(job), job.get("run") or "-",
                skipped_steps(job), job["seq_len"], job["batch_size"], job["world_size"],
                job["seed"],
                job["workers"], "-" if at is None else _count(at), _count(job["position"]),
                "-" if epoch is None else epoch, done, f"{job['consumed_tokens_per_s']:,.0f}",
                _count(job["retransmits"]), _last(job), job["id"],
            )
        )  # fmt: skip
    return table


def _kind(job: dict[str, Any]) -> str:
    """``dataset``, or ``mixture`` with each source's share at the served position."""
    if job.get("kind") != "mixture":
        return "dataset"  # a server from before kinds sends single-dataset jobs only
    weights = job.get("current_weights") or {}
    total = sum(weights.values()) or 1
    shares = ", ".join(f"{n} {100 * weights.get(n, 0) / total:.0f}%" for n in job["sources"])
    return f"mixture({shares})"


def skipped_steps(job: dict[str, Any]) -> str:
    """The global steps a run skipped on purpose (``2-3, 9``), or ``-``; a server from
    before skipped ranges sends none."""
    step = job["batch_size"] * job["world_size"]
    out = []
    for at, n in job.get("skipped") or ():
        first, last = at // step, (at + n - 1) // step
        out.append(str(first) if first == last else f"{first}-{last}")
    return ", ".join(out) or "-"


def _last(job: dict[str, Any], now: float | None = None) -> str:
    """When the job's last request came, or when it ended (``final`` once forgotten)."""
    ended = job.get("ended")
    if ended is None:
        return _ago(job["idle_s"])
    ago = _ago(max(0.0, (time.time() if now is None else now) - ended))
    return f"ended {ago}" + (" (final)" if job.get("forgotten") else "")


def jobs_footer(jobs: list[dict[str, Any]]) -> str:
    """The line under the jobs table: what SERVED and CONSUMED mean, and how old the
    server's snapshot was (it is rebuilt every 0.5 s)."""
    ages = [j["snapshot_age_s"] for j in jobs if j.get("snapshot_age_s") is not None]
    age = f"Snapshot taken {ages[0]:.1f} s before this answer. " if ages else ""
    return age + SERVED_VS_CONSUMED


def render_datasets(datasets: list[dict[str, Any]]) -> Table:
    """One row per dataset: storage status, size, tokenizer, shards (``-`` for one that
    does not open); what is wrong is listed under the table (:func:`render_problems`)."""
    table = _table(
        "NAME", "STATUS", "TOKENS", "DOCUMENTS", "TOKENIZER", "VOCAB", "EOS", "TOKENIZER HASH",
        "SHARDS", "CREATED",
        right=("TOKENS", "DOCUMENTS", "VOCAB", "EOS", "SHARDS"),
    )  # fmt: skip
    for ds in sorted(datasets, key=lambda d: d["name"]):
        status = _health(ds)
        if "tokenizer" not in ds:  # not opened: no manifest summary
            table.add_row(*_cells(ds["name"], status, "-", "-", "-", "", "", "", "", ""))
            continue
        t = ds["tokenizer"]
        table.add_row(
            *_cells(
                ds["name"], status, _count(ds["tokens"]), _count(ds["documents"]), t["kind"],
                _count(t["vocab_size"]), t["eos_id"], short_hash(t.get("hash")), ds["shards"],
                ds["created"],
            )
        )  # fmt: skip
    return table


def short_hash(digest: str | None) -> str:
    """The short form of a content hash (12 hex digits after its ``algo:`` prefix), as
    the console shows it; ``-`` from a server from before tokenizer hashes."""
    return digest.rsplit(":", 1)[-1][:12] if digest else "-"


def _health(ds: dict[str, Any]) -> str:
    # A server from before storage health sends ok only.
    return str(ds.get("status") or ("ok" if ds["ok"] else "unavailable"))


def render_problems(datasets: list[dict[str, Any]], now: float | None = None) -> Text | None:
    """What is wrong with each dataset that is not ok: status, since when, the error, and
    the missing or damaged objects by name; None when every dataset is ok."""
    from rich.text import Text

    now = time.time() if now is None else now
    lines: list[str] = []
    for ds in sorted(datasets, key=lambda d: d["name"]):
        status = _health(ds)
        if status == "ok":
            continue
        since = ds.get("since")
        when = "" if since is None else f" since {_utc(since)} ({_ago(now - since)})"
        lines.append(f"{ds['name']}: {status}{when}: {ds.get('error') or 'no error reported'}")
        lines += [f"  {obj['kind']:<8} {obj['url']}" for obj in ds.get("objects") or ()]
        if ds.get("fix"):
            lines.append(f"  to fix: {ds['fix']}")
    return Text("\n".join(lines)) if lines else None


def _utc(seconds: float) -> str:
    return f"{datetime.fromtimestamp(seconds, tz=timezone.utc):%Y-%m-%d %H:%M:%S} UTC"


def render_status(status: dict[str, Any], limits: dict[str, Any]) -> Table:
    """The server: version, uptime, readiness, connections, settings and limits."""
    config = status["config"]
    cap = config["max_tokens_per_s"]
    started = datetime.fromtimestamp(status["started"], tz=timezone.utc)
    rows: list[tuple[str, object]] = [
        ("version", status["version"]),
        ("server", status["server"]),
        ("ready", "yes" if status["ready"] else "no"),
        ("uptime", f"{_uptime(status['uptime_s'])} (since {started:%Y-%m-%d %H:%M:%S} UTC)"),
        ("connections", _or_admin_only(status["connections"])),
        ("auth", config["auth"] + (" + CURVE" if config["curve"] else "")),
        ("store", _or_admin_only(config["store"])),
        ("rate cap", f"{cap:,} tokens/s" if cap else "none"),
    ]  # fmt: skip
    rows += [(f"limit {name}", _count(value)) for name, value in limits.items()]
    rows += [
        (f"events {name}", _count(value))
        for name, value in sorted((status["counters"] or {}).items())
    ]
    table = _table("", "")
    table.show_header = False
    for name, value in rows:
        table.add_row(*_cells(name, value))
    return table


# ---------------------------------------------------------------------------- commands


def _run(
    fetch: Callable[[Callable[[str], Any]], tuple[Any, RenderableType]],
) -> Callable[..., int]:
    def handler(args: argparse.Namespace) -> int:
        url = args.url or os.environ.get("TOKENFEED_URL") or DEFAULT_URL
        token = args.token or os.environ.get("TOKENFEED_TOKEN") or None
        data, table = fetch(lambda path: fetch_json(url, path, token))
        if args.json:
            json.dump(data, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            _console().print(table)
        return 0

    return handler


def _jobs(get: Callable[[str], Any]) -> tuple[Any, RenderableType]:
    from rich.console import Group
    from rich.text import Text

    # The forgotten jobs too, as on the page: a run that just ended keeps its counters.
    jobs = get("/v1/jobs?forgotten=true")
    return jobs, Group(render_jobs(jobs), Text(""), Text(jobs_footer(jobs)))


def _datasets(get: Callable[[str], Any]) -> tuple[Any, RenderableType]:
    from rich.console import Group
    from rich.text import Text

    datasets = get("/v1/datasets")
    problems = render_problems(datasets)
    table = render_datasets(datasets)
    return datasets, table if problems is None else Group(table, Text(""), problems)


def _status(get: Callable[[str], Any]) -> tuple[Any, RenderableType]:
    status, limits = get("/v1/status"), get("/v1/limits")
    return status, render_status(status, limits)


_COMMANDS = {
    "jobs": (
        _jobs,
        "list the jobs the token may see, and the last ones forgotten with their final "
        "counters (GET /v1/jobs?forgotten=true)",
    ),
    "datasets": (_datasets, "list the datasets the token may read (GET /v1/datasets)"),
    "status": (_status, "show the server: version, uptime, connections, limits (GET /v1/status)"),
}


def add_admin_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``jobs``, ``datasets`` and ``status`` on the ``tokenfeed-server`` parser."""
    for name, (fetch, help_text) in _COMMANDS.items():
        p = subparsers.add_parser(
            name, help=help_text, description=help_text[0].upper() + help_text[1:] + "."
        )
        p.add_argument(
            "--url",
            help=f"the server's HTTP address [TOKENFEED_URL] (default: {DEFAULT_URL})",
        )
        p.add_argument("--token", help="bearer token: a tenant's or the admin's [TOKENFEED_TOKEN]")
        p.add_argument(
            "--json", action="store_true", help="print the API's JSON instead of a table"
        )
        p.set_defaults(handler=_run(fetch))
