"""A stand-in for a server from an older release, for mixed-version tests.

A ROUTER socket on loopback that answers ``hello`` as such a server did: a hello holding
any of the fields the old release did not know is refused in its decoder's words
("hello: unexpected fields [...]; the peer speaks a newer protocol ..."), any other is
welcomed. It keeps every hello (raw and decoded).

Alone, it answers nothing else (a test only says hello to it, and bye). Given a
``backend`` (a real server's data endpoint) it is that old release serving real data:
every message it does not refuse goes to the backend on a DEALER socket of the client's
own (so the backend sees one connection per client socket, as it would the clients
themselves) and every answer comes back to that client. The backend never sees a field
the old release did not know, so it serves exactly what that release served: no ring
offered, no run id, every chunk over TCP.

While paused (:meth:`pause`) it reads and answers nothing (a stopped process: what is
sent to it waits in the queues).
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
    """A server that does not know the hello fields ``unknown``; with ``backend``, one
    that serves that backend's data as the old release would."""

    def __init__(self, unknown: Collection[str], backend: str | None = None) -> None:
        self.unknown = frozenset(unknown)
        self.backend = backend
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        #: every hello received, as sent, and decoded
        self.frames: list[bytes] = []
        self.hellos: list[dict[str, Any]] = []
        #: hellos refused for a field the old release did not know
        self.refused = 0
        # client socket identity <-> its own socket to the backend (used on _thread only)
        self._to_backend: dict[bytes, zmq.Socket[bytes]] = {}
        self._client_of: dict[zmq.Socket[bytes], bytes] = {}
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._pause = threading.Event()
        self._paused = threading.Event()  # the thread saw the pause: nothing more goes out
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while not self._done.is_set():
                if self._pause.is_set():
                    self._paused.set()
                    self._done.wait(0.01)
                    continue
                self._paused.clear()
                for sock, _ in self._poller.poll(50):
                    if sock is self.sock:
                        self._from_client(*self.sock.recv_multipart())
                    else:
                        self.sock.send_multipart([self._client_of[sock], *sock.recv_multipart()])
        finally:
            for backend in self._to_backend.values():
                backend.close(linger=0)

    def _from_client(self, ident: bytes, frame: bytes, *rest: bytes) -> None:
        try:
            fields = msgpack.unpackb(frame)
        except ValueError:  # not msgpack: the backend answers it, if there is one
            fields = {}
        kind = fields.get("t") if isinstance(fields, dict) else None
        if kind == "hello":
            self.frames.append(frame)
            self.hellos.append(fields)
            extra = self.unknown.intersection(fields)
            if extra:
                self.refused += 1
                err = protocol.Err(code="bad_request", message=refusal(extra), retry=False, req=-1)
                self.sock.send_multipart([ident, err.header()])
                return
            if self.backend is None:
                self.sock.send_multipart([ident, WELCOME.header()])
                return
            if ident not in self._to_backend:
                self._connect(ident, self.backend)
        backend = self._to_backend.get(ident)
        if backend is None:  # alone, or a socket that never said hello: no answer
            return
        backend.send_multipart([frame, *rest])
        if kind == "bye":  # the client socket is done: so is its backend socket
            del self._to_backend[ident], self._client_of[backend]
            self._poller.unregister(backend)
            backend.close(linger=1000)  # the bye still reaches the backend

    def _connect(self, ident: bytes, endpoint: str) -> None:
        backend: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        backend.setsockopt(zmq.LINGER, 0)
        backend.connect(endpoint)
        self._to_backend[ident], self._client_of[backend] = backend, ident
        self._poller.register(backend, zmq.POLLIN)

    def pause(self) -> None:
        """Answer nothing from now on, from either side, until :meth:`resume`."""
        self._pause.set()
        if not self._paused.wait(5):
            raise AssertionError("the old server did not pause within 5 s")

    def resume(self) -> None:
        """Read and answer again, starting with what waited meanwhile."""
        self._pause.clear()

    def close(self) -> None:
        """Stop answering and close the sockets."""
        self._done.set()
        self._thread.join(timeout=5)
        self.sock.close(linger=0)
