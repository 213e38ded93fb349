"""``tokenfeed-server jobs|datasets|status`` against a real server with a tenants file.

The tables show what the API shows the token; ``--json`` prints the API's own answer;
an unreachable server, a bad URL and a refused token are one line and exit status 2.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from live_server import LiveServer, tenants_toml
from shard_data import BYTE
from tokenfeed import TokenFeedDataset
from tokenfeed_server.cli import main
from tokenfeed_server.store import write_dataset
from waiting import wait_until

pytestmark = pytest.mark.network

ALICE = "alice-cli-token-0123456789abcdef"
MARKUP = "mallory-cli-token-0123456789abcd"
ADMIN = "admin-cli-token-zyxwvutsrqponmlk"
# A tenant name that rich would read as markup if it were not printed as plain text.
MARKUP_TENANT = "[bold red]mallory[/bold red]"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("store")
    docs = [np.arange(n, dtype=np.uint16) % 256 for n in range(100, 2100, 100)]
    for name in ("alpha", "beta", "gamma"):
        write_dataset(root, name, docs, tokenizer=BYTE, shuffle_seed=0)
    shard = next((root / "gamma").glob("shard-*.bin"))
    shard.write_bytes(shard.read_bytes()[:32])  # refused at start-up: listed unavailable
    tenants = tmp_path_factory.mktemp("conf") / "tenants.toml"
    tenants.write_text(
        tenants_toml(ADMIN, {"alice": (ALICE, ["alpha"]), MARKUP_TENANT: (MARKUP, ["beta"])})
    )
    with LiveServer(root, extra=["--tenants", str(tenants)]) as srv:
        for name, token in (("alpha", ALICE), ("beta", MARKUP)):
            loader = TokenFeedDataset(
                srv.zmq, name, seq_len=64, batch_size=2, rank=0, world_size=1, samples=4,
                token=token, request_timeout=2.0, deadline=15.0,
            )  # fmt: skip
            assert sum(1 for _ in loader) == 2
        wait_for_jobs(srv, 2)
        yield srv


def wait_for_jobs(srv: LiveServer, n: int, timeout: float = 15.0) -> None:
    """Until the data plane's snapshot (refreshed twice a second) shows ``n`` served jobs."""
    auth = {"Authorization": f"Bearer {ADMIN}"}

    def shown() -> bool:
        jobs = srv.get("/v1/jobs", headers=auth).json()
        return len(jobs) == n and all(j["consumed_position"] for j in jobs)

    wait_until(shown, timeout, f"{n} served jobs in /v1/jobs", interval=0.1)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def rows(table: str) -> list[list[str]]:
    """The table's lines split into cells (cells are separated by two or more spaces)."""
    import re

    return [re.split(r"\s{2,}", line.strip()) for line in table.splitlines() if line.strip()]


def test_jobs_table_shows_what_the_token_may_see(
    server: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "jobs", "--url", server.http, "--token", ADMIN)
    assert code == 0 and err == ""
    table, footer = out.split("\n\n", 1)
    header, *body = [r for r in rows(table) if not set("".join(r)) <= {"-", "─", " "}]
    assert header[:4] == ["TENANT", "DATASET", "KIND", "RUN"] and "CONSUMED" in header
    # the two positions, named and explained under the table, with the snapshot's age
    assert "SERVED: positions the server sent, prefetched by the trainer's loader" in footer
    assert "CONSUMED: positions that reached the training loop" in footer
    assert re.search(r"Snapshot taken \d+\.\d s before this answer", footer)
    by_tenant = {r[0]: dict(zip(header, r, strict=True)) for r in body}
    assert set(by_tenant) == {"alice", MARKUP_TENANT}  # the markup printed as text
    assert by_tenant["alice"]["DATASET"] == "alpha" and by_tenant["alice"]["SEQ"] == "64"
    assert by_tenant[MARKUP_TENANT]["DATASET"] == "beta"
    api = server.get("/v1/jobs", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    for job in api:
        assert by_tenant[job["tenant"]]["CONSUMED"] == f"{job['consumed_position']:,}"
        assert by_tenant[job["tenant"]]["SERVED"] == f"{job['position']:,}"
        assert by_tenant[job["tenant"]]["JOB"] == job["id"]
        assert by_tenant[job["tenant"]]["KIND"] == "dataset"
        assert by_tenant[job["tenant"]]["RUN"] == job["run"]
        assert by_tenant[job["tenant"]]["LAST REQUEST"].startswith("ended ")  # it said bye

    code, out, _ = run(capsys, "jobs", "--url", server.http, "--token", ALICE)
    assert code == 0
    assert "alice" in out and "mallory" not in out and "beta" not in out


def test_json_is_the_api_answer(
    server: LiveServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENFEED_URL", server.http)  # the flags' environment twins
    monkeypatch.setenv("TOKENFEED_TOKEN", ALICE)
    auth = {"Authorization": f"Bearer {ALICE}"}
    code, out, _ = run(capsys, "datasets", "--json")
    assert code == 0 and json.loads(out) == server.get("/v1/datasets", headers=auth).json()
    code, out, _ = run(capsys, "jobs", "--json")
    jobs = json.loads(out)
    assert [j["id"] for j in jobs] == [j["id"] for j in server.get("/v1/jobs", headers=auth).json()]
    assert [j["tenant"] for j in jobs] == ["alice"]
    code, out, _ = run(capsys, "status", "--json")
    status = json.loads(out)
    assert status["version"] and status["ready"] is True and status["config"]["store"] is None


def test_datasets_and_status_tables(server: LiveServer, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "datasets", "--url", server.http, "--token", ADMIN)
    assert code == 0
    table = {r[0]: r for r in rows(out)}
    tokens = sum(range(100, 2100, 100)) + 20  # every document ends with EOS
    # status, tokens, documents, tokenizer
    assert table["alpha"][1:5] == ["ok", f"{tokens:,}", "20", "byte"]
    assert table["beta"][1] == "ok"
    # equal tokenizers (both byte) show one short hash
    assert (
        re.fullmatch(r"[0-9a-f]{12}", table["alpha"][7]) and table["beta"][7] == table["alpha"][7]
    )
    assert table["gamma"][1:3] == ["unavailable", "-"]
    # Under the table: what is wrong with each dataset that is not ok, since when.
    [problem] = [line for line in out.splitlines() if line.startswith("gamma: ")]
    assert problem.startswith("gamma: unavailable since ") and "UTC" in problem
    assert "truncated" in problem and "shard-" in problem
    code, out, _ = run(capsys, "status", "--url", server.http, "--token", ADMIN)
    assert code == 0
    facts = {r[0]: r[1] for r in rows(out) if len(r) == 2}
    assert facts["ready"] == "yes" and facts["auth"] == "tenants"
    assert facts["limit max_connections"] and "uptime" in facts


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--url", "http://127.0.0.1:9"], "cannot reach the server at http://127.0.0.1:9"),
        (["--url", "not a url"], "is not an http(s) URL"),
        (["--token", "not-a-known-token"], "the server refused the token"),
        ([], "the server wants a token"),
    ],
)
def test_errors_are_one_line_and_exit_2(
    server: LiveServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    message: str,
) -> None:
    monkeypatch.delenv("TOKENFEED_TOKEN", raising=False)
    monkeypatch.setenv("TOKENFEED_URL", server.http)
    code, out, err = run(capsys, "jobs", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("tokenfeed-server jobs: error: ")
    assert message in err


def test_installed_command_exits_2(server: LiveServer) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tokenfeed_server.cli", "status", "--url", server.http,
         "--token", "wrong-token"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "tokenfeed-server status: error: the server refused the token "
        "(--token or TOKENFEED_TOKEN): unknown token"
    ]


def test_problems_name_the_objects_and_an_old_server_still_renders() -> None:
    from tokenfeed_server.http.admin_cli import render_datasets, render_problems

    datasets = [
        {"name": "web", "ok": False, "status": "unavailable", "since": 1000.0,
         "error": "object missing", "objects": [
             {"url": "s3://b/p/web/shard-1.bin", "kind": "missing"},
             {"url": "s3://b/p/web/shard-2.bin", "kind": "damaged"}],
         "fix": "repair it with tokenfeed-server inspect web --store s3://b/p ..."},
        {"name": "code", "ok": True, "status": "degraded", "since": 1090.0,
         "error": "connection refused", "objects": [], "tokens": 5, "documents": 1,
         "tokenizer": {"kind": "byte", "vocab_size": 257, "eos_id": 256}, "shards": 1,
         "created": "2026-01-01T00:00:00+00:00"},
        {"name": "old", "ok": False, "error": "an older server: no status"},
    ]  # fmt: skip
    text = render_problems(datasets, now=1100.0)
    assert text is not None
    assert text.plain.splitlines() == [
        "code: degraded since 1970-01-01 00:18:10 UTC (10s ago): connection refused",
        "old: unavailable: an older server: no status",
        "web: unavailable since 1970-01-01 00:16:40 UTC (2m ago): object missing",
        "  missing  s3://b/p/web/shard-1.bin",
        "  damaged  s3://b/p/web/shard-2.bin",
        "  to fix: repair it with tokenfeed-server inspect web --store s3://b/p ...",
    ]
    assert render_problems([datasets[1] | {"status": "ok"}]) is None
    assert render_datasets(datasets).row_count == 3


def test_a_mixture_job_shows_its_sources_current_shares_and_an_old_server_renders() -> None:
    from tokenfeed_server.http.admin_cli import render_jobs

    base = {
        "tenant": "t", "seq_len": 8, "batch_size": 2, "world_size": 1, "seed": 0,
        "workers": 1, "consumed_position": None, "consumed_epoch": None,
        "epoch_windows": 10, "position": 4, "consumed_tokens_per_s": 0.0,
        "retransmits": 0, "idle_s": 1.0,
    }  # fmt: skip
    mixture = base | {
        "id": "m", "dataset": "web+code", "kind": "mixture", "run": "r1",
        "sources": ["web", "code"], "current_weights": {"web": 3, "code": 1},
        "ended": 1000.0, "forgotten": True,
    }  # fmt: skip
    old = base | {"id": "o", "dataset": "web"}  # a server from before kinds and runs
    table = render_jobs([mixture, old])
    kinds = list(table.columns[2].cells)
    runs = list(table.columns[3].cells)
    last = list(next(c for c in table.columns if c.header == "LAST REQUEST").cells)
    assert [str(k) for k in kinds] == ["dataset", "mixture(web 75%, code 25%)"]
    assert [str(r) for r in runs] == ["-", "r1"]
    assert str(last[1]).startswith("ended ") and str(last[1]).endswith("(final)")
