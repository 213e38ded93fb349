"""The piece cache's policy as pure functions: no threads, no files, no clock.

What to evict (unwanted before wanted, least recently read first, never pinned or
protected, queued prefetches before files), what to fetch next, how long a failure is
remembered, and how many rows a request may read. The mechanism that applies these
rules under its lock is tested against a real S3 server in ``test_store_cache.py``.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tokenfeed_server.store.cache_policy import (
    IDLE,
    QUEUED,
    RESIDENT,
    UNLIMITED_ROWS,
    EvictionOrder,
    FailureMemory,
    PieceEntry,
    Step,
    amplification_refusal,
    choose_victims,
    one_row_fits,
    prefetch_step,
    read_amplification,
    rows_per_request,
)
from tokenfeed_server.store.pieces import PieceRef


def _entry(digest: str, size: int = 10, state: int = RESIDENT, pins: int = 0) -> PieceEntry:
    return PieceEntry(None, size, digest, state, pins=pins)


def _ref(digest: str, size: int = 10) -> PieceRef:
    return PieceRef(digest, "k", 0, size, "s3://b/k")


def _order(*entries: PieceEntry, plan: set[str] | None = None) -> EvictionOrder:
    order = EvictionOrder()
    order.set_plan(plan or set())
    for entry in entries:
        order.add(entry)
    return order


def test_unwanted_pieces_go_before_wanted_and_oldest_first() -> None:
    a, b, c, d = (_entry(x) for x in "abcd")
    order = _order(a, b, c, d, plan={"a", "c"})
    assert [e.digest for e in order.candidates(evict_wanted=True)] == ["b", "d", "a", "c"]
    assert [e.digest for e in order.candidates(evict_wanted=False)] == ["b", "d"]
    order.touch(["b", "a"])  # read: now the most recent of their orders
    assert [e.digest for e in order.candidates(evict_wanted=True)] == ["d", "b", "c", "a"]


def test_a_piece_the_plan_stops_wanting_is_evicted_first() -> None:
    a, b, c = (_entry(x) for x in "abc")
    order = _order(a, b, c, plan={"c"})
    order.set_plan(set())  # the plan has passed c's block
    assert [e.digest for e in order.candidates(evict_wanted=False)] == ["c", "a", "b"]
    assert order.unwanted_bytes == 30 and order.wanted_bytes == 0
    order.set_plan({"a"})
    assert (order.unwanted_bytes, order.wanted_bytes) == (20, 10)
    order.remove("a")
    order.remove("zzz")  # absent: nothing
    assert (order.unwanted_bytes, order.wanted_bytes, len(order)) == (20, 0, 2)


def test_victims_spare_pinned_and_protected_pieces() -> None:
    a, b, c = _entry("a", pins=1), _entry("b"), _entry("c")
    order = _order(a, b, c)
    assert choose_victims(10, 5, [], order, set(), evict_wanted=True) == [b]
    assert choose_victims(10, 5, [], order, {"b"}, evict_wanted=True) == [c]
    assert choose_victims(30, 5, [], order, set(), evict_wanted=True) is None  # a is pinned
    assert choose_victims(5, 5, [], order, set(), evict_wanted=True) == []  # fits already


def test_queued_prefetches_are_cancelled_before_files_are_evicted() -> None:
    queued = _entry("q", state=QUEUED)
    order = _order(_entry("a"))
    assert choose_victims(10, 0, [queued], order, set(), evict_wanted=True) == [queued]
    # a wanted prefetch is kept when wanted pieces may not go
    order.set_plan({"q"})
    assert choose_victims(10, 0, [queued], order, set(), evict_wanted=False) == [
        order.unwanted["a"]
    ]


def test_wanted_pieces_stay_unless_a_request_needs_the_room() -> None:
    order = _order(_entry("w"), plan={"w"})
    assert choose_victims(10, 0, [], order, set(), evict_wanted=False) is None
    assert [e.digest for e in choose_victims(10, 0, [], order, set(), evict_wanted=True) or []] == [
        "w"
    ]


@given(
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=30),
    wanted=st.sets(st.integers(0, 29)),
    pinned=st.sets(st.integers(0, 29)),
    need=st.integers(1, 400),
    free=st.integers(0, 100),
    evict_wanted=st.booleans(),
)
def test_victims_make_exactly_enough_room_from_allowed_pieces(
    sizes: list[int],
    wanted: set[int],
    pinned: set[int],
    need: int,
    free: int,
    evict_wanted: bool,
) -> None:
    """Invariant: the victims free enough room (or none are chosen when that is impossible),
    none is pinned or (unless allowed) wanted, and dropping the last one would not fit."""
    entries = [_entry(str(i), s, pins=int(i in pinned)) for i, s in enumerate(sizes)]
    order = _order(*entries, plan={str(i) for i in wanted})
    allowed = [e for e in entries if not e.pins and (evict_wanted or int(e.digest) not in wanted)]
    victims = choose_victims(need, free, [], order, set(), evict_wanted=evict_wanted)
    if need <= free:
        assert victims == []
    elif free + sum(e.size for e in allowed) < need:
        assert victims is None
    else:
        assert victims is not None
        assert all(v in allowed for v in victims)
        assert free + sum(v.size for v in victims) >= need
        assert free + sum(v.size for v in victims[:-1]) < need  # no more than needed


def test_prefetch_steps() -> None:
    ref = _ref("a", 10)
    assert prefetch_step(None, ref, failed_recently=False) is Step.FETCH
    assert prefetch_step(None, ref, failed_recently=True) is Step.SKIP
    for state in (QUEUED, RESIDENT):
        assert prefetch_step(_entry("a", state=state), ref, failed_recently=False) is Step.SKIP
    assert prefetch_step(_entry("a", state=IDLE), ref, failed_recently=False) is Step.VERIFY
    assert prefetch_step(_entry("a", 7, IDLE), ref, failed_recently=False) is Step.REPLACE


def test_failures_are_remembered_for_their_ttl() -> None:
    memory: FailureMemory[str] = FailureMemory(ttl_s=30.0)
    memory.remember("a", "gone", now=100.0)
    assert memory.recent("a", now=129.9) == "gone"
    assert memory.recent("b", now=100.0) is None
    assert memory.recent("a", now=130.0) is None  # expired: forgotten, fetched again
    assert len(memory) == 0


def test_rows_per_request_count_the_pieces_rows_really_need() -> None:
    assert rows_per_request(100, 10, 5, dataset_bytes=100) == UNLIMITED_ROWS
    # a row of 5 bytes needs 1.4 pieces of 10 on average (not 2): half of 100 holds 3
    assert rows_per_request(100, 10, 5) == 3
    assert rows_per_request(10, 10, 1000) == 1  # at least one
    # a block shuffle whose two blocks' pieces fit in half the cache: any number of rows
    assert rows_per_request(100, 10, 5, span_pieces=5) == UNLIMITED_ROWS
    assert rows_per_request(100, 10, 5, span_pieces=6) == 3
    # the figure: a 16.8 MB cache, 1 MiB pieces, rows of 2049 uint16 tokens
    # admitted one batch of 8 rows per request counting two pieces a row; now 7 rows of
    # the global shuffle, and a block shuffle's request as many as its blocks allow
    assert rows_per_request(16_800_000, 1 << 20, 4098) == 7


@given(
    capacity=st.integers(1, 1 << 30),
    piece=st.integers(1, 1 << 20),
    row=st.integers(1, 1 << 20),
)
def test_rows_per_request_expect_to_fit_in_half_the_cache(
    capacity: int, piece: int, row: int
) -> None:
    rows = rows_per_request(capacity, piece, row)
    expected = rows * (1 + (row - 1) / piece) * piece  # distinct pieces on average
    assert rows >= 1
    assert rows == 1 or expected <= capacity // 2 + 1e-6 * capacity


def test_one_row_must_fit_and_says_which_setting() -> None:
    assert one_row_fits(2 * 10, 10, 5) is None  # 5 bytes: at most 2 pieces of 10
    problem = one_row_fits(15, 10, 5)
    assert problem is not None and "--cache-size=15" in problem


def test_read_amplification_of_a_global_shuffle_through_a_small_cache() -> None:
    assert read_amplification(100, 100, 10, 5) == 1.0  # fits: each piece once
    # 1 MiB pieces, 4 KiB rows, a cache a third of the dataset: ~170x
    amp = read_amplification(3 << 30, 1 << 30, 1 << 20, 4096)
    assert 150 < amp < 200
    refusal = amplification_refusal("web", 3 << 30, 1 << 30, 1 << 20, 4096)
    assert refusal is not None
    for words in ("shuffle='block'", "--cache-size", "allow_read_amplification", "web"):
        assert words in refusal
    assert amplification_refusal("web", 1 << 30, 1 << 30, 1 << 20, 4096) is None
