"""The mixture math's invariants: exact counts per period, smooth spreading, exactly-once per
source epoch with each source's plan, continuation across schedule changes, invariance to
world size / workers / batch size, resume checks, validation, wire and state round trips.
Pure numpy, no network."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixture_schedules import NAMES, schedules
from tokenfeed.errors import ConfigError, PlanError
from tokenfeed.mixture import MAX_PERIOD, Mixture, source_seed
from tokenfeed.plan import Plan, worker_steps

SETTINGS = settings(max_examples=60, deadline=None)


def stream(mix: Mixture, n: int) -> tuple[np.ndarray, np.ndarray]:
    return mix.locate(np.arange(n, dtype=np.int64))


# --------------------------------------------------------------------------- strategies

# --------------------------------------------------------------------------- the period


def test_five_one_one_is_nginx_order() -> None:
    src, pos = stream(Mixture({"a": 5, "b": 1, "c": 1}), 14)
    assert src.tolist() == [0, 0, 1, 0, 2, 0, 0] * 2
    assert pos.tolist() == [0, 1, 0, 2, 0, 3, 4, 5, 6, 1, 7, 1, 8, 9]


# --------------------------------------------------------------------------- source streams


@SETTINGS
@given(schedule=schedules(), data=st.data())
def test_locate_is_pure_in_any_order_and_shape(
    schedule: list[tuple[int, dict[str, int]]], data: st.DataObject
) -> None:
    mix = Mixture(schedule)
    n = schedule[-1][0] + 100
    src, pos = stream(mix, n)
    # one call across several segments (the general path) vs one row at a time
    idx = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=60)))
    s2, p2 = mix.locate(idx)
    assert s2.tolist() == src[idx].tolist() and p2.tolist() == pos[idx].tolist()
    for i in idx[:10]:
        s1, p1 = mix.locate(np.array([i]))
        assert (int(s1[0]), int(p1[0])) == (int(src[i]), int(pos[i]))
    two_d = idx[: len(idx) // 2 * 2].reshape(2, -1)
    s3, p3 = mix.locate(two_d)
    assert s3.shape == two_d.shape and p3.shape == two_d.shape
    assert s3.reshape(-1).tolist() == src[two_d.reshape(-1)].tolist()


@SETTINGS
@given(
    weights=st.dictionaries(st.sampled_from(NAMES[:4]), st.integers(1, 5), min_size=1),
    sizes=st.lists(st.integers(1, 40), min_size=4, max_size=4),
    seq_len=st.integers(1, 4),
    seed=st.integers(0, 2**64 - 1),
    n=st.integers(50, 600),
)
def test_every_window_once_per_source_epoch(
    weights: dict[str, int], sizes: list[int], seq_len: int, seed: int, n: int
) -> None:
    mix = Mixture(weights)
    src, pos = stream(mix, n)
    for s, name in enumerate(mix.names):
        n_windows = sizes[s]
        plan = Plan(
            n_tokens=n_windows * seq_len + 1,
            seq_len=seq_len,
            batch_size=1,
            seed=source_seed(seed, name),
        )
        assert plan.n_windows == n_windows
        ids, epochs = plan.windows(pos[src == s])
        for e in range(int(epochs.max()) + 1 if len(epochs) else 0):
            got = np.sort(ids[epochs == e])
            complete = (e + 1) * n_windows <= len(ids)
            if complete:
                assert got.tolist() == list(range(n_windows))
            else:  # the epoch in progress: no window twice so far
                assert len(np.unique(got)) == len(got)


def test_small_source_with_large_weight_runs_more_epochs() -> None:
    mix = Mixture({"big": 1, "small": 3})
    src, pos = stream(mix, 4000)
    small = Plan(n_tokens=101, seq_len=1, batch_size=1, seed=source_seed(7, "small"))
    big = Plan(n_tokens=10_001, seq_len=1, batch_size=1, seed=source_seed(7, "big"))
    _, e_small = small.windows(pos[src == 1])
    _, e_big = big.windows(pos[src == 0])
    assert int(e_small.max()) == 29 and int(e_big.max()) == 0


# --------------------------------------------------------------------------- ranks and resume


def global_stream(
    mix: Mixture, start: int, steps: int, world_size: int, batch_size: int, num_workers: int
) -> tuple[np.ndarray, np.ndarray]:
    """What a job of these sizes delivers from ``start``: per global step, the rows of
    every rank (each rank's DataLoader workers producing its local steps round-robin),
    concatenated in rank order."""
    plan = Plan(n_tokens=2**40, seq_len=1, batch_size=batch_size, world_size=world_size)
    per_rank = []
    for rank in range(world_size):
        produced: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for w in range(max(1, num_workers)):
            for item in worker_steps(w, num_workers, steps):
                for t in item:
                    rows = plan.rank_positions(rank, start + t * plan.global_batch)
                    produced[t] = mix.locate(rows)
        per_rank.append([produced[t] for t in range(steps)])
    src = [per_rank[r][t][0] for t in range(steps) for r in range(world_size)]
    pos = [per_rank[r][t][1] for t in range(steps) for r in range(world_size)]
    return np.concatenate(src), np.concatenate(pos)


@SETTINGS
@given(
    schedule=schedules(max_gap=60),
    sizes=st.lists(
        st.tuples(st.integers(1, 4), st.integers(1, 7), st.integers(0, 3)), min_size=2, max_size=3
    ),
    cuts=st.lists(st.integers(1, 40), min_size=2, max_size=3),
)
def test_invariant_to_world_size_workers_batch_size(
    schedule: list[tuple[int, dict[str, int]]],
    sizes: list[tuple[int, int, int]],
    cuts: list[int],
) -> None:
    """Jobs resumed one after another with other world sizes, batch sizes and worker
    counts, each at a position that is no multiple of anything, deliver the plain stream,
    across schedule boundaries."""
    mix = Mixture(schedule)
    got_src, got_pos = [], []
    position = 0
    for (world, batch, workers), steps in zip(sizes, cuts, strict=False):
        s, p = global_stream(mix, position, steps, world, batch, workers)
        got_src.append(s)
        got_pos.append(p)
        position += steps * world * batch
    want_src, want_pos = stream(mix, position)
    assert np.concatenate(got_src).tolist() == want_src.tolist()
    assert np.concatenate(got_pos).tolist() == want_pos.tolist()


# --------------------------------------------------------------------------- continuation


BASE = [(0, {"web": 2, "code": 1}), (100, {"web": 1, "code": 1, "math": 1}), (250, {"web": 1})]


@pytest.mark.parametrize(
    ("new", "position"),
    [
        (BASE, 0),
        (BASE, 10**9),
        ([(0, {"web": 5})], 0),  # nothing consumed yet: anything goes
        ([*BASE[:2], (250, {"web": 1, "math": 4})], 250),  # change a segment at the position
        ([*BASE[:2], (300, {"code": 1})], 200),  # move a later segment
        (BASE[:2], 200),  # drop a later segment
        ([*BASE[:2], (200, {"books": 1}), (250, {"web": 1})], 200),  # add one at the position
        (BASE[:1], 50),  # the anneal decided later: only the first segment was run
        ([(0, {"web": 4, "code": 2}), *BASE[1:]], 60),  # same reduced weights
    ],
)
def test_continuation_accepts_changes_after_the_position(
    new: list[tuple[int, dict[str, int]]], position: int
) -> None:
    old, mix = Mixture(BASE), Mixture(new)
    old.check_continuation(mix, position)
    # the first rows and the last ones before the position
    past = np.unique(np.r_[0 : min(position, 3000), max(0, position - 3000) : position])
    a, b = old.locate(past), mix.locate(past)
    assert [old.names[i] for i in a[0]] == [mix.names[i] for i in b[0]]
    assert a[1].tolist() == b[1].tolist()


@pytest.mark.parametrize(
    ("new", "position", "segment"),
    [
        # insert a segment before the position
        ([BASE[0], (50, {"math": 1}), *BASE[1:]], 120, "segment 1 was (start 100"),
        # change the weights of an earlier segment
        ([(0, {"web": 3, "code": 1}), *BASE[1:]], 120, "segment 0 was"),
        ([BASE[0], (100, {"web": 1, "code": 2, "math": 1}), BASE[2]], 101, "segment 1"),
        # move a past start
        ([BASE[0], (99, BASE[1][1]), BASE[2]], 120, "segment 1"),
        # drop a past segment
        ([BASE[0], BASE[2]], 260, "segment 1"),
        # the same weights in another source order change who wins ties
        ([(0, {"code": 1, "web": 2}), *BASE[1:]], 10, "segment 0"),
    ],
)
def test_continuation_refuses_rewriting_the_past(
    new: list[tuple[int, dict[str, int]]], position: int, segment: str
) -> None:
    with pytest.raises(ConfigError, match="rewrites the stream before position") as info:
        Mixture(BASE).check_continuation(Mixture(new), position)
    assert segment in str(info.value)
    assert "starting at" in str(info.value)  # says what to do instead


@SETTINGS
@given(old=schedules(max_gap=50), new=schedules(max_gap=50), position=st.integers(0, 200))
def test_accepted_continuation_maps_the_past_identically(
    old: list[tuple[int, dict[str, int]]],
    new: list[tuple[int, dict[str, int]]],
    position: int,
) -> None:
    # graft: the old schedule's past, the new schedule's future
    past = [seg for seg in old if seg[0] < position]
    future = [seg for seg in new if seg[0] >= position]
    a, b = Mixture(old), Mixture(past + future)
    a.check_continuation(b, position)
    sa, pa = stream(a, position)
    sb, pb = stream(b, position)
    names_a, names_b = a.names, b.names
    assert [names_a[i] for i in sa] == [names_b[i] for i in sb]
    assert pa.tolist() == pb.tolist()


@SETTINGS
@given(old=schedules(max_gap=50), new=schedules(max_gap=50), position=st.integers(1, 200))
def test_any_accepted_continuation_maps_the_past_identically(
    old: list[tuple[int, dict[str, int]]],
    new: list[tuple[int, dict[str, int]]],
    position: int,
) -> None:
    a, b = Mixture(old), Mixture(new)
    try:
        a.check_continuation(b, position)
    except ConfigError:
        return
    sa, pa = stream(a, position)
    sb, pb = stream(b, position)
    assert [a.names[i] for i in sa] == [b.names[i] for i in sb]
    assert pa.tolist() == pb.tolist()


def test_continuation_needs_a_mixture_and_a_position() -> None:
    with pytest.raises(ConfigError, match="expected a Mixture"):
        Mixture(BASE).check_continuation(BASE, 5)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="position must lie"):
        Mixture(BASE).check_continuation(Mixture(BASE), -1)


# --------------------------------------------------------------------------- validation


def test_floats_are_taken_to_four_decimals_and_reduced() -> None:
    assert Mixture({"web": 0.7, "code": 0.2, "math": 0.1}).segments == ((0, (7, 2, 1)),)
    assert Mixture({"a": 1, "b": 0.5}).segments == ((0, (2, 1)),)
    assert Mixture({"a": 2, "b": 4, "c": 6}).segments == ((0, (1, 2, 3)),)
    assert Mixture({"a": 0.33333, "b": 0.66667}).segments == ((0, (3333, 6667)),)
    assert Mixture({"a": np.float32(0.7), "b": np.int64(3)}).segments == ((0, (7, 30)),)
    assert Mixture({"a": 1e300, "b": 1e300}).segments == ((0, (1, 1)),)
    assert Mixture({"a": MAX_PERIOD - 1, "b": 1}).segments == ((0, (MAX_PERIOD - 1, 1)),)


def test_locate_validates_positions() -> None:
    mix = Mixture({"a": 1})
    with pytest.raises(PlanError, match="integer array"):
        mix.locate(np.array([1.0]))
    with pytest.raises(PlanError, match=r"\[0, 2\*\*63 - 1\]"):
        mix.locate(np.array([-1, 3]))
    with pytest.raises(PlanError, match=r"\[0, 2\*\*63 - 1\]"):
        mix.locate(np.array([2**63], dtype=np.uint64))
    src, pos = mix.locate(np.zeros((0, 3), dtype=np.int64))
    assert src.shape == pos.shape == (0, 3) and src.dtype == pos.dtype == np.int64
    src, pos = mix.locate(np.arange(4, dtype=np.uint32))
    assert src.dtype == np.int64 and pos.tolist() == [0, 1, 2, 3]


# --------------------------------------------------------------------------- identity, wire, state


def test_names_in_order_of_first_appearance() -> None:
    mix = Mixture([(0, {"web": 1}), (10, {"math": 1, "web": 1}), (20, {"code": 1, "math": 2})])
    assert mix.names == ("web", "math", "code")
    assert mix.segments == ((0, (1, 0, 0)), (10, (1, 1, 0)), (20, (0, 2, 1)))
    assert mix.segment_at(0) == 0 and mix.segment_at(19) == 1 and mix.segment_at(10**15) == 2


@SETTINGS
@given(schedule=schedules())
def test_wire_state_and_pickle_round_trips(schedule: list[tuple[int, dict[str, int]]]) -> None:
    mix = Mixture(schedule)
    wire = json.loads(json.dumps(mix.to_wire()))
    assert Mixture.from_wire(list(mix.names), wire) == mix
    state = json.loads(json.dumps(mix.to_state()))
    assert Mixture.from_state(state) == mix
    again = pickle.loads(pickle.dumps(mix))
    assert again == mix and hash(again) == hash(mix)
    assert again.locate(np.arange(50))[1].tolist() == mix.locate(np.arange(50))[1].tolist()
    assert eval(repr(mix), {"Mixture": Mixture}) == mix
    assert Mixture.of(mix) is mix and Mixture.of(schedule) == mix


def test_equality_and_repr() -> None:
    a = Mixture({"web": 0.7, "code": 0.3})
    assert a == Mixture({"web": 7, "code": 3}) == Mixture([(0, {"web": 14, "code": 6})])
    assert a != Mixture({"code": 3, "web": 7})  # source order is part of the order
    assert a != Mixture([(0, {"web": 7, "code": 3}), (10, {"web": 1})])
    assert a != {"web": 7, "code": 3}
    assert repr(a) == "Mixture({'web': 7, 'code': 3})"
    assert repr(Mixture(BASE)) == (
        "Mixture([(0, {'web': 2, 'code': 1}), (100, {'web': 1, 'code': 1, 'math': 1}), "
        "(250, {'web': 1})])"
    )
    assert Mixture(BASE).to_wire() == [[0, 2, 1, 0], [100, 1, 1, 1], [250, 1, 0, 0]]
    assert Mixture(BASE).to_state() == [[s, w] for s, w in BASE]
    with pytest.raises(AttributeError, match="immutable"):
        a._names = ("x",)


@pytest.mark.parametrize(
    ("names", "rows", "match"),
    [
        (["web", "web"], [[0, 1, 1]], "names repeat"),
        (["web"], [[0, 1, 1]], "has 3 values; expected 2"),
        (["web", "code"], [[0, 0, 0]], "every source weight 0"),
        (["web", "code"], [[0, 1, -1]], "negative weight"),
        (["web", "code"], [[0, 1, True]], "only integers"),
        (["web", "code"], [[0, 1, 0]], r"\['code'\] have weight 0 in every segment"),
        (["web", "code"], [[0, 0, 1], [5, 1, 1]], "not in order of first appearance"),
        (["web"], [[3, 1]], "starts at stream position 0"),
        (["web"], [[0, 1], [0, 1]], "strictly increasing"),
        (["web"], [], "schedule is empty"),
        ("web", [[0, 1]], "names must be a list"),
        (["web"], [7], "row 0 must be a list"),
        ([""], [[0, 1]], "invalid source name"),
    ],
)
def test_from_wire_validates(names: object, rows: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Mixture.from_wire(names, rows)  # type: ignore[arg-type]


def test_from_state_validates() -> None:
    with pytest.raises(ConfigError, match="a saved mixture is a list"):
        Mixture.from_state({"web": 1})
    with pytest.raises(ConfigError, match="pair"):
        Mixture.from_state([[0, {"web": 1}, 3]])


# --------------------------------------------------------------------------- seeds, imports


def test_source_seed() -> None:
    a = source_seed(0, "web")
    assert a == source_seed(0, "web")  # deterministic, not Python's hash()
    assert 0 <= a < 2**64
    assert len({source_seed(s, n) for s in (0, 1, 2**64 - 1) for n in NAMES}) == 3 * len(NAMES)
    with pytest.raises(ConfigError, match="seed must lie"):
        source_seed(-1, "web")
    with pytest.raises(ConfigError, match="seed must be an integer"):
        source_seed(True, "web")
    with pytest.raises(ConfigError, match="invalid source name"):
        source_seed(0, "")


def test_source_order_does_not_depend_on_the_index() -> None:
    # The same source in another position of another mixture walks the same plan.
    one = Mixture({"web": 1, "code": 1})
    two = Mixture({"code": 1, "math": 2, "web": 1})
    s1, p1 = stream(one, 400)
    s2, p2 = stream(two, 800)
    plan_of = Plan(n_tokens=1001, seq_len=1, batch_size=1, seed=source_seed(3, "web"))
    w1, _ = plan_of.windows(p1[s1 == one.names.index("web")][:150])
    w2, _ = plan_of.windows(p2[s2 == two.names.index("web")][:150])
    assert w1.tolist() == w2.tolist()


def test_importable_without_torch() -> None:
    code = (
        "import sys; import tokenfeed.mixture as m; "
        "m.Mixture({'a': 1, 'b': 2}).locate([0, 1, 2]); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_large_period_table() -> None:
    mix = Mixture({"a": 32768, "b": 16385, "c": 16383})
    start = 10**13 * MAX_PERIOD
    src, pos = mix.locate(np.arange(start, start + MAX_PERIOD, dtype=np.int64))
    assert np.bincount(src).tolist() == [32768, 16385, 16383]
    assert pos[src == 0].tolist() == list(range(10**13 * 32768, 10**13 * 32768 + 32768))
