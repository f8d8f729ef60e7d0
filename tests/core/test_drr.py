"""DRR across classes (docs/DESIGN.md §4.7) and lane isolation (§4.6)."""

from __future__ import annotations

from kvsched.core.policy_queue import PolicyQueue
from kvsched.core.types import WorkerKey

from .factories import make_class, make_entry


def ALWAYS(c, x) -> bool:
    return True


def _share(quanta: list[int], cost: int = 512, n: int = 320, backlog: int = 400) -> list[int]:
    pq = PolicyQueue([make_class(f"c{i}", quantum=q) for i, q in enumerate(quanta)])
    for _ in range(backlog):
        for c in range(len(quanta)):
            pq.enqueue(c, make_entry(cost=cost, isl_tokens=cost), 1)
    counts = [0] * len(quanta)
    for _ in range(n):
        e = pq.pop_next(ALWAYS, ALWAYS)
        counts[e.class_idx] += 1
        pq.enqueue(e.class_idx, make_entry(cost=cost, isl_tokens=cost), 1)  # stays backlogged
    return counts


def test_drr_share_follows_quanta_when_both_classes_backlogged():
    a, b = _share([512, 128])
    assert abs(a - 256) <= 4 and abs(b - 64) <= 4, (a, b)


def test_drr_share_is_equal_when_quanta_equal():
    a, b = _share([128, 128])
    assert abs(a - b) <= 2, (a, b)
    a, b = _share([2048, 2048], cost=300)  # carry: bursts of up to ceil(2048 / 300) = 7
    assert abs(a - b) <= 8, (a, b)


def test_drr_grants_whole_rounds_when_nothing_affordable_after_one_visit():
    pq = PolicyQueue([make_class("a", quantum=100), make_class("b", quantum=10)])
    pq.enqueue(0, make_entry("a1", cost=1000), 1)
    pq.enqueue(1, make_entry("b1", cost=1000), 1)
    assert pq.pop_next(ALWAYS, ALWAYS).request_id == "a1"  # a needs 10 rounds, b 100: 10 granted
    assert pq.classes[1].deficit == 10 + 9 * 10  # one visit + 9 whole rounds


def test_blocked_class_keeps_credit_and_earns_none_when_heads_blocked():
    pq = PolicyQueue([make_class("a", quantum=128), make_class("b", quantum=128)])
    pq.enqueue(1, make_entry("b1", cost=200), 1)
    pq.enqueue(1, make_entry("b2", cost=200), 1)
    assert pq.pop_next(ALWAYS, ALWAYS).request_id == "b1"
    credit = pq.classes[1].deficit
    assert credit == 2 * 128 - 200
    for _ in range(20):
        pq.enqueue(0, make_entry(cost=128), 1)

    def b_blocked(c, e) -> bool:  # every worker b's head may use is busy
        return c != 1

    for _ in range(20):
        assert pq.pop_next(ALWAYS, b_blocked).class_idx == 0
    assert pq.classes[1].deficit == credit  # kept, not grown
    assert pq.pop_next(ALWAYS, ALWAYS).request_id == "b2"


def test_emptied_class_resets_deficit_when_last_entry_leaves():
    pq = PolicyQueue([make_class("a", quantum=1000)])
    pq.enqueue(0, make_entry(cost=10), 1)
    pq.pop_next(ALWAYS, ALWAYS)
    assert pq.classes[0].deficit == 0


def test_full_worker_hides_neither_other_lane_nor_shared_when_worker_7_full():
    w7, w9 = WorkerKey(7, 0), WorkerKey(9, 0)
    pq = PolicyQueue([make_class("a")])
    pq.enqueue(0, make_entry("for7", placement=w7), 1)  # best key, but worker 7 is full
    pq.enqueue(0, make_entry("for9", placement=w9), 1)
    pq.enqueue(0, make_entry("any"), 1)

    def full7(c, w) -> bool:
        return w != w7

    got = [pq.pop_next(full7, ALWAYS).request_id for _ in range(2)]
    assert got == ["for9", "any"]
    assert pq.pop_next(full7, ALWAYS) is None
    assert pq.classes[0].blocked_workers == {w7}


def test_blocked_lane_rechecked_once_per_capacity_change_when_worker_full():
    w7 = WorkerKey(7, 0)
    pq = PolicyQueue([make_class("a")])
    pq.enqueue(0, make_entry("for7", placement=w7), 1)
    calls = []

    def ready(c, w):
        calls.append(w)
        return False

    for _ in range(5):
        assert pq.pop_next(ready, ALWAYS) is None
    assert calls == [w7]  # checked once, then skipped until a capacity change
    pq.on_capacity_change(w7)
    assert pq.pop_next(ready, ALWAYS) is None
    assert calls == [w7, w7]


def test_shared_head_stalls_its_heap_when_its_workers_busy():
    """Known limitation kept from Dynamo's design (docs/DESIGN.md §4.14): only roots are inspected."""
    pq = PolicyQueue([make_class("a")])
    pq.enqueue(0, make_entry("stuck"), 1)
    pq.enqueue(0, make_entry("behind"), 1)

    def only_behind(c, e) -> bool:
        return e.request_id != "stuck"

    assert pq.pop_next(ALWAYS, only_behind) is None


def test_limit_accepts_crossing_request_when_checked_before_adding():
    pq = PolicyQueue([make_class("a", request_queue_limit_per_worker=2, isl_token_queue_limit_per_worker=1000)])
    assert pq.enqueue(0, make_entry(isl_tokens=10), 1) is None
    assert pq.enqueue(0, make_entry(isl_tokens=10), 1) is None
    over = pq.enqueue(0, make_entry(isl_tokens=10), 1)
    assert (over.limit_kind, over.current, over.limit) == ("requests", 2, 2)
    assert pq.enqueue(0, make_entry(isl_tokens=10), 2) is None  # scaled by 2 worker ids
    pq2 = PolicyQueue([make_class("a", isl_token_queue_limit_per_worker=1000)])
    assert pq2.enqueue(0, make_entry(isl_tokens=999), 1) is None
    assert pq2.enqueue(0, make_entry(isl_tokens=500), 1) is None  # crosses: accepted
    over = pq2.enqueue(0, make_entry(isl_tokens=1), 1)
    assert (over.limit_kind, over.current, over.limit) == ("isl_tokens", 1499, 1000)


def test_deferred_counts_toward_limits_but_not_backlog_when_held():
    pq = PolicyQueue([make_class("a", request_queue_limit_per_worker=1)])
    assert pq.defer(0, make_entry("held"), 1) is None
    assert not pq.classes[0].has_ready() and len(pq) == 0
    assert pq.enqueue(0, make_entry("next"), 1).limit_kind == "requests"


def test_requeue_keeps_enqueue_seq_and_goes_to_head_when_fcfs():
    pq = PolicyQueue([make_class("a")])
    first = make_entry("first")
    pq.enqueue(0, first, 1)
    pq.enqueue(0, make_entry("second"), 1)
    got = pq.pop_next(ALWAYS, ALWAYS)
    seq = got.enqueue_seq
    pq.enqueue(0, make_entry("third", strict_priority=0), 1)
    pq.requeue(got)
    assert got.enqueue_seq == seq
    assert pq.pop_next(ALWAYS, ALWAYS).request_id == "first"
