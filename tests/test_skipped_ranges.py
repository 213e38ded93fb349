"""The steps a run skipped on purpose (``load_state_dict(state, skip_batches=N)``) reach
the server in ``hello.skipped`` and show on the job's page and in ``tokenfeed-server jobs``.

Mixed versions both ways: a client from before skipped ranges (a hello without the field)
gets a job with none; a new client meeting a server from before them (a ROUTER answering
with that server's refusal) says hello again without the field, and, meeting a server from
before run ids too, without both.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from live_server import LiveServer
from old_server import OldServer
from shard_data import BYTE, random_docs
from test_console import browser, expect  # noqa: F401  (fixture)
from tokenfeed import TokenFeedDataset, protocol
from tokenfeed.errors import ProtocolError
from tokenfeed.protocol import JobSpec
from tokenfeed.transport.client import ClientOptions, FeedClient
from tokenfeed_server.cli import main
from tokenfeed_server.store import write_dataset
from waiting import wait_until

pytestmark = pytest.mark.network

RUN = "skip-run-1"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("store")
    write_dataset(root, "alpha", random_docs(200, seed=3), tokenizer=BYTE, shuffle_seed=1)
    with LiveServer(root, log_path=root.parent / "server.log") as srv:
        yield srv


def dataset(srv: LiveServer, **kw: Any) -> TokenFeedDataset:
    return TokenFeedDataset(
        srv.zmq, "alpha", seq_len=16, batch_size=2, rank=0, world_size=1, samples=10**6,
        run=RUN, request_timeout=5.0, deadline=20.0, **kw,
    )  # fmt: skip


def job_of(srv: LiveServer, run: str) -> dict[str, Any] | None:
    """The job of ``run`` in the server's latest snapshot (None: not in it yet)."""
    jobs = [j for j in srv.get("/v1/jobs").json() if j["run"] == run]
    assert len(jobs) <= 1, jobs
    return jobs[0] if jobs else None


@pytest.fixture(scope="module")
def resumed(server: LiveServer) -> Iterator[TokenFeedDataset]:
    """A run that took 2 batches, saved, and resumed skipping the next 3 (positions 4-9,
    steps 2-4); left attached (one batch taken) while the tests look."""
    saved = dataset(server)
    first = iter(saved)
    for _ in range(2):
        next(first)
    first.close()  # type: ignore[attr-defined]  # a generator: says bye
    state = saved.state_dict()
    assert state["position"] == 4 and "skipped" not in state
    again = dataset(server)
    again.load_state_dict(state, skip_batches=3)
    assert again.skipped == [(4, 6)] and again.position == 10
    batches = iter(again)
    assert int(next(batches)["window_ids"][0]) >= 0
    try:
        yield again
    finally:
        batches.close()  # type: ignore[attr-defined]


def test_the_job_lists_the_skipped_ranges(server: LiveServer, resumed: TokenFeedDataset) -> None:
    # the snapshot behind /v1/jobs is refreshed every 0.5 s: the first that has them
    skipped = wait_until(
        lambda: (job_of(server, RUN) or {}).get("skipped"), 10.0, "the skipped ranges listed"
    )
    assert skipped == [[4, 6]]


def test_the_admin_cli_shows_the_skipped_steps(
    server: LiveServer, resumed: TokenFeedDataset, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["jobs", "--url", server.http]) == 0
    out = capsys.readouterr().out
    lines = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines() if line.strip()]
    header = lines[0]
    assert header[3:5] == ["RUN", "SKIPPED"]
    row = next(dict(zip(header, r, strict=True)) for r in lines if RUN in r)
    assert row["SKIPPED"] == "2-4"


@pytest.mark.timeout(120)
def test_the_page_shows_the_skipped_steps(
    browser: Any,  # noqa: F811  (the fixture imported above)
    server: LiveServer,
    resumed: TokenFeedDataset,
) -> None:
    page = browser.new_context(viewport={"width": 1800, "height": 760}).new_page()
    page.set_default_timeout(20_000)
    page.goto(server.http + "/")  # an open server: no token asked
    row = page.locator("#jobs tbody tr", has_text=RUN)
    badge = row.locator("[data-field=skipped]")
    expect(badge).to_have_text("skipped steps 2\u20134")  # an en dash, as typeset
    assert "positions 4\u20139" in (badge.get_attribute("title") or "")
    page.context.close()


def test_an_old_clients_hello_has_no_skipped_field_and_its_job_none(server: LiveServer) -> None:
    hello = protocol.Hello(
        dataset="alpha", seq_len=16, batch_size=2, seed=0, world_size=1, rank=0, worker=0,
        window=4, client="old", run="old-client-run",
    )  # fmt: skip
    assert "skipped" not in msgpack.unpackb(hello.header())  # the bytes of before
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(server.zmq)
        sock.send(hello.header())
        assert sock.poll(10_000), "no answer to hello"
        assert isinstance(protocol.decode_header(sock.recv()), protocol.Welcome)
    finally:
        sock.close(linger=0)
    job = wait_until(lambda: job_of(server, "old-client-run"), 10.0, "the old client's job")
    assert job is not None and job["skipped"] == []


def test_a_server_from_before_skipped_ranges_shows_none_in_the_cli() -> None:
    from tokenfeed_server.http.admin_cli import skipped_steps

    old = {"batch_size": 2, "world_size": 2}  # no "skipped" key at all
    assert skipped_steps(old) == "-"
    assert skipped_steps({**old, "skipped": [[8, 4], [40, 12]]}) == "2, 10-12"


@pytest.mark.parametrize("known", [("run",), ()], ids=["before-skipped", "before-run-ids"])
def test_a_new_client_says_hello_to_an_old_server_without_its_skipped(
    known: tuple[str, ...],
) -> None:
    old = OldServer({"run", "skipped"} - set(known))
    job = JobSpec("alpha", 16, 4, 5, 2, run="run-a")
    options = ClientOptions(request_timeout=2.0, deadline=10.0)
    try:
        with FeedClient(
            old.endpoint, job, rank=0, worker=0, options=options, skipped=[(8, 16)]
        ) as client:
            assert client.hello().job == "0123456789abcdef"
            client.hello()  # a reconnect: nothing refused again
    finally:
        old.close()
    sent = old.hellos
    assert sent[0]["skipped"] == [[8, 16]] and sent[0]["run"] == "run-a"
    assert all("skipped" not in f for f in sent[1:])
    if known:  # a server with run ids keeps getting the run id
        assert len(sent) == 3 and all(f["run"] == "run-a" for f in sent[1:])
    else:  # both refused at once, both dropped at once (neither changes a token)
        assert len(sent) == 3 and all("run" not in f for f in sent[1:])


def test_a_bad_skipped_range_is_refused() -> None:
    bad = protocol.Hello(
        dataset="alpha", seq_len=16, batch_size=2, seed=0, world_size=1, rank=0, worker=0,
        window=4, client="bad", skipped=((4, 6, 1),),
    )  # fmt: skip
    with pytest.raises(ProtocolError, match=r"hello\.skipped"):
        bad.check()
