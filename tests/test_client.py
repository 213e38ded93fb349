"""The client against real servers and real sockets: bad endpoints, refusals, silence, lies.

Each test is one fault a trainer meets from outside: an endpoint typed without
``tcp://``, a server at its job cap, a wrong port, a server that sends impossible values.
The client must fail fast with an error that names the cause, never hang, spin or
retry in a storm.
"""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from live_server import LiveServer
from shard_data import BYTE
from tokenfeed import TokenFeedDataset, errors, protocol
from tokenfeed.errors import (
    ConfigError,
    ConnectionLimit,
    DatasetChanged,
    ProtocolError,
    ServerError,
    ServerUnavailable,
    StorageUnavailable,
    UnknownDataset,
)
from tokenfeed.protocol import JobSpec
from tokenfeed.transport.client import ClientOptions, FeedClient, Request
from tokenfeed.transport.endpoint import check_endpoint
from tokenfeed.transport.retry import Backoff
from tokenfeed_server.store import write_dataset

pytestmark = pytest.mark.network

JOB = JobSpec("alpha", 16, 2, 0, 1)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 256, size=500, dtype=np.uint16) for _ in range(40)]
    write_dataset(root, "alpha", docs, shuffle_seed=0, tokenizer=BYTE)
    return root


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- endpoints (issue 11 item 6) ----------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint",
    [
        "127.0.0.1:7400",
        "tcp://127.0.0.1",
        "tcp://:7400",
        "tcp://host:0",
        "tcp://h:99999",
        "",
        "udp://h:1",
    ],
)
def test_a_malformed_endpoint_is_refused_with_the_expected_form(endpoint: str) -> None:
    with pytest.raises(ConfigError, match=r"tcp://host:port|port"):
        check_endpoint(endpoint)
    with pytest.raises(ConfigError):
        TokenFeedDataset(endpoint, "alpha", seq_len=16, batch_size=2, rank=0, world_size=1)


@pytest.mark.parametrize(
    "endpoint", ["tcp://127.0.0.1:7400", "tcp://data-0.cluster.local:1", "tcp://[::1]:7400"]
)
def test_well_formed_endpoints_pass(endpoint: str) -> None:
    assert check_endpoint(endpoint) == endpoint


def test_missing_scheme_suggests_the_fix() -> None:
    with pytest.raises(ConfigError, match=re.escape("did you mean 'tcp://127.0.0.1:7400'")):
        check_endpoint("127.0.0.1:7400")


@pytest.mark.parametrize(
    ("endpoint", "meant"),
    [("http://10.0.0.5:7401/", "tcp://10.0.0.5:7400"), ("https://[::1]:7401", "tcp://[::1]:7400")],
)
def test_an_http_url_points_at_the_data_port(endpoint: str, meant: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"did you mean '{meant}'")) as refused:
        check_endpoint(endpoint)
    assert "not HTTP" in str(refused.value)


@pytest.mark.parametrize("token", ["short", "a token with spaces in it", "tökentökentökentöken"])
def test_a_token_follows_the_one_rule_of_every_port(token: str) -> None:
    with pytest.raises(ConfigError, match="visible ASCII") as refused:
        ClientOptions(token=token)
    assert token not in str(refused.value)


def test_a_failed_connect_leaves_no_socket_to_hang_the_process() -> None:
    # Before the fix the process hung for ever in ctx.term() at exit: a child process
    # with a timeout is the only honest test. The second case reaches the connect failure
    # itself through a resolver that returns an address libzmq refuses.
    code = textwrap.dedent(
        """
        from tokenfeed.transport import replicas
        from tokenfeed.transport.client import FeedClient
        from tokenfeed.errors import ConfigError
        from tokenfeed.protocol import JobSpec
        job = JobSpec("alpha", 16, 2, 0, 1)
        try:
            FeedClient("127.0.0.1:7400", job, rank=0, worker=0)
        except ConfigError as exc:
            print("refused:", exc)
        replicas.resolve_host = lambda host, port: ["no such address"]
        client = FeedClient("tcp://data.test:7400", job, rank=0, worker=0)
        try:
            with client:
                client.hello()
        except ConfigError as exc:
            print("connect failed:", exc)
        print("exited cleanly")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "refused: endpoint '127.0.0.1:7400' is not of the form tcp://host:port" in done.stdout
    assert "connect failed: can not connect to endpoint 'tcp://no such address:7400'" in done.stdout
    assert done.stdout.rstrip().endswith("exited cleanly")


# -- options ------------------------------------------------------------------------------


def test_options_repr_hides_the_token() -> None:
    opts = ClientOptions(token="s3cret-token-of-tenant-a")
    assert "s3cret" not in repr(opts) and "s3cret" not in str(opts)
    assert opts.token == "s3cret-token-of-tenant-a"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window": 0},
        {"chunk_bytes": 0},
        {"deadline": 0},
        {"request_timeout": -1.0},
        {"window": True},
    ],
)
def test_impossible_options_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        ClientOptions(**kwargs)


# -- error codes (issue 11 item 12, client side) ------------------------------------------


@pytest.mark.parametrize("code", sorted(protocol.ERROR_CODES))
def test_every_wire_code_survives_from_code(code: str) -> None:
    err = ServerError.from_code(code, "message", retry=True)
    assert err.code == code and err.retry and str(err) == "message"


def test_codes_with_a_subclass_get_it_and_others_the_base() -> None:
    assert type(ServerError.from_code("connection_limit", "m")) is ConnectionLimit
    assert type(ServerError.from_code("dataset_changed", "m")) is DatasetChanged
    unknown_job = ServerError.from_code("unknown_job", "m")
    assert type(unknown_job) is ServerError and unknown_job.code == "unknown_job"
    assert ServerError("bug").code == "internal"  # a plain error stays "internal"


# The codes the errors module documents as having no subclass of their own.
PLAIN_CODES = {"unknown_job", "overloaded", "internal"}


@pytest.mark.parametrize("code", sorted(protocol.ERROR_CODES))
def test_from_code_is_the_one_table_from_wire_codes_to_exceptions(code: str) -> None:
    err = ServerError.from_code(code, "m", quiet=True)
    assert err.quiet and not err.retry
    if code in PLAIN_CODES:
        assert type(err) is ServerError
    else:
        assert type(err) is not ServerError and type(err).code == code


def test_every_server_error_class_has_a_wire_code() -> None:
    classes = [c for c in vars(errors).values() if isinstance(c, type)]
    subclasses = [c for c in classes if issubclass(c, ServerError) and c is not ServerError]
    assert {c.code for c in subclasses} == protocol.ERROR_CODES - PLAIN_CODES
    assert not ServerError("m").quiet  # quiet is the server's business, off by default


# -- retry storm (issue 11 item 5) --------------------------------------------------------


def test_a_refused_hello_backs_off_and_raises_the_real_cause(store: Path, tmp_path: Path) -> None:
    deadline = 3.0
    with (
        LiveServer(store, extra=["--max-jobs", "1"], log_path=tmp_path / "log") as srv,
        FeedClient(srv.zmq, JOB, rank=0, worker=0) as holder,
    ):
        holder.hello()  # takes the only job slot and keeps it while connected
        other = JobSpec("alpha", 16, 2, 1, 1)  # another seed: another job
        options = ClientOptions(deadline=deadline, request_timeout=1.0)
        with (
            FeedClient(srv.zmq, other, rank=0, worker=0, options=options) as refused,
            pytest.raises(ConnectionLimit, match="still refused after") as info,
        ):
            refused.hello()
        assert info.value.code == "connection_limit"
        refusals = srv.settled_counter("err_connection_limit")
    # Every hello was refused at once; between them the client waited its backoff, so
    # within the deadline there are at most as many as the schedule's floors allow.
    bound = Backoff(cap=1.0).max_retries(deadline) + 1
    assert 2 <= refusals <= bound, (refusals, bound)


# -- silence (issue 11 item 7) ------------------------------------------------------------


def test_silence_is_logged_before_the_deadline(caplog: pytest.LogCaptureFixture) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    options = ClientOptions(deadline=1.5, warn_after=0.3, request_timeout=0.5)
    with (
        caplog.at_level(logging.WARNING, logger="tokenfeed"),
        FeedClient(endpoint, JOB, rank=0, worker=0, options=options) as client,
        pytest.raises(ServerUnavailable, match=endpoint),
    ):
        client.hello()
    warnings = [r for r in caplog.records if r.name == "tokenfeed" and r.levelno == logging.WARNING]
    assert len(warnings) == 1  # once, not once per retry
    message = warnings[0].getMessage()
    assert endpoint in message and "deadline of 2s" in message and "/readyz" in message


def test_a_wrong_dataset_is_not_retried(store: Path, tmp_path: Path) -> None:
    with LiveServer(store, log_path=tmp_path / "log") as srv:
        job = JobSpec("nope", 16, 2, 0, 1)
        with FeedClient(srv.zmq, job, rank=0, worker=0) as client, pytest.raises(UnknownDataset):
            client.hello()


# -- a server that lies (issue 11 item 15) ------------------------------------------------


@pytest.fixture
def fake_server() -> Iterator[tuple[str, dict[str, Any]]]:
    """A real ROUTER socket that answers every hello with a welcome built from ``fields``."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    fields: dict[str, Any] = {
        "server": "fake",
        "job": "j1",
        "fingerprint": "f" * 32,
        "n_tokens": 10_000,
        "n_windows": 100,
        "dtype": "uint16",
        "window": 4,
        "max_count": 8,
        "eos_id": 256,
    }
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if router.poll(50):
                ident, _ = router.recv_multipart()
                router.send_multipart([ident, protocol.Welcome(**fields).header()])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}", fields
    finally:
        stop.set()
        thread.join(timeout=5)
        router.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(
    ("field", "value"),
    [("window", 0), ("max_count", 0), ("n_windows", 0), ("dtype", "float32"), ("eos_id", 70_000)],
)
def test_an_invalid_welcome_is_refused(
    fake_server: tuple[str, dict[str, Any]], field: str, value: object
) -> None:
    endpoint, fields = fake_server
    fields[field] = value
    options = ClientOptions(deadline=5.0)
    with (
        FeedClient(endpoint, JOB, rank=0, worker=0, options=options) as client,
        pytest.raises(ProtocolError, match=f"invalid welcome: {field}="),
    ):
        client.hello()


def test_a_valid_welcome_from_the_fake_is_accepted(fake_server: tuple[str, dict[str, Any]]) -> None:
    endpoint, fields = fake_server
    with FeedClient(endpoint, JOB, rank=0, worker=0) as client:
        assert client.hello().window == 4
        assert client.fingerprint == fields["fingerprint"]


def test_another_build_than_expected_is_refused_client_side(
    fake_server: tuple[str, dict[str, Any]],
) -> None:
    # the fake ignores hello's fingerprint: the client's own check must catch it
    endpoint, fields = fake_server
    expected = "e" * 32
    with (
        FeedClient(endpoint, JOB, rank=0, worker=0, fingerprint=expected) as client,
        pytest.raises(DatasetChanged, match=f"expected fingerprint {expected}") as info,
    ):
        client.hello()
    assert fields["fingerprint"] in str(info.value) and "drop the loader state" in str(info.value)


def _fake_router() -> tuple[
    zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes], int, protocol.Welcome
]:
    """A ROUTER on a free loopback port, and the welcome a fake server answers hello with."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    welcome = protocol.Welcome("fake", "j1", "f" * 32, 10_000, 100, "uint16", 4, 8, 256)
    return ctx, router, port, welcome


def _answer(router: zmq.Socket[bytes], ident: bytes, msg: protocol.Get) -> None:
    """Answer ``msg`` with rows whose every token is its position."""
    rows = msg.count * JOB.batch_size
    tokens = np.full((rows, JOB.seq_len + 1), msg.pos, dtype=np.uint16)
    ids = np.arange(rows)
    frames = protocol.chunk_frames(msg.req, tokens, {"window": ids, "epoch": ids * 0})
    router.send_multipart([ident, *frames])


def storage_server(refusals: int, *, retry: bool) -> tuple[str, threading.Event, list[int]]:
    """A fake server whose first ``refusals`` gets are answered storage_unavailable."""
    ctx, router, port, welcome = _fake_router()
    stop = threading.Event()
    refused: list[int] = []

    def serve() -> None:
        while not stop.is_set():
            if not router.poll(50):
                continue
            ident, header = router.recv_multipart()
            msg = protocol.decode_header(header)
            if isinstance(msg, protocol.Hello):
                router.send_multipart([ident, welcome.header()])
            elif isinstance(msg, protocol.Get) and len(refused) < refusals:
                refused.append(msg.req)
                err = protocol.Err("storage_unavailable", "bucket slow", retry, msg.req)
                router.send_multipart([ident, err.header()])
            elif isinstance(msg, protocol.Get):
                _answer(router, ident, msg)
        router.close(linger=0)
        ctx.term()

    threading.Thread(target=serve, daemon=True).start()
    return f"tcp://127.0.0.1:{port}", stop, refused


def test_storage_unavailable_with_retry_keeps_the_stream_going() -> None:
    endpoint, stop, refused = storage_server(3, retry=True)
    options = ClientOptions(deadline=20.0, request_timeout=2.0)
    try:
        with FeedClient(endpoint, JOB, rank=0, worker=0, options=options) as client:
            answers = list(client.stream([Request(pos=0, count=1), Request(pos=2, count=1)]))
    finally:
        stop.set()
    assert len(refused) == 3
    assert [int(a.tokens[0, 0]) for a in answers] == [0, 2]


def test_storage_unavailable_without_retry_ends_the_stream() -> None:
    endpoint, stop, _ = storage_server(1, retry=False)
    try:
        with (
            FeedClient(endpoint, JOB, rank=0, worker=0) as client,
            pytest.raises(StorageUnavailable, match="bucket slow"),
        ):
            list(client.stream([Request(pos=0, count=1)]))
    finally:
        stop.set()


def notice_server(
    notices_s: float, *, on_hello: bool = False
) -> tuple[str, threading.Event, dict[str, int]]:
    """A fake server that keeps each get waiting on "object storage" for ``notices_s``,
    telling the client so every 0.2 s (the notice of a server that retries), then answers
    it; with ``on_hello`` it refuses hello so for that long instead."""
    ctx, router, port, welcome = _fake_router()
    stop = threading.Event()
    seen = {"hello": 0, "notices": 0}
    notice = errors.StorageUnavailable.retrying_message(60, "s3://bkt/d/shard-1.bin", "refused")

    def tell(ident: bytes, req: int) -> None:
        err = protocol.Err("storage_unavailable", notice, True, req)
        router.send_multipart([ident, err.header()])
        seen["notices"] += 1

    def serve() -> None:
        gets: list[tuple[float, bytes, protocol.Get]] = []  # (answered at, connection, get)
        refuse_until = 0.0
        while not stop.is_set():
            now = time.monotonic()
            for item in [g for g in gets if g[0] <= now]:
                gets.remove(item)
                _answer(router, item[1], item[2])
            for _, ident, get in gets:  # about every 0.2 s: still waiting on storage
                tell(ident, get.req)
            if not router.poll(200):
                continue
            ident, header = router.recv_multipart()
            msg = protocol.decode_header(header)
            if isinstance(msg, protocol.Hello):
                seen["hello"] += 1
                if on_hello and seen["hello"] == 1:
                    refuse_until = now + notices_s
                if now < refuse_until:
                    tell(ident, -1)  # a refused hello: no request id
                else:
                    router.send_multipart([ident, welcome.header()])
            elif isinstance(msg, protocol.Get):
                gets.append((now + (0.0 if on_hello else notices_s), ident, msg))
        router.close(linger=0)
        ctx.term()

    threading.Thread(target=serve, daemon=True).start()
    return f"tcp://127.0.0.1:{port}", stop, seen


def test_a_storage_notice_is_waited_out_on_the_same_connection_past_the_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="tokenfeed")
    endpoint, stop, seen = notice_server(2.5)
    options = ClientOptions(deadline=1.0, request_timeout=1.0)
    try:
        with FeedClient(endpoint, JOB, rank=0, worker=0, options=options) as client:
            answers = list(client.stream([Request(pos=0, count=1), Request(pos=2, count=1)]))
    finally:
        stop.set()
    assert [int(a.tokens[0, 0]) for a in answers] == [0, 2]
    assert seen["hello"] == 1 and seen["notices"] >= 10  # no reconnect, no re-ask
    warned = [r.getMessage() for r in caplog.records if "does not answer" in r.getMessage()]
    assert len(warned) == 1  # rate limited: once per 30 s
    assert "s3://bkt/d/shard-1.bin: refused" in warned[0] and "waiting" in warned[0]


def test_hello_refused_while_storage_is_away_logs_and_waits_for_the_server(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="tokenfeed")
    endpoint, stop, seen = notice_server(2.0, on_hello=True)
    options = ClientOptions(deadline=1.0, request_timeout=1.0)
    try:
        with FeedClient(endpoint, JOB, rank=0, worker=0, options=options) as client:
            assert client.hello().window == 4  # past its own deadline: the server's counts
    finally:
        stop.set()
    assert seen["hello"] >= 2
    assert any("does not answer" in r.getMessage() for r in caplog.records)


# -- a failed loader leaves nothing behind (issue 11 item 13) -----------------------------


def test_a_loader_failed_in_its_workers_leaves_nothing_for_a_fork_to_inherit(
    store: Path,
) -> None:
    # The failed loader's DataLoader iterator lives on in a reference cycle of the
    # exception. Garbage collection is held off (as when it just has not run yet) and a
    # forked child collects, as a new loader's worker would: torch's shutdown must not
    # run there ("Exception ignored ... can only test a child process").
    code = textwrap.dedent(
        """
        import gc, os, sys
        from itertools import islice
        from pathlib import Path
        sys.path.insert(0, "tests")
        from live_server import LiveServer
        from tokenfeed import TokenFeedDataset, TokenFeedLoader

        def loader(endpoint):
            ds = TokenFeedDataset(endpoint, "alpha", seq_len=16, batch_size=2, rank=0,
                                  world_size=1, deadline=1.0, request_timeout=0.3)
            return TokenFeedLoader(ds, num_workers=2, pin_memory=False, prefetch=1)

        gc.disable()
        srv = LiveServer(Path(sys.argv[1])).start()
        batches = iter(loader(srv.zmq))
        next(batches)
        srv.kill()
        try:
            for _ in batches:
                pass
        except Exception as exc:
            print("first loader failed:", type(exc).__name__, flush=True)
        pid = os.fork()
        if pid == 0:
            gc.collect()
            os._exit(0)
        os.waitpid(pid, 0)
        gc.enable()
        with LiveServer(Path(sys.argv[1])) as again:
            print(len(list(islice(iter(loader(again.zmq)), 5))), "batches", flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(store)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "first loader failed: ServerUnavailable" in done.stdout
    assert "5 batches" in done.stdout
    assert "can only test a child process" not in done.stderr
    assert "Exception ignored" not in done.stderr
