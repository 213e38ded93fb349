"""The trainer's end of the wire: one DEALER socket per process, credits, retries.

:class:`FeedClient` attaches to a job with ``hello``, then turns a stream of requests
into a stream of :class:`Answer` objects, in request order, keeping at most ``window``
requests in flight (credit-based flow control: the server never sends unasked, so memory
on both ends is bounded by window x chunk). The bookkeeping of that window (what to ask,
what to re-ask, cutting requests to the server's limit) lives without a socket in
:mod:`tokenfeed.window`; this module moves the messages.

Liveness follows the ZeroMQ guide's Lazy Pirate pattern: when nothing arrives for
``request_timeout`` seconds, the client closes its socket, opens a new one, says hello
again and re-sends every request still outstanding. Requests are pure functions of their
fields, so re-sending loses and duplicates nothing, even if the server restarted. With
several replicas (:mod:`tokenfeed.replicas`) the new socket goes to the next replica:
any server over the same store answers any request identically. A
retryable refusal (a server at its job or connection cap, overload) is retried after an
exponential backoff with jitter (:mod:`tokenfeed.retry`), never at once. After
``warn_after`` seconds without an answer the client logs a warning on the ``tokenfeed``
logger; when no progress is made for ``deadline`` seconds it raises the last refusal
(e.g. :class:`~tokenfeed.errors.ConnectionLimit`) or
:class:`~tokenfeed.errors.ServerUnavailable` naming every endpoint.

The client checks what the server says: a ``welcome`` with impossible values raises
:class:`~tokenfeed.errors.ProtocolError`, and a dataset build other than the expected one
(``fingerprint``: from a checkpoint, or the first ``welcome``) raises
:class:`~tokenfeed.errors.DatasetChanged`. For a mixture the builds are pinned per source
(``source_fingerprints``): the error names the source that changed, and a source a new
schedule adds is pinned at its first ``welcome``.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from tokenfeed import protocol
from tokenfeed.errors import (
    AuthenticationFailed,
    ConfigError,
    DatasetChanged,
    ProtocolError,
    ServerError,
    ServerUnavailable,
)
from tokenfeed.protocol import JobSpec
from tokenfeed.replicas import Replicas
from tokenfeed.retry import Backoff
from tokenfeed.window import Request, RequestWindow, pack_requests

__all__ = [
    "Answer",
    "ClientOptions",
    "FeedClient",
    "Request",
    "Stopped",
    "curve_keypair_from_token",
    "pack_requests",
]

# One logger for the whole client package, so one line of logging config reaches it all.
log = logging.getLogger("tokenfeed")

_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)

# How often a wait checks the owner's stop event: a stopped client lets go within this.
_STOP_SLICE = 0.1


class Stopped(Exception):
    """The owner of the client set its ``stop`` event: a wait gave up (not an error)."""

    def __init__(self) -> None:
        super().__init__("the client was stopped by its owner")


@dataclass(frozen=True)
class Answer:
    """The rows that answer one :class:`Request`: this rank's ``[count * B, L + 1]``
    tokens with their provenance (global window index and epoch of each row)."""

    request: Request
    tokens: np.ndarray
    window_ids: np.ndarray
    epochs: np.ndarray
    #: for a mixture, each row's source (an index into the job's ``sources``); else None
    sources: np.ndarray | None = None


@dataclass(frozen=True)
class ClientOptions:
    """Timeouts, window and credentials of a client; one object, passed down."""

    window: int = 4
    #: ask for chunks of about this size (the server may cap it lower)
    chunk_bytes: int = 1 << 20
    request_timeout: float = 10.0
    deadline: float = 120.0
    #: log a warning after this many seconds without an answer (then keep trying)
    warn_after: float = 5.0
    token: str | None = field(default=None, repr=False)  # a secret: never in a repr or log
    server_public_key: str | None = None

    def __post_init__(self) -> None:
        for name, low in (("window", 1), ("chunk_bytes", 1)):
            value = getattr(self, name)
            if type(value) is not int or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        for name in ("request_timeout", "deadline", "warn_after"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"{name} must be a number of seconds > 0, got {value!r}")


def curve_keypair_from_token(token: str) -> tuple[bytes, bytes]:
    """The CURVE (public, secret) key pair, Z85-encoded, that a token implies.

    Deriving the pair from the token lets one secret do both jobs under CURVE: the
    server knows each tenant's public key from its token and identifies the tenant in the
    handshake, while the token itself never crosses the wire.
    """
    seed = hashlib.blake2b(token.encode(), digest_size=32, person=b"tokenfeed-curve").digest()
    secret = z85.encode(seed)
    return zmq.curve_public(secret), secret


# Handshakes cut in a row, per replica, that count as a verdict on security (see hello).
_CUTS_PER_REPLICA = 3

# What a handshake that failed on security means, and what to check.
_DISAGREE = (
    "the server and this client disagree on security (the server may need a token "
    "(token= or TOKENFEED_TOKEN) or a CURVE key (server_public_key=), or not accept one)"
)

Received = tuple[protocol.Message, list[Any]]
"""A decoded header and the payload frames that came with it (empty but for chunks)."""


class FeedClient:
    """A connection to a tokenfeed server for one rank and one worker of a job.

    Args:
        endpoint: ``tcp://host:port``, or several replicas as a list, a comma-separated
            string or a name with several addresses (checked here: a malformed one
            raises ConfigError).
        job: the plan inputs every rank and worker of the run sends.
        rank, worker: who this client is within the job.
        num_workers: workers per rank, to start the job's clients evenly over the
            replicas (the first replica tried is ``rank * num_workers + worker`` mod n).
        slot: start at this replica instead (0: the first, the one every rank asks to
            pin the dataset build).
        options: timeouts, window and credentials.
        fingerprint: the dataset build this client must read (from a checkpoint), or
            None to take the build of the first ``welcome``; a server with another build
            is refused with :class:`~tokenfeed.errors.DatasetChanged`. Not used for a
            mixture (its combined build changes when a later segment adds a source).
        source_fingerprints: for a mixture, the build each source must be (name to
            fingerprint; sources not named are pinned at the first ``welcome``).
        consumed: returns the trainer's consumed stream position, put on every ``get``
            and on the ``bye`` (see :mod:`tokenfeed.consumed`); None: not known.
        stop: when set (by another thread), every wait of ``hello`` and ``stream``
            gives up within a tenth of a second by raising :class:`Stopped`, so a
            receiver thread can be stopped while the server is gone.
    """

    def __init__(
        self,
        endpoint: str | Sequence[str],
        job: JobSpec,
        *,
        rank: int,
        worker: int,
        num_workers: int = 1,
        slot: int | None = None,
        options: ClientOptions | None = None,
        fingerprint: str | None = None,
        source_fingerprints: Mapping[str, str] | None = None,
        consumed: Callable[[], int] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        # Checked before any socket exists: nothing to clean up when it is wrong.
        spread = rank * num_workers + worker
        self.replicas = Replicas(endpoint, slot=spread if slot is None else slot)
        #: the address in use (the first endpoint until the first connect)
        self.endpoint = self.replicas.endpoints[0]
        self.job = job
        self.rank = rank
        self.worker = worker
        self.options = options or ClientOptions()
        self.welcome: protocol.Welcome | None = None
        #: True for a mixture job (builds are pinned per source, not as one)
        self.mixture = bool(job.sources)
        #: the dataset build this client reads; None until the first welcome
        self.fingerprint = None if self.mixture else fingerprint or None
        self._fingerprint_given = self.fingerprint is not None
        #: a mixture's build per source name: given (from a checkpoint), then every
        #: source's build from the first welcome
        self.source_fingerprints: dict[str, str] = dict(source_fingerprints or {})
        self._sources_given = frozenset(self.source_fingerprints)
        self._consumed = consumed
        self._stop = stop
        # Set by _check_handshake when the connection in use closed during the handshake
        # for a reason that is not a verdict on our credentials (see there).
        self._handshake_broken = False
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._poller = zmq.Poller()
        # one id sequence per client: a late answer to an abandoned stream never matches
        self._ids = itertools.count()
        # Unique per client object and kept across reconnects: the server replaces the
        # connection it knew under this name instead of counting a new one.
        self._name = f"{socket.gethostname()}:{os.getpid()}:r{rank}w{worker}:{id(self):x}"

    # -- connection ------------------------------------------------------------------

    def _open(self, address: str) -> zmq.Socket[bytes]:
        self._close_socket()
        self.endpoint = address
        self._handshake_broken = False
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Held in self at once: whatever fails below, _close_socket (and close) sees it,
        # so the context never waits on a socket nobody will close.
        self._sock = sock
        if address.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)  # off by default in libzmq: no IPv6 connects
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
        try:
            sock.connect(self.endpoint)
        except zmq.ZMQError as exc:
            self._close_socket()
            raise ConfigError(
                f"can not connect to endpoint {self.endpoint!r}: {exc.strerror}; expected "
                "tcp://host:port with a host this machine can resolve"
            ) from None
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        return sock

    def _close_socket(self, *, bye: bool = False) -> None:
        sock, monitor = self._sock, self._monitor
        self._sock = self._monitor = None
        try:
            if sock is not None:
                linger = 0
                if bye and self.welcome is not None:
                    # Frees our connection slot on the server now rather than at its timeout.
                    last = protocol.Bye(consumed=self._consumed_position())
                    sock.send(last.header(), zmq.NOBLOCK)
                    linger = 200
                sock.disable_monitor()
                sock.close(linger=linger)
        finally:
            if sock is not None and not sock.closed:
                sock.close(linger=0)
            if monitor is not None:
                monitor.close(linger=0)

    def _check_handshake(self) -> None:
        """Raise on a verdict about our credentials; note any other failed handshake.

        Only two events are verdicts: the server refused the token (AUTH), or a ZMTP
        peer announced another security mechanism (PROTOCOL with MECHANISM_MISMATCH).
        libzmq reports NO_DETAIL (and other PROTOCOL errors) whenever the connection
        closes before the greeting: a replica shutting down, or an ``ssh -L``,
        ``kubectl port-forward`` or L4 balancer that accepts for a dead server. That is
        a failed attempt like silence; :meth:`hello` moves on and decides at its deadline.
        """
        mon = self._monitor
        while mon is not None and mon.poll(0):
            message = recv_monitor_message(mon)
            event, value = message["event"], message["value"]
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise AuthenticationFailed(
                    f"the server at {self.endpoint} refused the token; check token= or "
                    "TOKENFEED_TOKEN against what the operator gave you"
                )
            if (
                event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
            ):
                raise AuthenticationFailed(f"handshake with {self.endpoint} failed: {_DISAGREE}")
            self._handshake_broken = True

    def close(self) -> None:
        """Say bye, close the socket and the context; the client can not be used afterwards."""
        try:
            self._close_socket(bye=True)
        except zmq.ZMQError:
            pass  # the bye is a courtesy; the socket is closed either way
        finally:
            self._ctx.term()

    def __enter__(self) -> FeedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def hello(
        self, deadline_at: float | None = None, *, failover: bool = False
    ) -> protocol.Welcome:
        """Attach to the job, retrying with fresh sockets until the deadline.

        Every attempt resolves the replicas again. The first goes to this client's
        replica (the next one with ``failover``: the one in use went silent), every
        later one to the next replica. A retryable refusal is retried after a backoff
        (never at once); silence is retried with a growing wait for the answer. Past
        ``warn_after`` seconds without an answer a warning is logged; at the deadline the
        last refusal is raised (e.g. :class:`~tokenfeed.errors.ConnectionLimit`), or
        ServerUnavailable naming every replica if nothing answered at all.
        """
        opts = self.options
        started = time.monotonic()
        deadline_at = deadline_at or started + opts.deadline
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
            fingerprint=self.fingerprint or "",
            sources=self.job.sources,
            schedule=self.job.schedule,
            fingerprints=tuple(self.source_fingerprints.get(s, "") for s in self.job.sources),
            shuffle=self.job.shuffle,
            region_windows=self.job.region_windows,
            block_regions=self.job.block_regions,
        )
        wait = min(1.0, opts.request_timeout)
        backoff = Backoff(cap=min(2.0, opts.request_timeout))
        refusal: protocol.Err | None = None
        warned = False
        advance = failover
        # Attempts that reached an address, and those of them cut during the handshake:
        # when every one was cut, the deadline's error is about security, not silence.
        attempts = broken = 0
        # Cuts in a row with nothing else between: past a few per replica it is a verdict
        # (a server of another mechanism may cut before its greeting is read, so one cut
        # is no proof), and the client says so now rather than at the deadline.
        cuts_in_a_row = 0
        while True:
            address = self.replicas.pick(advance=advance)
            advance = True
            msg: protocol.Message | None = None
            cut = False
            if address is None:  # no name resolves (yet): a headless Service with no pod
                self._close_socket()
                self._sleep(min(wait, max(0.0, deadline_at - time.monotonic())))
            else:
                sock = self._open(address)
                sock.send(hello.header())
                received = self._recv(min(wait, max(0.0, deadline_at - time.monotonic())))
                msg = received[0] if received is not None else None
                cut = msg is None and self._handshake_broken
                # silence cut short by the deadline says nothing either way: not counted
                attempts += cut or msg is not None or time.monotonic() < deadline_at
                broken += cut
                cuts_in_a_row = cuts_in_a_row + 1 if cut else 0
            if isinstance(msg, protocol.Welcome):
                return self._accept(msg)
            if isinstance(msg, protocol.Err):
                if not msg.retry:
                    self._close_socket()
                    raise self._error(msg)
                refusal = msg
            elif msg is not None:
                self._close_socket()
                raise ProtocolError(
                    f"the server at {self.endpoint} answered hello with {msg.TYPE!r}"
                )
            now = time.monotonic()
            every_replica_cut = cuts_in_a_row >= _CUTS_PER_REPLICA * max(
                1, len(self.replicas.last.addresses)
            )
            if now >= deadline_at or every_replica_cut:
                self._close_socket()
                if refusal is None and attempts and (broken == attempts or every_replica_cut):
                    raise AuthenticationFailed(
                        f"every connection to {self._where()} closed during the handshake "
                        f"for {now - started:.0f}s: either {_DISAGREE}, or something in "
                        "between (ssh -L, kubectl port-forward, a load balancer) accepts "
                        "connections for a server that is down"
                    )
                raise self._gave_up(refusal, now - started)
            if refusal is None and not warned and now - started >= opts.warn_after:
                warned = True
                log.warning(
                    "no answer from %s for %.0fs; still trying until the deadline of %.0fs. "
                    "Check that it runs (GET /readyz) and that the endpoint and port are right",
                    self._where(),
                    now - started,
                    deadline_at - started,
                )
            if msg is not None or cut:  # refused, or cut at once: wait before asking again
                self._sleep(min(backoff.next(), max(0.0, deadline_at - now)))
            wait = min(wait * 2, opts.request_timeout)

    def _sleep(self, seconds: float) -> None:
        """Wait ``seconds``, or raise :class:`Stopped` as soon as the owner says stop."""
        if self._stop is None:
            time.sleep(seconds)
        elif self._stop.wait(seconds):
            raise Stopped

    def _where(self) -> str:
        """The server, or every replica with its addresses, for a message."""
        if self.replicas.several:
            return f"any tokenfeed replica ({self.replicas.describe()})"
        return f"tokenfeed server at {self.replicas.describe()}"

    def _gave_up(self, refusal: protocol.Err | None, waited: float) -> Exception:
        """The error for a deadline passed: the last refusal if any, else silence."""
        if refusal is not None:
            return ServerError.from_code(
                refusal.code,
                f"{refusal.message} (server {self.endpoint}; still refused after "
                f"{waited:.0f}s of retries with backoff)",
                retry=refusal.retry,
            )
        return ServerUnavailable(
            f"no answer from {self._where()} within {waited:.0f}s; check that it runs and "
            "that its /readyz says ready, and that the endpoint and port are right"
        )

    def _accept(self, welcome: protocol.Welcome) -> protocol.Welcome:
        self._check_welcome(welcome)
        if self.mixture:
            served = dict(zip(self.job.sources, welcome.source_fingerprints, strict=True))
            for name, expected in self.source_fingerprints.items():
                if name in served and served[name] != expected:
                    self._close_socket()
                    raise DatasetChanged(self._source_changed(name, expected, served[name]))
            self.source_fingerprints.update(served)
        elif self.fingerprint is not None and welcome.fingerprint != self.fingerprint:
            self._close_socket()
            raise DatasetChanged(self._changed(welcome.fingerprint))
        self.fingerprint = welcome.fingerprint
        self.welcome = welcome
        return welcome

    def _source_changed(self, name: str, expected: str, served: str | None) -> str:
        """What a DatasetChanged says for a mixture: which source, both builds, what to do."""
        now = f"the server has {served}" if served else "the server has another build"
        if name in self._sources_given:
            return (
                f"source {name!r} of this mixture on {self.endpoint} is not the build this "
                f"job reads (expected fingerprint {expected}, {now}): it was prepared "
                "again, and reading it would train on different data. Restore the old "
                "dataset, or start over on purpose: drop the loader state (a new run "
                "from position 0)"
            )
        return (
            f"source {name!r} of this mixture on {self.endpoint} was replaced while this "
            f"job was reading it (expected fingerprint {expected}, {now}); going on "
            "would mix two builds. Start a new run (or restore the old dataset)"
        )

    def _changed(self, served: str | None) -> str:
        """What a DatasetChanged says: which build was expected, which is served, what to do."""
        now = f"the server has {served}" if served else "the server has another build"
        replicas = (
            ", or the replicas serve different builds (every replica of a job must serve "
            "the same prepared store)"
            if self.replicas.several
            else ""
        )
        if self._fingerprint_given:
            return (
                f"dataset {self.job.dataset!r} on {self.endpoint} is not the build this "
                f"job reads (expected fingerprint {self.fingerprint}, {now}): it was "
                f"prepared again{replicas}, and reading it would train on different data. "
                "Restore the old dataset, or start over on purpose: drop the loader state "
                "(a new run from position 0)"
            )
        return (
            f"dataset {self.job.dataset!r} on {self.endpoint} was replaced while this job "
            f"was reading it{replicas} (expected fingerprint {self.fingerprint}, {now}); "
            "going on would mix two datasets. Start a new run (or restore the old dataset)"
        )

    def _check_welcome(self, welcome: protocol.Welcome) -> None:
        """Refuse values a correct server never sends (they would fail later, obscurely)."""
        problems = []
        if welcome.window < 1:
            problems.append(f"window={welcome.window} (must be >= 1)")
        if welcome.max_count < 1:
            problems.append(f"max_count={welcome.max_count} (must be >= 1)")
        if welcome.n_windows < 1:
            problems.append(f"n_windows={welcome.n_windows} (must be >= 1)")
        if welcome.n_tokens < 1:
            problems.append(f"n_tokens={welcome.n_tokens} (must be >= 1)")
        dtype = protocol.DTYPES.get(welcome.dtype)
        if dtype is None:
            problems.append(f"dtype={welcome.dtype!r} (must be one of {sorted(protocol.DTYPES)})")
        elif not 0 <= welcome.eos_id <= np.iinfo(dtype).max:
            problems.append(f"eos_id={welcome.eos_id} (outside {welcome.dtype})")
        for name in ("job", "fingerprint", "server"):
            if not getattr(welcome, name):
                problems.append(f"{name} is empty")
        if self.mixture:
            n = len(self.job.sources)
            got = welcome.source_fingerprints
            if len(got) != n or not all(got):
                problems.append(
                    f"source_fingerprints={list(got)} (must be {n} non-empty builds, one "
                    f"per source of {list(self.job.sources)})"
                )
        if self.job.shuffle == "block":
            sizes = (
                welcome.source_region_windows + welcome.source_block_regions
                if self.mixture
                else (welcome.region_windows, welcome.block_regions)
            )
            if not sizes or min(sizes) < 1:
                problems.append(
                    f"block sizes {list(sizes)} (a block shuffle needs every region_windows "
                    "and block_regions >= 1)"
                )
        if problems:
            self._close_socket()
            raise ProtocolError(
                f"the server at {self.endpoint} sent an invalid welcome: "
                f"{'; '.join(problems)}. Install matching versions of tokenfeed and "
                "tokenfeed-server, or report a server bug"
            )

    def _recv(self, timeout: float) -> Received | None:
        """One message with its payload frames, or None after ``timeout`` seconds or
        once the connection was cut during the handshake (a failed attempt)."""
        sock = self._sock
        assert sock is not None
        end = time.monotonic() + timeout
        while True:
            left = max(0.0, end - time.monotonic())
            if self._stop is not None:
                left = min(left, _STOP_SLICE)
            ready = dict(self._poller.poll(int(left * 1000)))
            self._check_handshake()
            if sock in ready:
                break
            if self._stop is not None and self._stop.is_set():
                raise Stopped
            if self._handshake_broken or time.monotonic() >= end:
                return None
        frames = sock.recv_multipart(copy=False)
        return protocol.decode_header(frames[0].buffer), frames[1:]

    def _error(self, err: protocol.Err) -> ServerError:
        if err.code == DatasetChanged.code and self.mixture and self.source_fingerprints:
            # The server names the source that changed; say what this job expects and
            # what to do about it.
            pins = ", ".join(f"{n!r}: {fp}" for n, fp in self.source_fingerprints.items())
            return DatasetChanged(
                f"{err.message} (server {self.endpoint}). A source of this mixture is not "
                f"the build this job reads (expected {{{pins}}}): restore it, or start over "
                "on purpose: drop the loader state (a new run from position 0)"
            )
        if err.code == DatasetChanged.code and self.fingerprint is not None:
            return DatasetChanged(f"{self._changed(None)} [server: {err.message}]")
        return ServerError.from_code(
            err.code, f"{err.message} (server {self.endpoint})", retry=err.retry
        )

    def _current(self) -> protocol.Welcome:
        if self.welcome is None or self._sock is None:
            return self.hello()
        return self.welcome

    # -- data ------------------------------------------------------------------------

    def stream(self, requests: Iterable[Request]) -> Iterator[Answer]:
        """Answers to ``requests``, in order, with at most ``window`` in flight.

        After a reconnect the server may have other limits (an operator restarted it with
        new settings): the window is taken from the new ``welcome`` and requests larger
        than its ``max_count`` are split, so the stream carries on unchanged.
        """
        opts = self.options
        self._current()
        flow: RequestWindow[Answer] = RequestWindow(
            requests, global_batch=self.job.batch_size * self.job.world_size, ids=self._ids
        )
        backoff = Backoff(cap=min(2.0, opts.request_timeout))
        last_progress = time.monotonic()
        while True:
            welcome = self._current()
            for rid, req in flow.to_send(min(opts.window, welcome.window), welcome.max_count):
                self._send_get(rid, req)
            if flow.finished:
                return
            answer = flow.pop_ready()
            if answer is not None:
                yield answer
                last_progress = time.monotonic()
                backoff.reset()
                continue
            received = self._recv(opts.request_timeout)
            msg = received[0] if received is not None else None
            if received is not None and isinstance(msg, protocol.Chunk):
                asked = flow.expects(msg.req)
                if asked is not None:  # else a stale answer (already received): dropped
                    flow.answer(msg.req, self._answer(asked, msg, received[1]))
                continue
            if isinstance(msg, protocol.Err):
                # unknown_job: the server restarted and forgot us; hello again (below)
                if not msg.retry and msg.code != "unknown_job":
                    raise self._error(msg)
            elif msg is not None:
                raise ProtocolError(f"the server at {self.endpoint} sent {msg.TYPE!r} mid-stream")
            # Silence, or a retryable refusal (restarted server, overload): Lazy Pirate.
            waited = time.monotonic() - last_progress
            if waited > opts.deadline:
                raise self._gave_up(msg if isinstance(msg, protocol.Err) else None, waited)
            if msg is None:
                log.warning(
                    "no answer from %s in %.1fs: %s",
                    self.endpoint,
                    opts.request_timeout,
                    "moving to the next replica" if self.replicas.several else "reconnecting",
                )
            else:
                self._sleep(backoff.next())
            # Silence: the next replica; a refusal or a restarted server: the same one.
            self.hello(deadline_at=last_progress + opts.deadline, failover=msg is None)
            assert self.welcome is not None
            flow.reconnected(self.welcome.max_count)

    def _send_get(self, rid: int, req: Request) -> None:
        assert self._sock is not None and self.welcome is not None
        get = protocol.Get(
            req=rid,
            job=self.welcome.job,
            rank=self.rank,
            pos=req.pos,
            count=req.count,
            stride=req.stride,
            consumed=self._consumed_position(),
        )
        self._sock.send(get.header())

    def _consumed_position(self) -> int:
        return -1 if self._consumed is None else self._consumed()

    def _answer(self, req: Request, header: protocol.Chunk, payload: list[Any]) -> Answer:
        tokens, rows = protocol.decode_chunk(header, payload)
        window_ids, epochs = protocol.require_rows(rows, protocol.ROW_WINDOW, protocol.ROW_EPOCH)
        n_rows = req.count * self.job.batch_size
        if tokens.shape != (n_rows, self.job.seq_len + 1):
            raise ProtocolError(
                f"chunk for {req} has shape {tokens.shape}, expected "
                f"({n_rows}, {self.job.seq_len + 1})"
            )
        sources = None
        if self.mixture:
            (sources,) = protocol.require_rows(rows, protocol.ROW_SOURCE)
            # A row labelled with a source that does not exist would be silently
            # mislabelled downstream: refuse it here (two reductions per chunk).
            if n_rows and not 0 <= int(sources.min()) <= int(sources.max()) < len(self.job.sources):
                raise ProtocolError(
                    f"chunk for {req} labels rows with sources outside "
                    f"[0, {len(self.job.sources)}); install matching versions of tokenfeed "
                    "and tokenfeed-server, or report a server bug"
                )
        return Answer(req, tokens, window_ids, epochs, sources)
