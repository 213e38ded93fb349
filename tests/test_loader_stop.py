"""A loop left while the server is silent stops its receiver thread for real.

The receiver of ``TokenFeedLoader(num_workers=0)`` waits for the server in the client
(a ``recv`` of up to ``request_timeout``, then failover hellos up to the deadline). A
``break`` then must not leave it running with its context and sockets beside the next
``iter()``: its waits check the loader's stop event, and ``close`` joins it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from tokenfeed import TokenFeedDataset, TokenFeedLoader, protocol

pytestmark = pytest.mark.network

SEQ, BATCH = 16, 2


@pytest.fixture
def answers_once() -> Iterator[str]:
    """A real ROUTER that welcomes every hello and answers only the first ``get``: after
    that the server is silent, as one that hangs or dies behind a live connection."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    welcome = protocol.Welcome(
        server="fake",
        job="j1",
        fingerprint="f" * 32,
        n_tokens=10_000,
        n_windows=100,
        dtype="uint16",
        window=4,
        max_count=1,
        eos_id=256,
    )
    done = threading.Event()

    def serve() -> None:
        answered = False
        while not done.is_set():
            if not router.poll(50):
                continue
            ident, header = router.recv_multipart()
            msg = protocol.decode_header(header)
            if isinstance(msg, protocol.Hello):
                router.send_multipart([ident, welcome.header()])
            elif isinstance(msg, protocol.Get) and not answered:
                answered = True
                tokens = np.zeros((msg.count * BATCH, SEQ + 1), dtype=np.uint16)
                rows = {protocol.ROW_WINDOW: np.arange(len(tokens)), protocol.ROW_EPOCH: 0}
                router.send_multipart([ident, *protocol.chunk_frames(msg.req, tokens, rows)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        done.set()
        thread.join()
        router.close(linger=0)
        ctx.term()


def receivers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tokenfeed-receive"]


def test_break_while_the_server_is_silent_joins_the_receiver(answers_once: str) -> None:
    assert not receivers()
    ds = TokenFeedDataset(
        answers_once,
        "alpha",
        seq_len=SEQ,
        batch_size=BATCH,
        rank=0,
        world_size=1,
        window=1,
        chunk_bytes=1,  # one batch per request: the second request is never answered
        request_timeout=10.0,
        deadline=120.0,
    )
    loader = TokenFeedLoader(ds, num_workers=0, pin_memory=False, report_after=None)
    batches = iter(loader)
    batch = next(batches)  # the only answer: the receiver now waits on the silent server
    assert batch["input_ids"].shape == (BATCH, SEQ)
    (receiver,) = receivers()
    batches.close()  # what a `break` does once the loop lets go of the iterator
    assert not receiver.is_alive()
