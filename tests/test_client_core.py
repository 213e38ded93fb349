"""The client's socket-free core: the request window, request splitting, backoff.

No server and no socket: :class:`~tokenfeed.window.RequestWindow` is driven by hand the
way :class:`~tokenfeed.transport.client.FeedClient` drives it, and its promises are checked
directly (order, the window bound, exactly-once across reconnects, cuts at the limit).
"""

from __future__ import annotations

import itertools
import random

import pytest

from tokenfeed.transport.retry import Backoff
from tokenfeed.window import Request, RequestWindow, pack_requests, split_request

G = 6  # global batch: world_size * batch_size


def positions(req: Request) -> list[int]:
    """The stream positions (one per batch) that a request covers."""
    return [req.pos + i * req.stride * G for i in range(req.count)]


# -- split_request ------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 5, 7, 12, 13])
@pytest.mark.parametrize("stride", [1, 3])
@pytest.mark.parametrize("limit", [1, 2, 5, 20])
def test_split_covers_the_same_positions_in_order(count: int, stride: int, limit: int) -> None:
    req = Request(pos=12, count=count, stride=stride)
    pieces = split_request(req, limit, G)
    assert all(1 <= p.count <= limit and p.stride == stride for p in pieces)
    assert [x for p in pieces for x in positions(p)] == positions(req)
    assert len(pieces) == -(-count // limit)  # as few pieces as the limit allows


def test_split_refuses_a_zero_limit() -> None:
    with pytest.raises(ValueError, match="max_count"):
        split_request(Request(0, 3), 0, G)


# -- RequestWindow ------------------------------------------------------------------------


def drive(
    flow: RequestWindow[Request],
    *,
    window: int,
    max_count: int,
    rng: random.Random,
    reconnect_every: int = 0,
    new_limits: tuple[int, int] | None = None,
    asked_after: list[Request] | None = None,
) -> tuple[list[Request], int]:
    """Run the window like the client: answer asked requests in random order, reconnect
    now and then (losing whatever was in flight); return what was yielded and the most
    requests ever unyielded. ``asked_after`` collects what is asked after a reconnect."""
    out: list[Request] = []
    peak = 0
    in_flight: list[int] = []
    reconnected = False
    for step in itertools.count():
        for rid, req in flow.to_send(window, max_count):
            in_flight.append(rid)
            if reconnected and asked_after is not None:
                asked_after.append(req)
        assert flow.in_flight <= window
        peak = max(peak, flow.unyielded)
        if flow.finished:
            return out, peak
        ready = flow.pop_ready()
        if ready is not None:
            out.append(ready)
            continue
        if reconnect_every and step % reconnect_every == reconnect_every - 1:
            in_flight.clear()  # the old connection's answers are lost
            reconnected = True
            if new_limits is not None:
                window, max_count = new_limits
            flow.reconnected(max_count)
            continue
        rid = in_flight.pop(rng.randrange(len(in_flight)))
        asked = flow.expects(rid)
        assert asked is not None
        flow.answer(rid, asked)
    raise AssertionError("unreachable")


def requests(n: int) -> list[Request]:
    return [Request(pos=i * 4 * G, count=4) for i in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_answers_come_back_in_request_order_within_the_window(seed: int) -> None:
    flow: RequestWindow[Request] = RequestWindow(requests(20), global_batch=G)
    got, peak = drive(flow, window=3, max_count=4, rng=random.Random(seed))
    assert got == requests(20)
    assert peak <= 3  # answered-but-unyielded requests count against the window


@pytest.mark.parametrize("seed", range(5))
def test_reconnects_lose_and_duplicate_nothing(seed: int) -> None:
    flow: RequestWindow[Request] = RequestWindow(requests(20), global_batch=G)
    got, _ = drive(flow, window=4, max_count=4, rng=random.Random(seed), reconnect_every=3)
    assert [x for r in got for x in positions(r)] == [x for r in requests(20) for x in positions(r)]


@pytest.mark.parametrize("seed", range(5))
def test_a_smaller_server_after_a_reconnect_gets_requests_it_accepts(seed: int) -> None:
    # a restarted server with max_count 3 and window 2: outstanding requests are re-cut
    flow: RequestWindow[Request] = RequestWindow(requests(10), global_batch=G)
    asked: list[Request] = []
    got, _ = drive(
        flow,
        window=4,
        max_count=4,
        rng=random.Random(seed),
        reconnect_every=4,
        new_limits=(2, 3),
        asked_after=asked,
    )
    assert [x for r in got for x in positions(r)] == [x for r in requests(10) for x in positions(r)]
    assert asked and all(r.count <= 3 for r in asked)  # the new server's limit holds


def test_requests_are_cut_to_max_count_before_they_are_sent() -> None:
    flow: RequestWindow[str] = RequestWindow([Request(0, 10)], global_batch=G)
    sent = flow.to_send(window=8, max_count=4)
    assert [r for _, r in sent] == [Request(0, 4), Request(4 * G, 4), Request(8 * G, 2)]


def test_a_stale_answer_is_not_expected() -> None:
    flow: RequestWindow[str] = RequestWindow([Request(0, 1), Request(G, 1)], global_batch=G)
    (rid, _), (rid2, _) = flow.to_send(window=2, max_count=8)
    flow.answer(rid, "first")
    assert flow.expects(rid) is None  # a duplicate of an answered request
    assert flow.expects(rid2 + 100) is None  # an id from an abandoned stream
    with pytest.raises(KeyError):
        flow.answer(rid, "again")
    assert flow.pop_ready() == "first"


def test_head_of_line_blocks_later_answers() -> None:
    flow: RequestWindow[str] = RequestWindow(requests(3), global_batch=G)
    (a, _), (b, _), (c, _) = flow.to_send(window=3, max_count=4)
    flow.answer(c, "c")
    flow.answer(b, "b")
    assert flow.pop_ready() is None  # a is not here yet
    assert flow.to_send(window=3, max_count=4) == []  # still 3 unyielded: nothing new
    flow.answer(a, "a")
    assert [flow.pop_ready() for _ in range(3)] == ["a", "b", "c"]


def test_after_a_reconnect_only_unanswered_requests_are_asked_again() -> None:
    flow: RequestWindow[str] = RequestWindow(requests(3), global_batch=G)
    (a, ra), (b, _), (c, rc) = flow.to_send(window=3, max_count=4)
    flow.answer(b, "b")
    flow.reconnected(max_count=4)
    assert flow.in_flight == 0
    assert flow.to_send(window=3, max_count=4) == [(a, ra), (c, rc)]


def test_a_reconnect_window_of_one_re_asks_one_at_a_time() -> None:
    flow: RequestWindow[str] = RequestWindow(requests(3), global_batch=G)
    sent = flow.to_send(window=3, max_count=4)
    flow.reconnected(max_count=4)
    first = flow.to_send(window=1, max_count=4)
    assert first == sent[:1] and flow.to_send(window=1, max_count=4) == []


def test_an_empty_stream_finishes_at_once() -> None:
    flow: RequestWindow[str] = RequestWindow([], global_batch=G)
    assert flow.to_send(window=4, max_count=4) == [] and flow.finished


def test_the_stream_is_read_lazily() -> None:
    endless = (Request(i * G, 1) for i in itertools.count())
    flow: RequestWindow[str] = RequestWindow(endless, global_batch=G)
    assert len(flow.to_send(window=4, max_count=1)) == 4  # an endless stream is fine


def test_a_zero_window_is_refused() -> None:
    flow: RequestWindow[str] = RequestWindow(requests(1), global_batch=G)
    with pytest.raises(ValueError, match="window"):
        flow.to_send(window=0, max_count=4)


# -- pack_requests ------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("max_count", [1, 4, 7])
def test_pack_requests_covers_a_worker_steps_exactly(workers: int, max_count: int) -> None:
    steps = list(range(1, 40, workers))
    packed = list(pack_requests(steps, 100, G, max_count))
    assert all(r.count <= max_count for r in packed)
    assert [x for r in packed for x in positions(r)] == [100 + s * G for s in steps]


# -- Backoff ------------------------------------------------------------------------------


def test_backoff_grows_to_its_cap_with_jitter_inside_the_bounds() -> None:
    b = Backoff(base=0.05, cap=2.0, seed=1)
    delays = [b.next() for _ in range(12)]
    for i, d in enumerate(delays):
        assert b.floor(i) <= d <= b.ceiling(i)
    assert b.ceiling(0) == 0.05 and b.ceiling(11) == 2.0
    assert len(set(delays)) == len(delays)  # jittered: no two workers march in step
    b.reset()
    assert b.next() <= 0.05


def test_backoff_bound_on_retries() -> None:
    b = Backoff(base=0.05, cap=2.0)
    # floors: 0.025 0.05 0.1 0.2 0.4 0.8 1 1 ... -> 1.575 s for the first 6, then 1 s each
    assert b.max_retries(1.58) == 6 and b.max_retries(1.57) == 5
    assert b.max_retries(3.58) == 8
    with pytest.raises(ValueError):
        Backoff(base=0.0)
