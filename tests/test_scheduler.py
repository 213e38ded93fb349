"""The data plane's scheduling without sockets: deficit round robin and the egress cap."""

from __future__ import annotations

import collections

import pytest

from tokenfeed_server.dataplane.scheduler import FairQueue, TokenBucket


def run(q: FairQueue[str, int], rounds: int, may_send: bool = True) -> collections.Counter[str]:
    """Serve ``rounds`` rounds; items are their own cost in bytes; bytes served per flow."""
    served: collections.Counter[str] = collections.Counter()

    def serve(key: str, cost: int) -> int:
        served[key] += cost
        return cost

    for _ in range(rounds):
        q.serve_round(serve, lambda: may_send)
    return served


def test_shares_follow_weights_not_queue_depth() -> None:
    q: FairQueue[str, int] = FairQueue(quantum=1000)
    q.add("alice", 1.0)
    q.add("bob", 3.0)
    q.add("carol", 1.0)
    for _ in range(4000):  # alice: deep queues of small requests (many workers)
        q.push("alice", 100)
    for _ in range(400):  # bob and carol: few big ones
        q.push("bob", 1000)
        q.push("carol", 1000)
    served = run(q, 50)
    assert served["bob"] == 3 * served["alice"]
    assert served["carol"] == served["alice"] == 50 * 1000


def test_a_tenant_keeps_its_share_whatever_the_jobs_another_opens() -> None:
    q: FairQueue[str, int] = FairQueue(quantum=1000)
    for i in range(16):  # alice spreads her workers over 16 jobs
        q.add(f"alice-{i}", 1.0, group="alice")
        for _ in range(400):
            q.push(f"alice-{i}", 100)
    q.add("bob-0", 1.0, group="bob")
    for _ in range(4000):
        q.push("bob-0", 100)
    served = run(q, 40)
    alice = sum(v for k, v in served.items() if k.startswith("alice"))
    assert served["bob-0"] == alice == 40 * 1000  # half each, not 1/17 for bob
    # alice's jobs split her half evenly (within one quantum)
    per_job = [served[f"alice-{i}"] for i in range(16)]
    assert max(per_job) - min(per_job) <= 1000


def test_tenant_weights_split_among_their_jobs() -> None:
    q: FairQueue[str, int] = FairQueue(quantum=1000)
    q.add("a-1", 1.0, group="a")
    q.add("a-2", 1.0, group="a")
    q.add("b-1", 2.0, group="b")
    for key in ("a-1", "a-2", "b-1"):
        for _ in range(2000):
            q.push(key, 100)
    served = run(q, 30)
    assert served["b-1"] == 2 * (served["a-1"] + served["a-2"]) == 60_000
    assert served["a-1"] == served["a-2"]
    q.remove("a-1")  # the group lives on with its other job
    assert "a-1" not in q and len(q) == q.queued("a-2") + q.queued("b-1") == 2 * 2000 - 750
    q.remove("a-2")
    served = run(q, 1)
    assert set(served) == {"b-1"}


def test_idle_flows_bank_no_credit() -> None:
    q: FairQueue[str, int] = FairQueue(quantum=100)
    q.add("busy")
    q.add("idle")
    for _ in range(100):
        q.push("busy", 100)
    run(q, 10)  # "idle" had nothing for ten rounds
    for _ in range(100):
        q.push("idle", 100)
    served = run(q, 1)
    assert served == {"busy": 100, "idle": 100}  # one quantum each, no saved-up burst


def test_a_big_item_is_paid_back_in_later_turns() -> None:
    q: FairQueue[str, int] = FairQueue(quantum=100)
    q.add("big")
    q.add("small")
    q.push("big", 250)
    q.push("big", 250)
    for _ in range(10):
        q.push("small", 100)
    served = run(q, 5)
    # big: 250 in round 1 (deficit -150), nothing in rounds 2 and 3, 250 in round 4
    assert served == {"big": 500, "small": 500}
    assert len(q) == 5


def test_a_paused_turn_resumes_without_a_fresh_quantum() -> None:
    q: FairQueue[str, int] = FairQueue(quantum=300)
    q.add("a")
    q.add("b")
    for _ in range(10):
        q.push("a", 100)
        q.push("b", 100)
    sends = iter([True, False, True, True, False])
    served: list[str] = []

    def serve(key: str, cost: int) -> int:
        served.append(key)
        return cost

    q.serve_round(serve, lambda: next(sends))  # a sends once, then the cap says no
    q.serve_round(serve, lambda: next(sends))  # a finishes its quantum (2 more); b paused
    assert served == ["a", "a", "a"]
    q.serve_round(serve, lambda: True)  # b's turn: one quantum, then a's next turn
    assert served == ["a", "a", "a", "b", "b", "b", "a", "a", "a"]


def test_queue_bookkeeping() -> None:
    q: FairQueue[str, int] = FairQueue(quantum=100)
    q.add("a")
    q.add("b", 2.0)
    for cost in (1, 2, 3, 4):
        q.push("a", cost)
    q.push("b", 5)
    assert len(q) == 5 and q.queued("a") == 4 and "a" in q and sorted(q) == ["a", "b"]
    assert q.discard("a", lambda cost: cost % 2 == 0) == 2
    assert q.discard("missing", lambda cost: True) == 0
    assert len(q) == 3 and q.queued("a") == 2
    q.remove("a")
    assert len(q) == 1 and "a" not in q
    with pytest.raises(KeyError):
        q.add("b")
    with pytest.raises(ValueError, match="weight"):
        q.add("c", 0.0)
    with pytest.raises(ValueError, match="quantum"):
        FairQueue(quantum=0)


def test_a_flow_removed_while_served_is_left_cleanly() -> None:
    q: FairQueue[str, int] = FairQueue(quantum=1000)
    q.add("gone")
    q.add("stays")
    for _ in range(3):
        q.push("gone", 10)
        q.push("stays", 10)

    def serve(key: str, cost: int) -> int:
        if key == "gone":
            q.remove("gone")  # e.g. the job's last connection vanished on send
        return cost

    q.serve_round(serve, lambda: True)
    assert "gone" not in q and len(q) == 0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_caps_the_rate_with_a_tenth_second_burst() -> None:
    clock = Clock()
    bucket = TokenBucket(1000, clock=clock)
    assert bucket.ready() and bucket.wait_s() == 0.0
    bucket.spend(600)  # one chunk may overdraw: level 100 - 600
    assert not bucket.ready()
    assert bucket.wait_s() == pytest.approx(0.5)
    clock.now += 0.5
    assert not bucket.ready()  # level back at exactly 0: not yet
    clock.now += 0.001
    assert bucket.ready()
    clock.now += 3600  # a long idle time banks at most a tenth of a second
    assert bucket.ready() and bucket.level == pytest.approx(100)


def test_token_bucket_zero_means_no_cap() -> None:
    bucket = TokenBucket(0, clock=Clock())
    bucket.spend(10**12)
    assert bucket.ready() and bucket.wait_s() == 0.0
    with pytest.raises(ValueError, match="rate"):
        TokenBucket(-1)
