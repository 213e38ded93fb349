"""A stand-in for a server from an older release, for mixed-version tests.

A ROUTER socket on loopback that answers ``hello`` as such a server did: a hello holding
any of the fields the old release did not know is refused in its decoder's words
("hello: unexpected fields [...]; the peer speaks a newer protocol ..."), any other is
welcomed. It keeps every hello (raw and decoded) and answers nothing else (a test only
says hello to it, and bye).
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import Any

import msgpack
import zmq

from tokenfeed import protocol

WELCOME = protocol.Welcome(
    server="old", job="0123456789abcdef", fingerprint="f" * 32, n_tokens=4000,
    n_windows=249, dtype="uint16", window=4, max_count=8, eos_id=256,
)  # fmt: skip


def refusal(fields: Collection[str]) -> str:
    """The words of an old server's decoder refusing ``fields``."""
    return (
        f"hello: unexpected fields {sorted(fields)}; the peer speaks a newer protocol than "
        "this end: install matching versions of tokenfeed and tokenfeed-server"
    )


class OldServer:
    """A server that does not know the hello fields ``unknown``."""

    def __init__(self, unknown: Collection[str]) -> None:
        self.unknown = frozenset(unknown)
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        #: every hello received, as sent, and decoded
        self.frames: list[bytes] = []
        self.hellos: list[dict[str, Any]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._done.is_set():
            if not self.sock.poll(50):
                continue
            ident, frame = self.sock.recv_multipart()
            fields = msgpack.unpackb(frame)
            if fields["t"] != "hello":  # a closing client's bye: no answer
                continue
            self.frames.append(frame)
            self.hellos.append(fields)
            extra = self.unknown.intersection(fields)
            answer: protocol.Message = WELCOME
            if extra:
                answer = protocol.Err(
                    code="bad_request", message=refusal(extra), retry=False, req=-1
                )
            self.sock.send_multipart([ident, answer.header()])

    def close(self) -> None:
        """Stop answering and close the socket."""
        self._done.set()
        self._thread.join(timeout=5)
        self.sock.close(linger=0)
