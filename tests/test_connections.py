"""Connections come and go without leaking server slots, jobs, threads or sockets."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from live_server import LiveServer
from shard_data import BYTE
from tokenfeed import TokenFeedDataset, TokenFeedLoader, protocol
from tokenfeed.errors import UnknownDataset
from tokenfeed.protocol import JobSpec
from tokenfeed.transport.client import ClientOptions, FeedClient
from tokenfeed_server.store import write_dataset
from waiting import wait_until

pytestmark = pytest.mark.network


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("store")
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 256, size=2000, dtype=np.uint16) for _ in range(200)]
    write_dataset(
        root,
        "alpha",
        docs,
        shuffle_seed=0,
        tokenizer=BYTE,
    )
    extra = ["--max-connections-per-tenant", "1", "--max-jobs", "8"]
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with LiveServer(root, extra=extra, log_path=log) as srv:
        yield srv


def connections(server: LiveServer, want: int) -> int:
    seen = -1

    def settled() -> bool:  # the status snapshot refreshes twice a second
        nonlocal seen
        seen = int(server.get("/v1/status").json()["connections"])
        return seen == want

    with contextlib.suppress(AssertionError):
        wait_until(settled, 5, f"{want} connections")
    return seen


def test_reconnect_and_close_free_the_slot(server: LiveServer) -> None:
    job = JobSpec("alpha", 64, 4, 0, 1)
    with FeedClient(server.zmq, job, rank=0, worker=0) as first:
        first.hello()
        first.hello()  # a Lazy Pirate reconnect: new socket, same client, one slot
        assert connections(server, 1) == 1
    assert connections(server, 0) == 0  # bye freed it at once, not after a timeout
    with FeedClient(server.zmq, job, rank=0, worker=0) as second:
        second.hello()


def test_breaking_out_of_the_loader_stops_its_receiver(server: LiveServer) -> None:
    for _ in range(3):  # with a cap of one connection, a leak fails the second round
        loader = TokenFeedLoader(
            TokenFeedDataset(
                server.zmq, "alpha", seq_len=64, batch_size=4, rank=0, world_size=1, deadline=10.0
            ),
            num_workers=0,
            pin_memory=False,
        )
        for i, _batch in enumerate(loader):
            if i == 2:
                break
    assert connections(server, 0) == 0
    wait_until(
        lambda: not any(t.name == "tokenfeed-receive" for t in threading.enumerate()),
        5,
        "end of the receiver thread",
    )


def test_an_error_is_raised_once_then_the_loader_is_exhausted(server: LiveServer) -> None:
    loader = TokenFeedLoader(
        TokenFeedDataset(server.zmq, "missing", seq_len=64, batch_size=4, rank=0, world_size=1),
        num_workers=0,
        pin_memory=False,
    )
    it = iter(loader)
    with pytest.raises(UnknownDataset, match="alpha"):  # names what is there
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_hello_storm_cannot_grow_the_job_table(server: LiveServer) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.zmq)
    try:
        for seed in range(40):  # every seed is a new job; one connection holds one at a time
            hello = protocol.Hello("alpha", 64, 4, seed, 1, 0, 0, window=2, client="storm")
            sock.send(hello.header())
            assert sock.poll(5000)
            assert isinstance(protocol.decode_header(sock.recv()), protocol.Welcome)
        sock.send(protocol.Bye().header())  # frees the one connection slot
    finally:
        sock.close(linger=2000)  # bye is one-way: let it leave before the context ends
        ctx.term()
    wait_until(lambda: len(server.get("/v1/jobs").json()) <= 8, 5, "job table at its cap")
    assert server.get("/v1/limits").json()["max_jobs"] == 8
    # and the server still serves a normal client
    options = ClientOptions(deadline=10.0)
    with FeedClient(
        server.zmq, JobSpec("alpha", 64, 4, 1, 1), rank=0, worker=0, options=options
    ) as client:
        assert client.hello().n_windows > 0


def test_a_renamed_connection_is_not_evicted_by_its_old_name(server: LiveServer) -> None:
    """A connection that says hello again under another name leaves no trace of the old
    one: a later connection using the old name is a newcomer (refused at the cap of one
    connection per tenant here), not this one's reconnect that would evict it."""
    ctx = zmq.Context()
    first, second = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for sock in (first, second):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(server.zmq)

        def hello(sock: zmq.Socket[bytes], name: str) -> protocol.Message:
            msg = protocol.Hello("alpha", 64, 4, 77, 1, 0, 0, window=2, client=name)
            sock.send(msg.header())
            assert sock.poll(5000), "no answer to hello"
            return protocol.decode_header(sock.recv())

        assert isinstance(hello(first, "old-name"), protocol.Welcome)
        welcome = hello(first, "new-name")
        assert isinstance(welcome, protocol.Welcome)
        refused = hello(second, "old-name")
        assert isinstance(refused, protocol.Err) and refused.code == "connection_limit"
        first.send(protocol.Get(req=0, job=welcome.job, rank=0, pos=0, count=1, stride=1).header())
        assert first.poll(5000), "no answer to get"
        assert isinstance(protocol.decode_header(first.recv_multipart()[0]), protocol.Chunk)
        first.send(protocol.Bye().header())
    finally:
        first.close(linger=2000)
        second.close()
        ctx.term()
