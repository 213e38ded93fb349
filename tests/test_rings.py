"""Shared-memory rings: the door, the ring's flow control, and the whole path.

The door and the ring are real (a Unix socket, an anonymous memory file passed with
SCM_RIGHTS, two mappings of it); the end-to-end tests run a real server process and
compare what a trainer on a ring gets with what one on TCP gets, byte for byte.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from live_server import LiveServer, tenants_toml
from old_server import OldServer
from shard_data import BYTE, random_docs
from tokenfeed import protocol
from tokenfeed.protocol import JobSpec
from tokenfeed.transport.client import ClientOptions, FeedClient, Request
from tokenfeed.transport.ring import attach, is_local_endpoint
from tokenfeed_server.dataplane.rings import HEADER_BYTES, Ring, RingDoor, Rings, open_rings
from tokenfeed_server.store import write_dataset


@pytest.fixture
def door(tmp_path: Path) -> Iterator[RingDoor]:
    opened = RingDoor(tmp_path / "door.sock").start()
    yield opened
    opened.stop()


def test_a_ring_is_handed_once_to_the_holder_of_its_key(door: RingDoor) -> None:
    ring = Ring(1 << 20)
    key = door.offer(ring, "alice-0")
    assert attach(str(door.path), "0" * 64) is None  # a guessed key
    mine = attach(str(door.path), key)
    assert mine is not None and ring.attached
    assert attach(str(door.path), key) is None  # a key works once
    assert (door.handed, door.refused) == (1, 2)
    mine.close()
    ring.close()


def test_a_ring_not_attached_is_never_written(door: RingDoor) -> None:
    ring = Ring(1 << 20)
    door.offer(ring, "x")
    assert ring.put(np.zeros((2, 8), np.uint16)) is None
    ring.close()


def test_a_door_that_does_not_know_the_proof_is_not_trusted(tmp_path: Path) -> None:
    """Someone else's socket at the door's path gets the nonce but cannot answer the
    proof: the client keeps to TCP rather than read a ring of theirs as tokens."""
    path = tmp_path / "fake.sock"
    fake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fake.bind(str(path))
    fake.listen(1)
    their_fd = os.memfd_create("theirs")
    os.ftruncate(their_fd, 1 << 20)

    def impostor() -> None:
        conn, _ = fake.accept()
        with conn:
            conn.recv(32)
            socket.send_fds(conn, [b"ok" + b"f" * 32], [their_fd])

    thread = threading.Thread(target=impostor)
    thread.start()
    assert attach(str(path), "a" * 32 + "b" * 32) is None
    thread.join(5)
    fake.close()
    os.close(their_fd)


def test_chunks_wrap_around_the_ring_and_never_overwrite_unreleased_bytes(
    door: RingDoor,
) -> None:
    ring = Ring(HEADER_BYTES + (32 << 10))
    client = attach(str(door.path), door.offer(ring, "c"))
    assert client is not None
    rng = np.random.default_rng(0)
    pending: list[tuple[np.ndarray, tuple[int, int]]] = []
    placed = refused = 0
    for i in range(400):
        tokens = rng.integers(0, 65535, size=(int(rng.integers(1, 9)), 517), dtype=np.uint16)
        where = ring.put(tokens)
        if where is None:  # full: the server would send this one over TCP
            refused += 1
        else:
            placed += 1
            pending.append((tokens, where))
        # the trainer lags behind, then catches up: every byte it reads is intact
        if len(pending) > 8 or (where is None and pending):
            want, (offset, end) = pending.pop(0)
            got = np.frombuffer(client.take(offset, end, want.nbytes), np.uint16)
            assert np.array_equal(got, want.reshape(-1)), i
    assert placed > 200 and refused > 0
    client.close()
    ring.close()


def test_borrowed_chunks_hold_their_space_until_dropped_and_release_in_ring_order(
    door: RingDoor,
) -> None:
    ring = Ring(HEADER_BYTES + (8 << 10))
    client = attach(str(door.path), door.offer(ring, "c"))
    assert client is not None
    chunks = [np.full((1, 1024), i + 1, np.uint16) for i in range(4)]  # 2 KiB each: full
    views = []
    for c in chunks:
        where = ring.put(c)
        assert where is not None
        views.append(client.borrow(where[0], where[1], c.nbytes))
    assert ring.put(chunks[0]) is None  # nothing released: TCP
    tokens = views[0].view(np.uint16)  # an array made from a view keeps it lent
    with pytest.raises(ValueError):
        tokens[0] = 7  # read-only: a consumer cannot scribble on the ring
    views[1] = None  # returned out of order: waits for the first
    assert ring.put(chunks[0]) is None
    views[0] = None
    assert ring.put(chunks[0]) is None  # `tokens` still holds the first chunk
    assert np.array_equal(tokens, chunks[0][0])  # untouched while lent
    del tokens
    where = ring.put(chunks[0])  # the first two are released together
    assert where is not None
    assert np.array_equal(views[2].view(np.uint16), chunks[2][0])  # still intact
    client.close()
    ring.close()


def test_a_trainer_claiming_more_than_was_written_loses_its_ring(door: RingDoor) -> None:
    ring = Ring(1 << 20)
    client = attach(str(door.path), door.offer(ring, "c"))
    assert client is not None
    offset, end = ring.put(np.ones((1, 8), np.uint16)) or (0, 0)
    client.take(offset, end + 10**9, 16)  # nonsense: released past what was allocated
    assert ring.put(np.ones((1, 8), np.uint16)) is None  # TCP from now on
    client.close()


def test_rings_of_forgotten_connections_are_closed(tmp_path: Path) -> None:
    rings = open_rings(str(tmp_path / "d.sock"), 1 << 20)
    try:
        door_path, key = rings.offer(b"a", "a")
        rings.offer(b"b", "b")
        assert door_path and len(key) == 64 and len(rings) == 2
        rings.sweep({b"b"})
        assert len(rings) == 1
        assert attach(door_path, key) is None  # the closed ring's offer went with it
    finally:
        rings.close()
    assert not (tmp_path / "d.sock").exists()


def test_an_automatic_door_lives_in_a_private_directory() -> None:
    rings = open_rings("auto", 1 << 20)
    try:
        assert rings.door is not None
        where = rings.door.path.parent
        assert where.stat().st_mode & 0o777 == 0o711  # others may enter, not list or add
    finally:
        rings.close()
    assert not where.exists()
    assert Rings(None, 1 << 20).offer(b"x", "x") == ("", "")


@pytest.mark.parametrize(
    ("endpoint", "local"),
    [
        ("tcp://127.0.0.1:7400", True),
        ("tcp://localhost:7400", True),
        ("ipc:///tmp/x", True),
        ("tcp://192.0.2.1:7400", False),  # TEST-NET-1: never an address of this host
        ("tcp://no-such-host.invalid:7400", False),
    ],
)
def test_a_ring_is_asked_for_only_on_this_host(endpoint: str, local: bool) -> None:
    assert is_local_endpoint(endpoint) is local


# -- the whole path ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    store = tmp_path_factory.mktemp("store")
    write_dataset(store, "alpha", random_docs(300), shuffle_seed=3, tokenizer=BYTE)
    with LiveServer(store, extra=["--ring-size", "1MiB"]) as srv:
        yield srv


def _read(server: LiveServer, *, ring: bool, batches: int = 64) -> list[np.ndarray]:
    options = ClientOptions(shared_memory=ring, window=4)
    job = JobSpec("alpha", 63, 4, 7, 1)
    with FeedClient(server.zmq, job, rank=0, worker=0, options=options) as client:
        count = client.hello().max_count
        assert bool(client.welcome and client.welcome.ring_door) is ring
        reqs = [Request(pos=i * 4, count=min(count, batches - i)) for i in range(0, batches, count)]
        return [np.array(a.tokens) for a in client.stream(reqs)]


@pytest.mark.network
def test_a_trainer_on_the_ring_gets_exactly_what_tcp_gives(server: LiveServer) -> None:
    before = server.settled_counter("ring_chunks")
    over_ring = _read(server, ring=True)
    assert server.settled_counter("ring_chunks") > before  # the ring carried them
    over_tcp = _read(server, ring=False)
    assert len(over_ring) == len(over_tcp) > 0
    for a, b in zip(over_ring, over_tcp, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.network
def test_only_connections_that_read_chunks_get_a_ring(server: LiveServer) -> None:
    # The loader's short connections (the pin before its workers start, the progress
    # report at the end) say hello and bye: a ring each would be a descriptor and a door
    # visit for nothing.
    from tokenfeed import TokenFeedDataset, TokenFeedLoader

    handed = server.settled_counter("rings_handed")
    chunks = server.settled_counter("ring_chunks")
    ds = TokenFeedDataset(
        server.zmq, "alpha", seq_len=63, batch_size=4, rank=0, world_size=1, samples=64
    )
    assert ds.options.shared_memory is None  # chosen by where the server is: here
    batches = list(TokenFeedLoader(ds, num_workers=2, report_after=0.01))
    assert len(batches) == 16
    assert server.settled_counter("ring_chunks") > chunks
    assert server.settled_counter("rings_handed") - handed == 2  # one per worker


ALICE, BOB, ADMIN = "alice-token-0123456789", "bob-token-0123456789ab", "admin-token-0123456789"


@pytest.fixture(scope="module")
def tenants_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    store = tmp_path_factory.mktemp("tenant-store")
    write_dataset(store, "alpha", random_docs(200), shuffle_seed=3, tokenizer=BYTE)
    tenants = store / "tenants.toml"
    tenants.write_text(tenants_toml(ADMIN, {"alice": (ALICE, ["alpha"]), "bob": (BOB, ["alpha"])}))
    extra = ["--tenants", str(tenants), "--peer-timeout-s", "1"]
    with LiveServer(store, extra=extra) as srv:
        yield srv


def _open_rings(server: LiveServer) -> int:
    status = server.get("/v1/status", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    return int(status["rings"])


@pytest.mark.network
def test_one_tenant_cannot_take_another_tenants_ring(tenants_server: LiveServer) -> None:
    """Bob knows where the door is (his own welcome says) but not alice's key: every
    nonce he tries is refused, and alice's ring keeps carrying her chunks."""
    job = JobSpec("alpha", 63, 2, 1, 1)
    alice = FeedClient(tenants_server.zmq, job, rank=0, worker=0,
                       options=ClientOptions(token=ALICE, shared_memory=True))  # fmt: skip
    bob = FeedClient(tenants_server.zmq, job, rank=0, worker=0,
                     options=ClientOptions(token=BOB, shared_memory=True))  # fmt: skip
    with alice, bob:
        door = alice.hello().ring_door
        assert door and bob.hello().ring_door == door
        assert alice.connection.ring is not None and bob.connection.ring is not None
        for _ in range(20):
            assert attach(door, os.urandom(32).hex()) is None
        got = [a.tokens for a in alice.stream([Request(pos=0, count=4)])]
        assert sum(t.shape[0] for t in got) == 8
    # the ring is an anonymous memory file: nothing of it in any file system
    assert not any("tokenfeed" in name for name in os.listdir("/dev/shm"))


@pytest.mark.network
def test_a_dead_trainers_ring_is_reclaimed(tenants_server: LiveServer, tmp_path: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(
        "import os, sys\n"
        "from tokenfeed.protocol import JobSpec\n"
        "from tokenfeed.transport.client import ClientOptions, FeedClient, Request\n"
        "c = FeedClient(sys.argv[1], JobSpec('alpha', 63, 2, 9, 1), rank=0, worker=0,\n"
        "               options=ClientOptions(token=sys.argv[2], shared_memory=True))\n"
        "c.hello()\n"
        "assert c.connection.ring is not None\n"
        "list(c.stream([Request(pos=0, count=2)]))\n"
        "print('read', flush=True)\n"
        "os._exit(0)  # killed: no bye, no close\n"
    )
    before = _open_rings(tenants_server)
    done = subprocess.run(
        [sys.executable, str(script), tenants_server.zmq, ALICE],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.stdout.strip() == "read", done.stderr
    for _ in range(100):  # the server forgets the peer after --peer-timeout-s 1
        if _open_rings(tenants_server) <= before:
            break
        time.sleep(0.1)
    assert _open_rings(tenants_server) <= before


def test_a_new_client_on_an_old_server_leaves_the_ring_out() -> None:
    old = OldServer({"ring"})
    try:
        options = ClientOptions(request_timeout=2.0, deadline=10.0)
        with FeedClient(old.endpoint, JobSpec("alpha", 16, 4, 5, 1), rank=0, worker=0,
                        options=options) as client:  # fmt: skip
            assert client.hello().job == "0123456789abcdef"
            client.hello()  # a reconnect: not refused again
            assert client.connection.ring is None
    finally:
        old.close()
    assert old.hellos[0]["ring"] is True and all("ring" not in h for h in old.hellos[1:])
    assert len(old.hellos) == 3


@pytest.mark.network
def test_an_old_client_gets_every_chunk_over_tcp(server: LiveServer) -> None:
    """A hello without ``ring`` (every client from before rings): no ring offered,
    tokens in the chunk's frame as always."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.zmq)
    try:
        hello = protocol.Hello(
            dataset="alpha", seq_len=63, batch_size=4, seed=7, world_size=1, rank=0,
            worker=0, window=4, client="old-client",
        )  # fmt: skip
        sock.send(hello.header())
        assert sock.poll(10_000)
        welcome = protocol.decode_header(sock.recv())
        assert isinstance(welcome, protocol.Welcome) and not welcome.ring_door
        sock.send(protocol.Get(req=0, job=welcome.job, rank=0, pos=0, count=1, stride=1).header())
        assert sock.poll(10_000)
        frames = sock.recv_multipart()
        chunk = protocol.decode_header(frames[0])
        assert isinstance(chunk, protocol.Chunk) and chunk.ring_offset == 0
        assert len(frames[1]) == 4 * 64 * 2 and b"ring" not in frames[0]
    finally:
        sock.close(0)
