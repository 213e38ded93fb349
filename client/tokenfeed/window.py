"""The credit window and request splitting of a client, without a socket.

:class:`RequestWindow` decides which ``get`` requests to send and when, and hands the
answers back in request order; :class:`~tokenfeed.client.FeedClient` only moves the
messages. Keeping the bookkeeping here makes it testable without a server: the rules are
that at most ``window`` requests are unyielded at any time (answered-but-waiting ones
count, so memory stays ``window x chunk``), that no request is ever larger than the
server's ``max_count``, and that a reconnect re-asks exactly what is still unanswered,
cut again to the (possibly smaller) limits of the server that answers now.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Request:
    """``count`` global batches at stream positions ``pos + i * stride * G``.

    ``G`` is the global batch (``world_size * batch_size`` samples).
    """

    pos: int
    count: int
    stride: int = 1


def split_request(req: Request, max_count: int, global_batch: int) -> list[Request]:
    """``req`` as consecutive requests of at most ``max_count`` batches each.

    The pieces cover exactly the positions of ``req``, in order: piece ``k`` starts
    ``k * max_count`` batches (of ``stride * global_batch`` positions each) later.
    """
    if max_count < 1:
        raise ValueError(f"max_count must be >= 1, got {max_count}")
    if req.count <= max_count:
        return [req]
    step = req.stride * global_batch
    return [
        Request(req.pos + first * step, min(max_count, req.count - first), req.stride)
        for first in range(0, req.count, max_count)
    ]


class RequestWindow(Generic[T]):
    """Requests in flight and answers waiting, for one stream of requests.

    Use: call :meth:`to_send` and send what it returns; stop when :attr:`finished`;
    yield :meth:`pop_ready` while it returns an answer; otherwise wait for a message
    and give an answer to :meth:`expects` / :meth:`answer`. After a reconnect call
    :meth:`reconnected`. Answers (``T``, never None) are whatever the caller builds from
    a received message; this class never looks inside them.

    Args:
        requests: the stream of requests, consumed lazily (it may be endless).
        global_batch: samples per global batch, to cut requests at batch boundaries.
        ids: request ids; one sequence per connection owner, so that a late answer to
            an abandoned stream never matches a request of a new one.
    """

    def __init__(
        self,
        requests: Iterable[Request],
        *,
        global_batch: int,
        ids: Iterator[int] | None = None,
    ) -> None:
        self._todo = iter(requests)
        self._global_batch = global_batch
        self._ids = ids if ids is not None else itertools.count()
        self._leftover: collections.deque[Request] = collections.deque()  # cut, not yet asked
        self._exhausted = False
        # every request not yet yielded, in request order (asked, answered or to re-ask)
        self._pending: collections.OrderedDict[int, Request] = collections.OrderedDict()
        self._sent: set[int] = set()  # asked on the current connection, not yet answered
        self._done: dict[int, T] = {}

    @property
    def finished(self) -> bool:
        """True once every request has been yielded (valid after :meth:`to_send`)."""
        return not self._pending

    @property
    def in_flight(self) -> int:
        """Requests asked on the current connection and not answered yet."""
        return len(self._sent)

    @property
    def unyielded(self) -> int:
        """Requests taken from the stream and not yielded yet (asked or answered)."""
        return len(self._pending)

    def to_send(self, window: int, max_count: int) -> list[tuple[int, Request]]:
        """The ``(id, request)`` pairs to send now; they count as asked from here on.

        First the requests that a reconnect left unanswered, while fewer than ``window``
        are in flight; then new ones from the stream, each cut to ``max_count`` batches
        with the limit in force now, while fewer than ``window`` are unyielded.
        """
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        out: list[tuple[int, Request]] = []
        for rid, req in self._pending.items():
            if len(self._sent) >= window:
                break
            if rid not in self._sent and rid not in self._done:
                self._sent.add(rid)
                out.append((rid, req))
        while len(self._pending) < window and self._take():
            first, *rest = split_request(self._leftover.popleft(), max_count, self._global_batch)
            self._leftover.extendleft(reversed(rest))
            rid = next(self._ids)
            self._pending[rid] = first
            self._sent.add(rid)
            out.append((rid, first))
        return out

    def _take(self) -> bool:
        """Make sure a request waits in ``_leftover``; False when the stream is done."""
        if self._leftover:
            return True
        if self._exhausted:
            return False
        taken = next(self._todo, None)
        if taken is None:
            self._exhausted = True
            return False
        self._leftover.append(taken)
        return True

    def expects(self, rid: int) -> Request | None:
        """The request that an answer to ``rid`` is for, or None if it is not awaited.

        None means a stale answer (to a request asked on an earlier connection and
        already answered, or abandoned): the caller drops it, so nothing is duplicated.
        """
        return self._pending[rid] if rid in self._sent else None

    def answer(self, rid: int, value: T) -> None:
        """Keep ``value`` as the answer to the awaited request ``rid``."""
        if rid not in self._sent:
            raise KeyError(f"request {rid} is not awaited")
        self._sent.discard(rid)
        self._done[rid] = value

    def pop_ready(self) -> T | None:
        """The answer to the oldest unyielded request, if it has arrived (else None)."""
        if not self._pending:
            return None
        head = next(iter(self._pending))
        if head not in self._done:
            return None
        del self._pending[head]
        return self._done.pop(head)

    def reconnected(self, max_count: int) -> None:
        """A new connection: nothing is in flight; unanswered requests are cut to
        ``max_count`` (new ids for the pieces) and will be asked again by :meth:`to_send`.
        """
        self._sent.clear()
        fitted: collections.OrderedDict[int, Request] = collections.OrderedDict()
        for rid, req in self._pending.items():
            pieces = (
                [req] if rid in self._done else split_request(req, max_count, self._global_batch)
            )
            if len(pieces) == 1:
                fitted[rid] = req
            else:
                fitted.update((next(self._ids), piece) for piece in pieces)
        self._pending = fitted


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
