"""The trainer's end of the wire: one DEALER socket per process, credits, retries.

:class:`FeedClient` attaches to a job with ``hello``, then turns a stream of requests
into a stream of chunks, in request order, keeping at most ``window`` requests in flight
(credit-based flow control: the server never sends unasked, so memory on both ends is
bounded by window x chunk).

Liveness follows the ZeroMQ guide's Lazy Pirate pattern: when nothing arrives for
``request_timeout`` seconds, the client closes its socket, opens a new one, says hello
again and re-sends every request still outstanding. Requests are pure functions of their
fields, so re-sending loses and duplicates nothing, even if the server restarted. When no
progress is made for ``deadline`` seconds the client raises
:class:`~tokenfeed.errors.ServerUnavailable` naming the endpoint.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import os
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from tokenfeed import protocol
from tokenfeed.errors import (
    AuthenticationFailed,
    DatasetChanged,
    ProtocolError,
    ServerError,
    ServerUnavailable,
)
from tokenfeed.protocol import JobSpec

log = logging.getLogger(__name__)

_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


@dataclass(frozen=True)
class Request:
    """``count`` global batches at stream positions ``pos + i * stride * G``."""

    pos: int
    count: int
    stride: int = 1


@dataclass(frozen=True)
class Chunk:
    """One answered request: rank rows ``[count * B, L + 1]`` with their provenance."""

    request: Request
    tokens: np.ndarray
    window_ids: np.ndarray
    epochs: np.ndarray


@dataclass(frozen=True)
class ClientOptions:
    """Timeouts, window and credentials of a client; one object, passed down."""

    window: int = 4
    #: ask for chunks of about this size (the server may cap it lower)
    chunk_bytes: int = 1 << 20
    request_timeout: float = 10.0
    deadline: float = 120.0
    token: str | None = None
    server_public_key: str | None = None


def curve_keypair_from_token(token: str) -> tuple[bytes, bytes]:
    """The CURVE (public, secret) key pair, Z85-encoded, that a token implies.

    Deriving the pair from the token lets one secret do both jobs under CURVE: the
    server knows each tenant's public key from its token and identifies the tenant in the
    handshake, while the token itself never crosses the wire.
    """
    seed = hashlib.blake2b(token.encode(), digest_size=32, person=b"tokenfeed-curve").digest()
    secret = z85.encode(seed)
    return zmq.curve_public(secret), secret


class FeedClient:
    """A connection to a tokenfeed server for one rank and one worker of a job."""

    def __init__(
        self,
        endpoint: str,
        job: JobSpec,
        *,
        rank: int,
        worker: int,
        options: ClientOptions | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.job = job
        self.rank = rank
        self.worker = worker
        self.options = options or ClientOptions()
        self.welcome: protocol.Welcome | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = None
        self._payload: list[Any] = []
        self._monitor: zmq.Socket[bytes] | None = None
        self._poller = zmq.Poller()
        # one id sequence per client: a late answer to an abandoned stream never matches
        self._ids = itertools.count()
        # Unique per client object and kept across reconnects: the server replaces the
        # connection it knew under this name instead of counting a new one.
        self._name = f"{socket.gethostname()}:{os.getpid()}:r{rank}w{worker}:{id(self):x}"

    # -- connection ------------------------------------------------------------------

    def _open(self) -> zmq.Socket[bytes]:
        self._close_socket()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
        token = self.options.token
        if self.options.server_public_key is not None:
            public, secret = curve_keypair_from_token(token) if token else zmq.curve_keypair()
            sock.curve_serverkey = self.options.server_public_key.encode()
            sock.curve_publickey = public
            sock.curve_secretkey = secret
        elif token is not None:
            sock.plain_username = b"tokenfeed"  # the token alone names the tenant
            sock.plain_password = token.encode()
        # Handshake failures (wrong token, missing token) are invisible on the socket
        # itself: libzmq just retries. The monitor reports them so we can fail at once.
        self._monitor = sock.get_monitor_socket(_HANDSHAKE_FAILURES)
        sock.connect(self.endpoint)
        self._sock = sock
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        return sock

    def _close_socket(self, *, bye: bool = False) -> None:
        if self._sock is not None:
            self._sock.disable_monitor()
            linger = 0
            if bye and self.welcome is not None:
                # Frees our connection slot on the server now rather than at its timeout.
                self._sock.send(protocol.Bye().header(), zmq.NOBLOCK)
                linger = 200
            self._sock.close(linger=linger)
            self._sock = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None

    def _check_handshake(self) -> None:
        mon = self._monitor
        while mon is not None and mon.poll(0):
            event = recv_monitor_message(mon)["event"]
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise AuthenticationFailed(
                    f"the server at {self.endpoint} refused the token; check token= or "
                    "TOKENFEED_TOKEN against what the operator gave you"
                )
            if event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                raise AuthenticationFailed(
                    f"handshake with {self.endpoint} failed: the server and this client "
                    "disagree on security (the server may need a token (token= or "
                    "TOKENFEED_TOKEN) or a CURVE key (server_public_key=), or not accept one)"
                )

    def close(self) -> None:
        """Say bye, close the socket and the context; the client can not be used afterwards."""
        try:
            self._close_socket(bye=True)
        except zmq.ZMQError:
            self._close_socket()
        self._ctx.term()

    def __enter__(self) -> FeedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def hello(self, deadline_at: float | None = None) -> protocol.Welcome:
        """Attach to the job, retrying with fresh sockets until the deadline."""
        opts = self.options
        deadline_at = deadline_at or time.monotonic() + opts.deadline
        hello = protocol.Hello(
            dataset=self.job.dataset,
            seq_len=self.job.seq_len,
            batch_size=self.job.batch_size,
            seed=self.job.seed,
            world_size=self.job.world_size,
            rank=self.rank,
            worker=self.worker,
            window=opts.window,
            client=self._name,
        )
        wait = min(1.0, opts.request_timeout)
        while True:
            sock = self._open()
            sock.send(hello.header())
            msg = self._recv(sock, min(wait, max(0.0, deadline_at - time.monotonic())))
            if isinstance(msg, protocol.Welcome):
                return self._accept(msg)
            if isinstance(msg, protocol.Err) and not msg.retry:
                raise self._error(msg)
            if time.monotonic() >= deadline_at:
                self._close_socket()
                raise ServerUnavailable(
                    f"no answer from tokenfeed server at {self.endpoint} within "
                    f"{opts.deadline:.0f}s; check that it runs and that its /readyz says "
                    "ready, and that the endpoint and port are right"
                )
            wait = min(wait * 2, opts.request_timeout)

    def _accept(self, welcome: protocol.Welcome) -> protocol.Welcome:
        if self.welcome is not None and welcome.fingerprint != self.welcome.fingerprint:
            raise DatasetChanged(
                f"dataset {self.job.dataset!r} on {self.endpoint} was replaced while this "
                "job was reading it; resuming would mix two datasets. Start a new run (or "
                "restore the old dataset)"
            )
        if welcome.dtype not in protocol.DTYPES:
            raise ProtocolError(f"server announced unknown dtype {welcome.dtype!r}")
        self.welcome = welcome
        return welcome

    def _recv(self, sock: zmq.Socket[bytes], timeout: float) -> protocol.Message | None:
        """One message, or None after ``timeout`` seconds; chunk payloads ride along."""
        end = time.monotonic() + timeout
        while True:
            ready = dict(self._poller.poll(max(0, int((end - time.monotonic()) * 1000))))
            self._check_handshake()
            if sock in ready:
                break
            if time.monotonic() >= end:
                return None
        frames = sock.recv_multipart(copy=False)
        msg = protocol.decode_header(frames[0].buffer)
        if isinstance(msg, protocol.Chunk):
            self._payload = frames[1:]
        return msg

    def _error(self, err: protocol.Err) -> ServerError:
        return ServerError.from_code(
            err.code, f"{err.message} (server {self.endpoint})", retry=err.retry
        )

    # -- data ------------------------------------------------------------------------

    def stream(self, requests: Iterable[Request]) -> Iterator[Chunk]:
        """Chunks for ``requests``, in order, with at most ``window`` in flight.

        After a reconnect the server may have other limits (an operator restarted it with
        new settings): the window is taken from the new ``welcome`` and requests larger
        than its ``max_count`` are split, so the stream carries on unchanged.
        """
        if self.welcome is None or self._sock is None:
            self.hello()
        todo = iter(requests)
        leftover: collections.deque[Request] = collections.deque()  # pieces not yet asked
        ids = self._ids
        pending: collections.OrderedDict[int, Request] = collections.OrderedDict()
        sent: set[int] = set()  # asked on the current socket, not yet answered
        done: dict[int, Chunk] = {}
        exhausted = False
        last_progress = time.monotonic()
        while True:
            assert self.welcome is not None
            window = min(self.options.window, self.welcome.window)
            for rid, req in pending.items():  # re-ask what a reconnect left unanswered
                if len(sent) >= window:
                    break
                if rid not in sent and rid not in done:
                    self._send_get(rid, req)
                    sent.add(rid)
            # New requests only while fewer than `window` are unyielded: answers that wait
            # behind a slow head of line count too, so memory stays window x chunk.
            while len(pending) < window and not (exhausted and not leftover):
                if not leftover:
                    taken = next(todo, None)
                    if taken is None:
                        exhausted = True
                        continue
                    leftover.append(taken)
                # cut with the limit in force now (a restarted server may have a smaller one)
                new, *rest = self._split(leftover.popleft())
                leftover.extendleft(reversed(rest))
                rid = next(ids)
                pending[rid] = new
                self._send_get(rid, new)
                sent.add(rid)
            if not pending:
                return
            head = next(iter(pending))
            if head in done:
                pending.pop(head)
                yield done.pop(head)
                last_progress = time.monotonic()
                continue
            sock = self._sock
            assert sock is not None
            msg = self._recv(sock, self.options.request_timeout)
            if isinstance(msg, protocol.Chunk):
                if msg.req in sent:
                    sent.discard(msg.req)
                    done[msg.req] = self._chunk(pending[msg.req], msg)
                continue  # a stale answer (already received) is dropped: no duplicates
            if isinstance(msg, protocol.Err) and not msg.retry and msg.code != "unknown_job":
                raise self._error(msg)
            if isinstance(msg, protocol.Pong):
                continue
            # Silence, or a retryable refusal (restarted server, overload): Lazy Pirate.
            if time.monotonic() - last_progress > self.options.deadline:
                raise ServerUnavailable(
                    f"no data from tokenfeed server at {self.endpoint} for "
                    f"{self.options.deadline:.0f}s; check that it runs (GET /readyz)"
                )
            if msg is None:
                log.warning(
                    "no answer from %s in %.1fs: reconnecting",
                    self.endpoint,
                    self.options.request_timeout,
                )
            else:
                time.sleep(0.05)
            self.hello(deadline_at=last_progress + self.options.deadline)
            sent.clear()
            pending = self._fit(pending, done, ids)

    def _fit(
        self,
        pending: collections.OrderedDict[int, Request],
        done: dict[int, Chunk],
        ids: Iterator[int],
    ) -> collections.OrderedDict[int, Request]:
        """``pending`` with every unanswered request cut to the server's ``max_count``."""
        fitted: collections.OrderedDict[int, Request] = collections.OrderedDict()
        for rid, req in pending.items():
            pieces = [req] if rid in done else self._split(req)
            if len(pieces) == 1:
                fitted[rid] = req
            else:
                fitted.update((next(ids), piece) for piece in pieces)
        return fitted

    def _split(self, req: Request) -> list[Request]:
        """``req`` as requests of at most the server's ``max_count`` batches each."""
        assert self.welcome is not None
        limit = self.welcome.max_count
        if req.count <= limit:
            return [req]
        step = req.stride * self.job.batch_size * self.job.world_size
        return [
            Request(req.pos + first * step, min(limit, req.count - first), req.stride)
            for first in range(0, req.count, limit)
        ]

    def _send_get(self, rid: int, req: Request) -> None:
        assert self._sock is not None and self.welcome is not None
        get = protocol.Get(
            req=rid,
            job=self.welcome.job,
            rank=self.rank,
            pos=req.pos,
            count=req.count,
            stride=req.stride,
        )
        self._sock.send(get.header())

    def _chunk(self, req: Request, header: protocol.Chunk) -> Chunk:
        tokens, window_ids, epochs = protocol.decode_chunk(header, self._payload)
        self._payload = []
        rows = req.count * self.job.batch_size
        if tokens.shape != (rows, self.job.seq_len + 1):
            raise ProtocolError(
                f"chunk for {req} has shape {tokens.shape}, expected "
                f"({rows}, {self.job.seq_len + 1})"
            )
        return Chunk(req, tokens, window_ids, epochs)


def pack_requests(
    steps: Iterable[int], start: int, global_batch: int, max_count: int
) -> Iterator[Request]:
    """Group local steps into requests: arithmetic runs of at most ``max_count`` steps.

    A worker's steps are evenly spaced (every K-th step with K workers), so a run of them
    is one request with ``stride = K``; a chunk then carries several batches and the
    per-message cost is paid once for all of them.
    """
    run: list[int] = []
    for step in steps:
        if run and (len(run) == max_count or (len(run) >= 2 and step - run[-1] != run[1] - run[0])):
            yield _request(run, start, global_batch)
            run = []
        run.append(step)
    if run:
        yield _request(run, start, global_batch)


def _request(run: list[int], start: int, global_batch: int) -> Request:
    stride = run[1] - run[0] if len(run) > 1 else 1
    return Request(pos=start + run[0] * global_batch, count=len(run), stride=stride)
