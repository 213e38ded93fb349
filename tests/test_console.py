"""The status page and the offline API docs, over a real server, in a real Chromium.

The page is driven by Playwright in Debian's ``chromium`` (``scripts/install-chromium``
installs it; without it, or without playwright, the browser tests skip saying so). Two
trainers run against a tenants server while the page is open: it shows both jobs with
their datasets and a consumed position that moves; a tenant's token shows only its job; names are
text, never HTML; the page and ``/docs`` load nothing from outside the server.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from live_server import LiveServer, tenants_toml
from s3_server import S3Server, s3_server_module  # noqa: F401  (fixture)
from shard_data import BYTE
from tokenfeed import TokenFeedDataset, TokenFeedLoader
from tokenfeed.mixture import Mixture
from tokenfeed_server.http.console import CONTENT_SECURITY_POLICY
from tokenfeed_server.store import TokenizerInfo, write_dataset
from tokenfeed_server.store.objects import ObjectStore, S3Location
from tokenfeed_server.store.publish import publish_dataset

pytestmark = pytest.mark.network

ALICE = "alice-console-token-0123456789ab"
BOB = "bob-console-token-0123456789abcd"
ADMIN = "admin-console-token-0123456789ab"
BOB_NAME = "<b>bob</b>"  # must show as these ten characters, not as bold "bob"
# A manifest's tokenizer kind is free text: a script tag there must stay text too.
HOSTILE = TokenizerInfo(kind='<img src=x onerror="document.title=1">', vocab_size=257, eos_id=256)
STEP_S = 0.02
BROWSER_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A tenants server with ``books`` (alice's), ``code`` (bob's) and ``odd-kind``."""
    root = tmp_path_factory.mktemp("store")
    docs = [np.arange(n, dtype=np.uint16) % 256 for n in range(100, 4100, 100)]
    write_dataset(root, "books", docs, tokenizer=BYTE, shuffle_seed=0)
    write_dataset(root, "code", docs[:20], tokenizer=BYTE, shuffle_seed=1)
    write_dataset(root, "odd-kind", docs[:5], tokenizer=HOSTILE, shuffle_seed=0)
    tenants = tmp_path_factory.mktemp("conf") / "tenants.toml"
    tenants.write_text(
        tenants_toml(ADMIN, {"alice": (ALICE, ["books"]), BOB_NAME: (BOB, ["code"])})
    )
    # Default chunks (a whole epoch per request here): the page's progress is what the
    # trainers consumed, which moves although nothing more is requested.
    extra = ["--tenants", str(tenants)]
    with LiveServer(root, extra=extra) as srv:
        yield srv


class Trainers:
    """Two trainers (real clients, one per tenant) reading until stopped."""

    def __init__(self, srv: LiveServer) -> None:
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self._train, args=(srv, "books", ALICE, 64), daemon=True),
            threading.Thread(target=self._train, args=(srv, "code", BOB, 32), daemon=True),
        ]

    def _train(self, srv: LiveServer, name: str, token: str, seq_len: int) -> None:
        try:
            ds = TokenFeedDataset(
                srv.zmq, name, seq_len=seq_len, batch_size=2, rank=0, world_size=1,
                samples=10**6, token=token, request_timeout=5.0, deadline=30.0,
            )  # fmt: skip
            for _ in TokenFeedLoader(ds, num_workers=0, report_after=1.0):
                # A training step's stand-in, so that the run lasts the whole test.
                if self.stop.wait(STEP_S):
                    return
        except BaseException as exc:  # reported by the test, not lost in a thread
            self.errors.append(exc)

    def __enter__(self) -> Trainers:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)
        assert not self.errors, self.errors


@pytest.fixture(scope="module")
def trainers(server: LiveServer) -> Iterator[Trainers]:
    with Trainers(server) as running:
        yield running


# -- without a browser: what the server sends ---------------------------------------------


class _Refs(HTMLParser):
    """Every src/href of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.refs += [v for k, v in attrs if k in ("src", "href") and v]


def refs(html: str) -> list[str]:
    parser = _Refs()
    parser.feed(html)
    return parser.refs


def test_page_and_its_files_come_from_the_server(server: LiveServer) -> None:
    page = server.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "<script>" not in page.text and "style=" not in page.text  # nothing inline
    assert sorted(refs(page.text)) == sorted(
        ["console/console.css", "console/console.js", "docs", "redoc"]
    )
    for ref in ("console/console.css", "console/console.js"):
        assert server.get("/" + ref).status_code == 200
    js = server.get("/console/console.js").text
    assert not re.search(r"\.(inner|outer)HTML\s*=|insertAdjacentHTML|document\.write|eval\(", js)
    assert server.get("/console/nothing.js").status_code == 404


@pytest.mark.parametrize("path", ["/docs", "/redoc"])
def test_api_docs_reference_only_the_servers_own_paths(server: LiveServer, path: str) -> None:
    html = server.get(path).text
    assert not re.search(r"https?://", html), html  # no CDN, no fonts, no validator
    found = refs(html)
    assert found and all(ref.startswith("/docs/assets/") for ref in found), found
    for ref in found:
        assert server.get(ref).status_code == 200
    assert server.get("/openapi.json").status_code == 200


# -- in Chromium ----------------------------------------------------------------------------


def expect(locator: Any) -> Any:
    """Playwright's auto-waiting assertions (they need no eval, which the page's CSP
    forbids)."""
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(locator)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    executable = chromium()
    if executable is None:
        pytest.skip("no chromium on PATH: run scripts/install-chromium (needs apt and root)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=BROWSER_FLAGS)
        try:
            yield browser
        finally:
            browser.close()


def open_console(browser: Any, srv: LiveServer, token: str) -> tuple[Any, list[str]]:
    """A fresh tab (its own sessionStorage) on the page, logged in with ``token``."""
    context = browser.new_context(viewport={"width": 1500, "height": 760})
    page = context.new_page()
    page.set_default_timeout(20_000)
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto(srv.http + "/")
    page.wait_for_selector("#login:not([hidden])")  # a tenants server asks for a token
    page.fill("#token", token)
    page.click("#login button[type=submit]")
    page.wait_for_selector("#main:not([hidden])")
    return page, requested


def job_rows(page: Any) -> list[dict[str, str]]:
    return page.eval_on_selector_all(
        "#jobs tbody tr",
        """rows => rows.map(row => Object.fromEntries(
            [...row.cells].map(cell => [cell.dataset.field, cell.textContent])))""",
    )


def consumed(page: Any, dataset: str) -> int:
    [row] = [r for r in job_rows(page) if r["dataset"] == dataset]
    return int(row["consumed"].replace(",", ""))


@pytest.mark.timeout(180)
def test_admin_sees_both_jobs_moving(
    browser: Any, server: LiveServer, trainers: Trainers, tmp_path: Path
) -> None:
    page, requested = open_console(browser, server, ADMIN)
    expect(page.locator("#jobs tbody tr")).to_have_count(2)
    rows = {r["dataset"]: r for r in job_rows(page)}
    assert set(rows) == {"books", "code"}
    assert rows["books"]["tenant"] == "alice" and rows["code"]["tenant"] == BOB_NAME
    assert rows["books"]["plan"].startswith("seq 64 · batch 2 · world 1")
    assert rows["books"]["workers"] == "1" and rows["books"]["retransmits"] == "0"
    books = page.locator("#jobs tbody tr", has_text="books")
    # The bar is the trainer's consumed position, once it has reported one.
    progress = books.locator("[data-field=progress]")
    expect(progress).to_have_text(re.compile(r"^\s*epoch \d+ · \d+\.\d%\s*$"), timeout=30_000)
    # The page refreshes itself: the consumed position moves while the trainers train,
    # and the served (prefetched) one is ahead of it.
    before = consumed(page, "books")
    cell = books.locator("[data-field=consumed]")
    expect(cell).not_to_have_text(f"{before:,}", timeout=30_000)
    assert consumed(page, "books") > before
    [row] = [r for r in job_rows(page) if r["dataset"] == "books"]
    assert int(row["prefetched"].replace(",", "")) >= int(row["consumed"].replace(",", ""))
    # Names are text: no element was made from a tenant name or a tokenizer kind.
    assert page.locator("#jobs tbody b").count() == 0
    assert page.locator("#datasets tbody img").count() == 0
    assert page.title() == "tokenfeed-server"
    kinds = page.eval_on_selector_all(
        "#datasets [data-field=tokenizer]", "cells => cells.map(c => c.textContent)"
    )
    assert any(HOSTILE.kind in k for k in kinds)
    server_facts = page.text_content("#server")
    assert "ready" in server_facts and "tenants" in server_facts
    # Everything the page loaded came from the server itself.
    assert requested and all(url.startswith(server.http + "/") for url in requested)
    shot = Path(os.environ.get("TOKENFEED_CONSOLE_SCREENSHOT", tmp_path / "console.png"))
    # A sparkline with a few points in each row, for a screenshot worth keeping.
    expect(page.locator("#jobs polyline")).to_have_count(2)
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page.context.close()


@pytest.mark.timeout(120)
def test_a_tenant_sees_only_its_job(browser: Any, server: LiveServer, trainers: Trainers) -> None:
    page, _ = open_console(browser, server, ALICE)
    expect(page.locator("#jobs tbody tr")).to_have_count(1)
    rows = job_rows(page)
    assert [(r["tenant"], r["dataset"]) for r in rows] == [("alice", "books")]
    datasets = page.eval_on_selector_all(
        "#datasets tbody tr", "rows => rows.map(r => r.dataset.dataset)"
    )
    assert datasets == ["books"]
    assert "bob" not in page.text_content("body")
    page.context.close()


@pytest.mark.timeout(120)
def test_a_refused_token_asks_again(browser: Any, server: LiveServer) -> None:
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(20_000)
    page.goto(server.http + "/")
    page.fill("#token", "not-a-token")
    page.click("#login button[type=submit]")
    expect(page.locator("#login-error")).to_contain_text("does not accept this token")
    assert page.is_hidden("#main")
    assert page.evaluate("sessionStorage.getItem('tokenfeed.token')") is None
    context.close()


@pytest.mark.timeout(120)
def test_docs_page_renders_offline(browser: Any, server: LiveServer) -> None:
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(20_000)
    # Finished requests: ReDoc's footer asks for a logo on its CDN, which the page's
    # Content-Security-Policy blocks in the browser (the logo then hides itself).
    requested: list[str] = []
    page.on("requestfinished", lambda request: requested.append(request.url))
    page.goto(server.http + "/docs")
    page.wait_for_selector(".swagger-ui .info .title")
    assert "tokenfeed-server" in page.text_content(".swagger-ui .info .title")
    page.goto(server.http + "/redoc")
    page.wait_for_selector("h1")
    assert "tokenfeed-server" in page.text_content("h1")
    own = (server.http + "/", "blob:" + server.http + "/")  # ReDoc's worker: made in the page
    outside = [url for url in requested if not url.startswith(own)]
    assert not outside, outside
    context.close()


def test_trainers_were_real(trainers: Trainers, server: LiveServer) -> None:
    # The jobs the page showed were served over the data plane by these trainers.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not trainers.errors:
        jobs = server.get("/v1/jobs", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        if len(jobs) == 2 and all(j["batches_served"] > 0 for j in jobs):
            break
        threading.Event().wait(0.1)
    assert not trainers.errors


@pytest.fixture(scope="module")
def s3_console(
    s3_server_module: S3Server,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LiveServer, str]]:
    """An open server over a bucket: ``fine``, and ``lost`` whose first shard object was
    deleted before the server started (it does not open); and that object's URL."""
    s3 = s3_server_module
    s3.make_bucket("console")
    local = tmp_path_factory.mktemp("local")
    docs = [np.arange(n, dtype=np.uint16) % 256 for n in range(100, 2100, 100)]
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3.env({}).items():
            mp.setenv(key, value)
        objects = ObjectStore(S3Location("console", "store"))
        for name in ("fine", "lost"):
            write_dataset(local, name, docs, tokenizer=BYTE, shuffle_seed=0, piece_bytes=4096)
            manifest = publish_dataset(local / name, objects, name)
    key = f"store/lost/{manifest.shards[0].name}"
    s3.client.delete_object(Bucket="console", Key=key)
    cache = tmp_path_factory.mktemp("cache")
    command = [
        sys.executable, "-m", "tokenfeed_server.cli", "serve", "--store", "s3://console/store",
        "--host", "127.0.0.1", "--zmq-port", "0", "--http-port", "0",
        "--cache-dir", str(cache / "c"), "--cache-size", str(4 << 20),
    ]  # fmt: skip
    with LiveServer(command=command, env=s3.env(), log_path=cache / "server.log") as srv:
        yield srv, f"s3://console/{key}"


@pytest.mark.timeout(120)
def test_a_dataset_that_does_not_serve_shows_why_and_what_to_run(
    browser: Any, s3_console: tuple[LiveServer, str]
) -> None:
    srv, url = s3_console
    page = browser.new_context().new_page()
    page.set_default_timeout(20_000)
    page.goto(srv.http + "/")  # an open server: no token asked
    lost = page.locator("#datasets tr[data-dataset=lost]")
    expect(lost.locator("[data-field=status]")).to_have_text("unavailable")
    expect(page.locator("#datasets tr[data-dataset=fine] [data-field=status]")).to_have_text("ok")
    assert page.locator("#datasets tr[data-trouble=fine]").count() == 0
    trouble = page.locator("#datasets tr[data-trouble=lost]")
    expect(trouble.locator("[data-field=error]")).to_contain_text("shard object is missing")
    expect(trouble.locator("[data-field=since]")).to_contain_text("since ")
    named = trouble.locator("li[data-kind=missing]")
    expect(named).to_have_count(1)
    assert named.get_attribute("data-object") == url and url in named.text_content()
    expect(trouble.locator("[data-field=fix]")).to_contain_text(
        "tokenfeed-server inspect lost --store s3://console/store --verify --repair --source DIR"
    )
    page.context.close()


@pytest.mark.timeout(120)
def test_a_refused_tokens_message_stays_through_the_refreshes(
    browser: Any, server: LiveServer
) -> None:
    """The message stays until the user acts: the page keeps refreshing (asking the
    server's status every 2 s) and must not wipe it; a new try clears it."""
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(20_000)
    asked: list[str] = []
    page.on("requestfinished", lambda request: asked.append(request.url))
    page.goto(server.http + "/")
    page.fill("#token", "not-a-token")
    page.click("#login button[type=submit]")
    message = page.locator("#login-error")
    expect(message).to_contain_text("does not accept this token")
    seen = len([u for u in asked if u.endswith("/v1/status")])
    # two more refreshes (each asks /v1/status first), then the message is still there
    page.wait_for_function(
        "n => performance.getEntriesByType('resource')"
        ".filter(e => e.name.endsWith('/v1/status')).length >= n",
        arg=seen + 2,
        timeout=15_000,
    )
    expect(message).to_contain_text("does not accept this token")
    page.fill("#token", ALICE)  # the user acts: the verdict goes, the page opens
    page.click("#login button[type=submit]")
    page.wait_for_selector("#main:not([hidden])")
    expect(message).to_have_text("")
    context.close()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """An open server (jobs forgotten 1 s after their trainer leaves) with a mixture job
    that is reading and one single-dataset job that ran and was forgotten."""
    root = tmp_path_factory.mktemp("mixed")
    docs = [np.arange(n, dtype=np.uint16) % 256 for n in range(100, 2100, 100)]
    for name in ("web", "wiki"):
        write_dataset(root, name, docs, tokenizer=BYTE, shuffle_seed=0)
    with LiveServer(root, extra=["--job-ttl-s", "1"]) as srv:
        srv.run_job("wiki")  # ends at once: forgotten a second later, its counters kept
        mixture = Mixture({"web": 3, "wiki": 1})
        ds = TokenFeedDataset(
            srv.zmq, mixture, seq_len=32, batch_size=2, rank=0, world_size=1, samples=10**6,
            request_timeout=5.0, deadline=30.0,
        )  # fmt: skip
        batches = iter(ds)
        next(batches)  # the mixture job stays attached while the page looks
        try:
            yield srv
        finally:
            batches.close()  # type: ignore[attr-defined]  # a generator: says bye


@pytest.mark.timeout(120)
def test_jobs_show_their_kind_run_end_and_the_snapshots_age(
    browser: Any, mixed: LiveServer
) -> None:
    srv = mixed
    page = browser.new_context(viewport={"width": 1800, "height": 760}).new_page()
    page.set_default_timeout(20_000)
    page.goto(srv.http + "/")  # an open server: no token asked
    expect(page.locator("#jobs tbody tr")).to_have_count(2)
    mix = page.locator("#jobs tbody tr", has_text="web+wiki")
    expect(mix.locator("[data-field=kind]")).to_have_text(
        re.compile(r"mixture\s+web 75% · wiki 25%")
    )
    expect(mix.locator("[data-field=run]")).not_to_have_text("—")
    # the single-dataset job ended and was forgotten: listed greyed with final counters
    wiki = page.locator("#jobs tbody tr[data-forgotten=yes]")
    expect(wiki.locator("[data-field=dataset]")).to_have_text("wiki")
    expect(wiki.locator("[data-field=kind]")).to_have_text("dataset")
    expect(wiki.locator("[data-field=idle]")).to_contain_text("final")
    assert int(wiki.locator("[data-field=prefetched]").text_content().replace(",", "")) > 0
    assert "ended" in (wiki.get_attribute("class") or "")
    # the columns say which position is which, and why served runs ahead
    expect(page.locator("#served-head")).to_contain_text("prefetched by the trainer's loader")
    expect(page.locator("#consumed-head")).to_contain_text("reached the training loop")
    assert "runs ahead" in (page.get_attribute("#served-head", "title") or "")
    expect(page.locator("#jobs-explain")).to_contain_text("Served runs ahead of consumed")
    expect(page.locator("#jobs-age")).to_have_text(re.compile(r"as of \d+\.\d s before"))
    # equal tokenizers show one short hash, the full one as a tooltip
    hashes = page.locator("#datasets [data-field=tokenizer-hash]")
    expect(hashes).to_have_count(2)
    short = {h.strip() for h in hashes.all_text_contents()}
    assert len(short) == 1 and re.fullmatch(r"#[0-9a-f]{12}", short.pop())
    assert (hashes.first.get_attribute("title") or "").startswith("blake2b-128:")
    page.context.close()
