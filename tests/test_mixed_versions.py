"""Old and new releases together: replicas mid-upgrade, and an old client on a new server.

A rolling upgrade leaves a job's replicas on two releases for a while. Here one replica is
a real server of this release and the other the release before every optional ``hello``
field (``run``, ``skipped``, ``allow_read_amplification``, ``ring``): a real server behind
:class:`~old_server.OldServer`, which refuses a hello naming any of them in the old
decoder's words and forwards everything else, so that release serves real batches (over
TCP: it never heard of rings). A trainer of two DataLoader workers names both replicas;
every epoch is compared, batch for batch, with one read from a single server over TCP:
in either order of the replicas, with either replica paused mid-epoch (its worker fails
over to the other release and comes back), and with a client whose own replica is the
old one but which met the new one first. Last, a client of the old release (a hello
without the new fields, and a decoder that knows none of the new answer fields) reads a
whole epoch from a new server.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq

from live_server import LiveServer
from old_server import OldServer
from shard_data import BYTE
from tokenfeed import TokenFeedDataset, TokenFeedLoader, protocol
from tokenfeed.protocol import JobSpec
from tokenfeed.transport.client import ClientOptions, FeedClient, Request
from tokenfeed.transport.older import DROPPABLE
from tokenfeed_server.store import write_dataset
from waiting import wait_until

pytestmark = pytest.mark.network

BATCH, SEQ = 4, 16
PAUSE_AT = 8  # the step after which a replica stops answering: requests in flight
#: what a release from before rings never sends, and so never knew how to read
RING_ANSWER_FIELDS = {"welcome": {"ring_door", "ring_key"}, "chunk": {"ring_offset", "ring_end"}}
Epoch = list[tuple[torch.Tensor, torch.Tensor]]  # per step: (window_ids, input_ids)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    rng = np.random.default_rng(25)
    docs = [rng.integers(0, 256, size=500, dtype=np.uint16) for _ in range(40)]
    write_dataset(root, "alpha", docs, shuffle_seed=0, tokenizer=BYTE)
    return root


@pytest.fixture(scope="module")
def new(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with LiveServer(store, log_path=tmp_path_factory.mktemp("new") / "log") as srv:
        yield srv


@pytest.fixture(scope="module")
def behind_old(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The server whose data the old release serves (never seen by a client directly)."""
    with LiveServer(store, log_path=tmp_path_factory.mktemp("old") / "log") as srv:
        yield srv


@pytest.fixture(scope="module")
def old(behind_old: LiveServer) -> Iterator[OldServer]:
    """The release from before every optional hello field, serving real data."""
    srv = OldServer(DROPPABLE, backend=behind_old.zmq)
    yield srv
    srv.close()


def epoch_loader(endpoints: str | Sequence[str], *, ring: bool | None = None) -> TokenFeedLoader:
    """One rank, two workers (worker 0's own replica is the first, worker 1's the second),
    one batch per request, one epoch; asking its own replica again every 0.2 s once it
    failed over. ``ring``: as ``ClientOptions.shared_memory`` (None: on this host, yes)."""
    ds = TokenFeedDataset(
        endpoints, "alpha", seq_len=SEQ, batch_size=BATCH, rank=0, world_size=1, epochs=1,
        batches_per_item=1, chunk_bytes=1, request_timeout=1.0, deadline=30.0,
    )  # fmt: skip
    ds.options = dataclasses.replace(ds.options, return_after=0.2, shared_memory=ring)
    return TokenFeedLoader(ds, num_workers=2, pin_memory=False, prefetch=2)


def read(ld: TokenFeedLoader, after_step: Callable[[int], None] | None = None) -> Epoch:
    out: Epoch = []
    for step, batch in enumerate(ld):
        out.append((batch["window_ids"], batch["input_ids"]))
        if after_step is not None:
            after_step(step)
    return out


def assert_same(got: Epoch, want: Epoch) -> None:
    assert len(got) == len(want)
    for step, ((wids, ids), (ref_wids, ref_ids)) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(wids, ref_wids), step
        assert torch.equal(ids, ref_ids), step


@pytest.fixture(scope="module")
def reference(new: LiveServer) -> Epoch:
    """The epoch from one server over TCP; every window in it once."""
    rings = new.settled_counter("ring_chunks")
    want = read(epoch_loader(new.zmq, ring=False))
    assert new.settled_counter("ring_chunks") == rings
    windows = torch.cat([wids for wids, _ in want]).tolist()
    assert len(want) > 4 * PAUSE_AT and len(set(windows)) == len(windows) == len(want) * BATCH
    return want


def workers_on(srv: LiveServer) -> int:
    """Connections attached to this server's jobs, as its snapshot (every 0.5 s) shows."""
    return sum(j["workers"] for j in srv.get("/v1/jobs").json() if j["ended"] is None)


def accepted(old: OldServer, since: int) -> list[dict[str, object]]:
    """The hellos the old release let through since hello number ``since``."""
    return [h for h in old.hellos[since:] if not DROPPABLE.keys() & h.keys()]


# -- an epoch over replicas of two releases ----------------------------------------------------


@pytest.mark.parametrize("order", ["old,new", "new,old"])
def test_replicas_of_two_releases_serve_the_epoch_exactly_once(
    order: str, new: LiveServer, behind_old: LiveServer, old: OldServer, reference: Epoch
) -> None:
    endpoints = {"old": old.endpoint, "new": new.zmq}
    hellos, refused = len(old.hellos), old.refused
    rings, served_old = new.settled_counter("ring_chunks"), behind_old.settled_counter("chunks")
    got = read(epoch_loader([endpoints[name] for name in order.split(",")]))
    assert_same(got, reference)
    # one worker on each release: the new one took its chunks through its ring (the
    # reference came over TCP, byte for byte the same), the old one over TCP
    assert new.settled_counter("ring_chunks") > rings
    assert behind_old.settled_counter("chunks") > served_old
    assert behind_old.settled_counter("ring_chunks") == 0
    # the old release refused the new fields (the ring among them) once per client, then
    # served without them
    assert old.refused > refused and any(h.get("ring") for h in old.hellos[hellos:])
    assert accepted(old, hellos)


@pytest.mark.parametrize("victim", ["new", "old"])
def test_a_replica_paused_mid_epoch_fails_over_to_the_other_release_and_back(
    victim: str, new: LiveServer, behind_old: LiveServer, old: OldServer, reference: Epoch
) -> None:
    paused, other = (new, behind_old) if victim == "new" else (behind_old, new)
    ld = epoch_loader([old.endpoint, new.zmq])
    phase, served_back = "spread", 0

    def step(i: int) -> None:
        nonlocal phase, served_back
        if phase == "spread" and i == PAUSE_AT:
            both = lambda: workers_on(new) == 1 and workers_on(behind_old) == 1  # noqa: E731
            wait_until(both, 10.0, "one worker on each release")
            pause(victim, new, old)  # its worker's requests go unanswered
            phase = "paused"
        elif phase == "paused" and ld.failovers >= 1:
            wait_until(lambda: workers_on(other) == 2, 10.0, "both workers on the other release")
            resume(new, old)
            phase = "resumed"
        elif phase == "resumed":
            # the worker asks its own replica again, goes back at a request boundary
            if workers_on(other) == 1 and workers_on(paused) >= 1:
                served_back = batches_served(paused)
                phase = "back"
            threading.Event().wait(0.01)  # a training step: the epoch outlasts the return

    try:
        got = read(ld, step)
    finally:
        resume(new, old)
    assert phase == "back", f"the worker never came back (phase {phase})"
    assert batches_served(paused, at_least=served_back + 1) > served_back
    assert_same(got, reference)  # nothing lost or repeated over the failover and return


def pause(victim: str, new: LiveServer, old: OldServer) -> None:
    """Stop one release answering: the new server's process (SIGSTOP), or the old
    release as a whole (its front, refusals included; the server behind it idles)."""
    if victim == "new":
        assert new.proc is not None
        new.proc.send_signal(signal.SIGSTOP)
    else:
        old.pause()


def resume(new: LiveServer, old: OldServer) -> None:
    if new.proc is not None:
        new.proc.send_signal(signal.SIGCONT)
    old.resume()


def batches_served(srv: LiveServer, at_least: int = 1) -> int:
    """The batches this server served all its jobs, once its snapshot shows at least
    ``at_least`` (bounded)."""
    served = 0
    for _ in range(200):
        served = sum(j["batches_served"] for j in srv.get("/v1/jobs").json())
        if served >= at_least:
            return served
        threading.Event().wait(0.05)
    return served


def test_a_client_whose_own_replica_is_old_goes_back_to_it_after_meeting_the_new_one(
    new: LiveServer, behind_old: LiveServer, old: OldServer, reference: Epoch
) -> None:
    """The old replica is silent when the client starts: it attaches to the new one with
    every new field, ring included. Its probes of its own replica carry those fields: the
    old release refuses them, and the probe must leave them out, as a hello does."""
    job = JobSpec("alpha", SEQ, BATCH, 0, 1, run="mixed-versions-home")
    options = ClientOptions(request_timeout=1.0, deadline=30.0, return_after=0.2)
    requests = [Request(pos=i * BATCH, count=1) for i in range(len(reference))]
    got: Epoch = []
    pause("old", new, old)
    try:
        with FeedClient([old.endpoint, new.zmq], job, rank=0, worker=0, options=options) as client:
            assert client.hello().ring_door  # on the new replica, with a ring
            for answer in client.stream(requests):
                if len(got) == 1:
                    resume(new, old)
                if client.replicas.returns == 0:
                    threading.Event().wait(0.01)  # a training step: the epoch outlasts it
                got.append((ids64(answer.window_ids), input_ids(answer.tokens)))
            assert client.replicas.returns == 1 and client.replicas.failovers == 1
            assert client.endpoint == old.endpoint and client.connection.ring is None
    finally:
        resume(new, old)
    assert_same(got, reference)


def input_ids(tokens: np.ndarray) -> torch.Tensor:
    """A batch's ``input_ids`` from its chunk's rows (the loader's int64, one token short)."""
    return torch.from_numpy(tokens[:, :-1].astype(np.int64))


def ids64(window_ids: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(window_ids.astype(np.int64))


# -- an old client on a new server -------------------------------------------------------------


def test_an_old_client_reads_the_epoch_from_a_new_server(new: LiveServer, reference: Epoch) -> None:
    """A client of the release before every optional hello field, on a raw socket: its
    hello names none of them, and what the new server answers names no field such a
    client could not decode. It gets the epoch, over TCP, as the new client does."""
    hello = protocol.Hello(
        dataset="alpha", seq_len=SEQ, batch_size=BATCH, seed=0, world_size=1, rank=0,
        worker=0, window=4, client="old-client",
    )  # fmt: skip
    assert not DROPPABLE.keys() & msgpack.unpackb(hello.header()).keys()
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(new.zmq)
    got: Epoch = []
    try:
        sock.send(hello.header())
        welcome = old_decode(sock)
        assert isinstance(welcome, protocol.Welcome)
        for step in range(len(reference)):
            get = protocol.Get(req=step, job=welcome.job, rank=0, pos=step * BATCH, count=1,
                               stride=1)  # fmt: skip
            sock.send(get.header())
            frames: list[zmq.Frame] = []
            chunk = old_decode(sock, frames)
            assert isinstance(chunk, protocol.Chunk) and chunk.req == step
            tokens, rows = protocol.decode_chunk(chunk, frames)
            (window_ids,) = protocol.require_rows(rows, protocol.ROW_WINDOW)
            got.append((ids64(window_ids), input_ids(tokens)))
        sock.send(protocol.Bye().header())
    finally:
        sock.close(linger=200)
    assert_same(got, reference)


def old_decode(sock: zmq.Socket[bytes], payload: list[zmq.Frame] | None = None) -> protocol.Message:
    """The next answer as a client from before rings decodes it: a field it does not
    know fails the test (the old client would refuse the message)."""
    assert sock.poll(10_000), "no answer from the new server"
    header, *rest = sock.recv_multipart(copy=False)
    fields = msgpack.unpackb(header.bytes)
    unknown = RING_ANSWER_FIELDS.get(fields["t"], set()) & fields.keys()
    assert not unknown, f"an old client could not decode a {fields['t']} with {unknown}"
    if payload is not None:
        payload.extend(rest)
    return protocol.decode_header(header.buffer)
