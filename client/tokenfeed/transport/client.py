"""The trainer's end of the wire: one DEALER socket per process, credits, retries.

:class:`FeedClient` attaches to a job with ``hello``, then turns a stream of requests
into a stream of :class:`Answer` objects, in request order, keeping at most ``window``
requests in flight (credit-based flow control: the server never sends unasked, so memory
on both ends is bounded by window x chunk). The bookkeeping of that window (what to ask,
what to re-ask, cutting requests to the server's limit) lives without a socket in
:mod:`tokenfeed.window`, the socket itself in :mod:`tokenfeed.transport.connection`; this
module moves the messages.

Liveness follows the ZeroMQ guide's Lazy Pirate pattern: when nothing arrives for
``request_timeout`` seconds, the client closes its socket, opens a new one, says hello
again and re-sends every request still outstanding. Requests are pure functions of their
fields, so re-sending loses and duplicates nothing, even if the server restarted. With
several replicas (:mod:`tokenfeed.transport.replicas`) the new socket goes to the next replica:
any server over the same store answers any request identically. A
retryable refusal (a server at its job or connection cap, overload) is retried after an
exponential backoff with jitter (:mod:`tokenfeed.transport.retry`), never at once. After
``warn_after`` seconds without an answer the client logs a warning on the ``tokenfeed``
logger; when no progress is made for ``deadline`` seconds it raises the last refusal
(e.g. :class:`~tokenfeed.errors.ConnectionLimit`) or
:class:`~tokenfeed.errors.ServerUnavailable` naming every endpoint.

Object storage that does not answer is the server's to ride out: while it retries, it
keeps the request and says so every few seconds (a retryable ``storage_unavailable``,
see :class:`~tokenfeed.errors.StorageUnavailable`). The client then logs what it waits for
(at most every 30 s) and keeps waiting on the same connection, without re-asking and
without counting that time against ``deadline``: the server's ``--storage-retry-s``
bounds the wait, and past it the request fails with ``retry`` False.

The client checks what the server says: a ``welcome`` with impossible values raises
:class:`~tokenfeed.errors.ProtocolError`, and a dataset build other than the expected one
(``fingerprint``: from a checkpoint, or the first ``welcome``) raises
:class:`~tokenfeed.errors.DatasetChanged`. For a mixture the builds are pinned per source
(``source_fingerprints``): the error names the source that changed, and a source a new
schedule adds is pinned at its first ``welcome``."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import zmq

from tokenfeed import protocol
from tokenfeed.errors import (
    DatasetChanged,
    ProtocolError,
    ServerError,
    ServerUnavailable,
    StorageUnavailable,
)
from tokenfeed.protocol import JobSpec
from tokenfeed.transport.answer import Answer, answer_of
from tokenfeed.transport.connection import Connection, Stopped
from tokenfeed.transport.handshake import Attempts
from tokenfeed.transport.homing import HomeProbe
from tokenfeed.transport.older import DROPPABLE, refused_droppable
from tokenfeed.transport.options import ClientOptions
from tokenfeed.transport.replicas import Replicas
from tokenfeed.transport.retry import Backoff
from tokenfeed.transport.ring import attach, is_local_endpoint
from tokenfeed.transport.welcome import changed_message, source_changed_message, welcome_problems
from tokenfeed.window import Request, RequestWindow

__all__ = ["Answer", "ClientOptions", "FeedClient", "Request", "Stopped"]

# One logger for the whole client package, so one line of logging config reaches it all.
log = logging.getLogger("tokenfeed")

#: Seconds between two warnings that the server waits on its object storage.
STORAGE_WARN_EVERY_S = 30.0


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
            and on the ``bye`` (see :mod:`tokenfeed.training.consumed`); None: not known.
        stop: when set (by another thread), every wait of ``hello`` and ``stream``
            gives up within a tenth of a second by raising :class:`Stopped`, so a
            receiver thread can be stopped while the server is gone.
        skipped: the stream ranges the run skipped on purpose (``(position, samples)``,
            from its state), told to the server on ``hello`` for the job's page.
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
        skipped: Sequence[tuple[int, int]] = (),
    ) -> None:
        # Checked before any socket exists: nothing to clean up when it is wrong.
        spread = rank * num_workers + worker
        self.replicas = Replicas(endpoint, slot=spread if slot is None else slot)
        self.job = job
        self.rank = rank
        self.worker = worker
        self.options = options or ClientOptions()
        self.welcome: protocol.Welcome | None = None
        #: True for a mixture job (builds are pinned per source, not as one)
        self.mixture = job.is_mixture
        #: the dataset build this client reads; None until the first welcome
        self.fingerprint = None if self.mixture else fingerprint or None
        self._fingerprint_given = self.fingerprint is not None
        #: a mixture's build per source name: given (from a checkpoint), then every
        #: source's build from the first welcome
        self.source_fingerprints: dict[str, str] = dict(source_fingerprints or {})
        self._sources_given = frozenset(self.source_fingerprints)
        self._consumed = consumed
        #: the socket in use, opened afresh on every attempt
        self.connection = Connection(self.replicas.endpoints[0], self.options, stop)
        # after a failover: asks this client's own replica again, to go back to it
        self._home = HomeProbe(self.replicas, self.options, stop, older=self._older_server)
        # one id sequence per client: a late answer to an abandoned stream never matches
        self._ids = itertools.count()
        # Unique per client object and kept across reconnects: the server replaces the
        # connection it knew under this name instead of counting a new one.
        self._name = f"{socket.gethostname()}:{os.getpid()}:r{rank}w{worker}:{id(self):x}"
        #: optional hello fields a server from before them refused (left out since)
        self._dropped: set[str] = set()
        #: ask for a shared-memory ring: told so, or the server is on this host
        self._want_ring = (
            self.options.shared_memory
            if self.options.shared_memory is not None
            else all(is_local_endpoint(e) for e in self.replicas.endpoints)
        )
        # the latest ranges only: a list on the wire holds at most MAX_ITEMS
        self._skipped = tuple(tuple(r) for r in skipped)[-protocol.MAX_ITEMS :]
        self._storage_warned = -STORAGE_WARN_EVERY_S  # when the last such warning went

    @property
    def endpoint(self) -> str:
        """The address in use (the first endpoint until the first connect)."""
        return self.connection.endpoint

    # -- connection ------------------------------------------------------------------

    def close(self) -> None:
        """Say bye, close the socket and the context; the client can not be used afterwards."""
        try:
            bye = None
            if self.welcome is not None and self.connection.sock is not None:
                bye = protocol.Bye(consumed=self._consumed_position())
            self.connection.close(bye)
        except zmq.ZMQError:
            pass  # the bye is a courtesy; the socket is closed either way
        finally:
            self._home.drop()
            self.connection.terminate()

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
        hello = self._hello_message()
        wait = min(1.0, opts.request_timeout)
        backoff = Backoff(cap=min(2.0, opts.request_timeout))
        attempts = Attempts()
        refusal: protocol.Err | None = None
        warned = False
        advance = failover
        while True:
            msg, cut = self._attempt(hello, wait, deadline_at, attempts, advance=advance)
            advance = True
            if isinstance(msg, protocol.Welcome):
                return self._accept(msg)
            if isinstance(msg, protocol.Err) and msg.retry:
                refusal = msg
                # the server's storage does not answer: say so; its own budget, if it
                # says one, bounds the wait rather than this client's deadline
                deadline_at = max(deadline_at, self._storage_wait(msg))
            elif isinstance(msg, protocol.Err) and self._older_server(hello, msg, self.endpoint):
                hello = self._hello_message()  # now without the run id: ask again at once
                advance = False
                continue
            elif msg is not None:
                self.connection.close()
                raise self._unexpected(msg)
            now = time.monotonic()
            every_replica_cut = attempts.every_replica_cut(len(self.replicas.last.addresses))
            if now >= deadline_at or every_replica_cut:
                self.connection.close()
                if (
                    refusal is None
                    and attempts.reached
                    and (attempts.cut == attempts.reached or every_replica_cut)
                ):
                    raise attempts.security_error(self._where(), now - started)
                raise self._gave_up(refusal, now - started)
            if refusal is None and not warned and now - started >= opts.warn_after:
                warned = True
                self._warn_silence(now - started, deadline_at - started)
            if msg is not None or cut:  # refused, or cut at once: wait before asking again
                self.connection.sleep(min(backoff.next(), max(0.0, deadline_at - now)))
            wait = min(wait * 2, opts.request_timeout)

    def _hello_message(self) -> protocol.Hello:
        hello = protocol.Hello(
            dataset=self.job.dataset,
            seq_len=self.job.seq_len,
            batch_size=self.job.batch_size,
            seed=self.job.seed,
            world_size=self.job.world_size,
            rank=self.rank,
            worker=self.worker,
            window=self.options.window,
            client=self._name,
            fingerprint=self.fingerprint or "",
            sources=self.job.sources,
            schedule=self.job.schedule,
            fingerprints=tuple(self.source_fingerprints.get(s, "") for s in self.job.sources),
            shuffle=self.job.shuffle,
            region_windows=self.job.region_windows,
            block_regions=self.job.block_regions,
            run=self.job.run,
            skipped=self._skipped,
            allow_read_amplification=self.options.allow_read_amplification,
            ring=self._want_ring,
        )
        defaults = protocol.messages.DEFAULTS[protocol.Hello]
        return dataclasses.replace(hello, **{name: defaults[name] for name in self._dropped})

    def _older_server(self, hello: protocol.Hello, err: protocol.Err, where: str) -> bool:
        """True when ``err`` is a server (at ``where``) from before some optional fields
        of ``hello`` refusing them, if they change no token (see
        :mod:`tokenfeed.transport.older`); this client leaves them out from then on."""
        names = refused_droppable(hello, err)
        for name in names:
            level, cost = DROPPABLE[name]
            log.log(level, "the server at %s is %s", where, cost)
        self._dropped.update(names)
        return bool(names)

    def _attempt(
        self,
        hello: protocol.Hello,
        wait: float,
        deadline_at: float,
        attempts: Attempts,
        *,
        advance: bool,
    ) -> tuple[protocol.Message | None, bool]:
        """One hello to the replica whose turn it is: the answer (None: silence) and
        whether the connection was cut during the handshake."""
        address = self.replicas.pick(advance=advance)
        if address is None:  # no name resolves (yet): a headless Service with no pod
            self.connection.close()
            self.connection.sleep(min(wait, max(0.0, deadline_at - time.monotonic())))
            return None, False
        self.connection.open(address)
        self.connection.send(hello)
        received = self.connection.recv(min(wait, max(0.0, deadline_at - time.monotonic())))
        msg = received[0] if received is not None else None
        cut = msg is None and self.connection.broken
        attempts.note(answered=msg is not None, cut=cut, in_time=time.monotonic() < deadline_at)
        return msg, cut

    def _unexpected(self, msg: protocol.Message) -> Exception:
        """The error for an answer to hello that is neither a welcome nor a retry."""
        if isinstance(msg, protocol.Err):
            return self._error(msg)
        return ProtocolError(f"the server at {self.endpoint} answered hello with {msg.TYPE!r}")

    def _warn_silence(self, waited: float, deadline: float) -> None:
        log.warning(
            "no answer from %s for %.0fs; still trying until the deadline of %.0fs. "
            "Check that it runs (GET /readyz) and that the endpoint and port are right",
            self._where(),
            waited,
            deadline,
        )

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
        problems = welcome_problems(welcome, self.job)
        if problems:
            self.connection.close()
            raise ProtocolError(
                f"the server at {self.endpoint} sent an invalid welcome: "
                f"{'; '.join(problems)}. Install matching versions of tokenfeed and "
                "tokenfeed-server, or report a server bug"
            )
        if self.mixture:
            served = dict(zip(self.job.sources, welcome.source_fingerprints, strict=True))
            for name, expected in self.source_fingerprints.items():
                if name in served and served[name] != expected:
                    self.connection.close()
                    raise DatasetChanged(
                        source_changed_message(
                            name,
                            self.endpoint,
                            expected,
                            served[name],
                            given=name in self._sources_given,
                        )
                    )
            self.source_fingerprints.update(served)
        elif self.fingerprint is not None and welcome.fingerprint != self.fingerprint:
            self.connection.close()
            raise DatasetChanged(self._changed(welcome.fingerprint))
        self.fingerprint = welcome.fingerprint
        self.welcome = welcome
        if welcome.ring_door:  # the server offers this connection a ring: take it
            self.connection.ring = attach(welcome.ring_door, welcome.ring_key)
        return welcome

    def _changed(self, served: str | None) -> str:
        return changed_message(
            self.job.dataset,
            self.endpoint,
            self.fingerprint,
            served,
            given=self._fingerprint_given,
            several=self.replicas.several,
        )

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
        if self.welcome is None or self.connection.sock is None:
            return self.hello()
        return self.welcome

    # -- data ------------------------------------------------------------------------

    def stream(self, requests: Iterable[Request]) -> Iterator[Answer]:
        """Answers to ``requests``, in order, with at most ``window`` in flight.

        After a reconnect the server may have other limits (an operator restarted it with
        new settings): the window is taken from the new ``welcome`` and requests larger
        than its ``max_count`` are split, so the stream carries on unchanged. A retryable
        ``err`` (``retry``: a restarted server, overload, object storage that does not
        answer) never ends the stream: the client backs off and asks again until
        ``deadline`` seconds pass without progress. A notice that the request waits on
        the server's object storage is waited out on the same connection (logged, not
        counted against ``deadline``; see the module docstring).
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
            if not self._going_home(flow):
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
            received = self.connection.recv(opts.request_timeout)
            msg = received[0] if received is not None else None
            if received is not None and isinstance(msg, protocol.Chunk):
                asked = flow.expects(msg.req)
                if asked is not None:  # else a stale answer (already received): dropped
                    flow.answer(msg.req, answer_of(asked, self.job, msg, received[1]))
                continue
            if isinstance(msg, protocol.Err) and self._storage_wait(msg):
                # The request waits on the server, which retries its object storage within
                # its budget: wait on, and that time is not counted against the deadline.
                last_progress = time.monotonic()
                continue
            self._recover(msg, last_progress, backoff)
            assert self.welcome is not None
            flow.reconnected(self.welcome.max_count)

    def _recover(
        self, msg: protocol.Message | None, last_progress: float, backoff: Backoff
    ) -> None:
        """After silence or a refusal mid-stream: raise, or hello again (Lazy Pirate)."""
        opts = self.options
        self._home.drop()  # the replica in use failed: going home starts over
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
            self.connection.sleep(backoff.next())
        # Silence: the next replica; a refusal or a restarted server: the same one.
        self.hello(deadline_at=last_progress + opts.deadline, failover=msg is None)

    def _going_home(self, flow: RequestWindow[Answer]) -> bool:
        """After a failover: True while the client drains the replica in use to go back
        to its own one, which answered its probe (no new requests meanwhile); once
        nothing is in flight, switch (bye here, the rest of the stream there)."""
        if not self.replicas.several:
            return False
        welcome = self._home.poll(self._hello_message, self.endpoint)
        if welcome is None:
            return False
        if flow.in_flight:
            return True  # a request boundary first: take what was asked here
        old, self.connection = self.connection, self._home.take()
        try:
            old.close(protocol.Bye(consumed=self._consumed_position()))
        except zmq.ZMQError:
            pass  # the bye is a courtesy; the socket is closed either way
        finally:
            old.terminate()
        self.replicas.went_home()
        log.info("back on %s, this client's own replica, after a failover", self.endpoint)
        self._accept(welcome)
        flow.reconnected(welcome.max_count)
        return False

    def _storage_wait(self, err: protocol.Err) -> float:
        """For a retryable ``storage_unavailable``: log what the trainer waits for (at
        most every 30 s), and if it is the server's notice (worded as
        :meth:`~tokenfeed.errors.StorageUnavailable.retrying_message`: the request stays
        queued while the server retries) return until when (``time.monotonic``) the
        server keeps trying. 0.0 for any other err: a refusal, asked again as before."""
        if not (err.retry and err.code == StorageUnavailable.code):
            return 0.0
        now = time.monotonic()
        if now - self._storage_warned >= STORAGE_WARN_EVERY_S:
            self._storage_warned = now
            log.warning(
                "the object storage behind the server at %s does not answer; waiting "
                "while the server retries: %s",
                self.endpoint,
                err.message,
            )
        left = StorageUnavailable.seconds_left(err.message)
        return 0.0 if left is None else now + left + 1.0

    def _send_get(self, rid: int, req: Request) -> None:
        assert self.welcome is not None
        get = protocol.Get(
            req=rid,
            job=self.welcome.job,
            rank=self.rank,
            pos=req.pos,
            count=req.count,
            stride=req.stride,
            consumed=self._consumed_position(),
        )
        self.connection.send(get)

    def _consumed_position(self) -> int:
        return -1 if self._consumed is None else self._consumed()
