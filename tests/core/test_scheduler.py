"""Scheduler end to end over a private LedgerArrays (docs/DESIGN.md §4, §5; guardrails §4.17)."""

from __future__ import annotations

import pytest

from kvsched.config import AdmissionConfig, ClassConfig
from kvsched.core.types import Reject, WorkerKey

from .factories import make_class, make_config, make_request, make_scheduler

BUSY_500 = dict(prefill_busy_threshold=500)


def _one(records):
    assert len(records) == 1, records
    return records[0]


def _sched(classes=None, **kw):
    return make_scheduler(make_config(classes or [make_class("default", **BUSY_500)]), **kw)


def test_queues_when_all_busy_and_dispatches_on_release_with_ledger_back_to_zero():
    s = _sched(workers=((1, 0), (2, 0)))
    a1 = _one(s.enqueue(make_request("a1", isl_tokens=600), 0))
    a2 = _one(s.enqueue(make_request("a2", isl_tokens=600), 1))
    assert {a1.worker, a2.worker} == {WorkerKey(1, 0), WorkerKey(2, 0)}  # cost spreads the load
    assert s.enqueue(make_request("q1", isl_tokens=600), 2) == []
    assert s.enqueue(make_request("q2", isl_tokens=600), 3) == []
    assert s.queued == 2
    s.release("a1", a1.slot, a1.generation, "completed", 700, 10)
    got = s.drain_cleanup(10)
    assert [r.request_id for r in got] == ["q1"] and got[0].queued_us == 8
    s.update("a2", a2.slot, a2.generation, "prefill_done", None, 11)
    got2 = s.drain_cleanup(11)
    assert [r.request_id for r in got2] == ["q2"]
    for r in (a2, got[0], got2[0]):
        s.release(r.request_id, r.slot, r.generation, "completed", 0, 20)
    s.drain_cleanup(20)
    a = s.ledger.arrays
    assert a.w_active_blocks.sum() == a.w_active_prefill.sum() == a.w_active_requests.sum() == 0
    assert s.active_leases == 0 and s.queued == 0


def test_release_is_idempotent_and_stale_release_cannot_free_new_request_when_id_reused():
    s = _sched()
    first = _one(s.enqueue(make_request("x"), 0))
    s.release("x", first.slot, first.generation, "completed", 0, 1)
    s.release("x", first.slot, first.generation, "completed", 0, 1)  # no-op
    assert _one(s.enqueue(make_request("x"), 2)).reason == "duplicate_request"  # its cleanup is pending
    s.drain_cleanup(2)  # the cleanup reached the policies: the id is reusable
    second = _one(s.enqueue(make_request("x"), 2))
    s.release("x", first.slot, first.generation, "aborted", 0, 3)  # late, stale generation
    assert s.active_leases == 1
    with pytest.raises(KeyError):
        s.update("x", first.slot, first.generation, "progress", 5, 4)
    s.update("x", second.slot, second.generation, "progress", 5, 4)


def test_rejects_invalid_pinned_not_allowed_duplicate_and_no_endpoints():
    s = _sched()
    assert _one(s.enqueue(make_request("h", isl_tokens=16, block_hashes=[1, 2]), 0)).reason == "invalid"
    assert (
        _one(s.enqueue(make_request("p", pinned=WorkerKey(1, 0), allowed_workers=frozenset({2})), 0)).reason
        == "pinned_not_allowed"
    )
    _one(s.enqueue(make_request("d"), 0))
    assert _one(s.enqueue(make_request("d"), 0)).reason == "duplicate_request"
    assert _one(s.enqueue(make_request("u", pinned=WorkerKey(9, 0)), 0)).reason == "no_endpoints"
    s.set_drained(1, None, True, 1)
    assert _one(s.enqueue(make_request("z"), 1)).reason == "no_endpoints"
    with pytest.raises(KeyError):
        s.set_drained(42, None, True, 1)
    assert _one(s.enqueue(make_request("ok", isl_tokens=17, block_hashes=[1, 2]), 2)).reason == "no_endpoints"


def test_no_endpoints_when_no_worker_registered():
    s = _sched(workers=())
    assert _one(s.enqueue(make_request("a"), 0)).reason == "no_endpoints"


def test_do_not_queue_rejected_when_request_would_wait():
    s = _sched()
    _one(s.enqueue(make_request("a", isl_tokens=600), 0))
    r = _one(s.enqueue(make_request("b", do_not_queue=True), 1))
    assert isinstance(r, Reject) and r.reason == "do_not_queue"


def test_anti_bypass_new_arrival_waits_behind_ready_backlog_when_workers_free_up():
    s = _sched()
    big = _one(s.enqueue(make_request("big", isl_tokens=600), 0))
    assert s.enqueue(make_request("w1", isl_tokens=600), 1) == []
    s.update("big", big.slot, big.generation, "prefill_done", None, 2)  # capacity, but no pass yet
    got = s.enqueue(make_request("late", isl_tokens=10), 3)  # must not jump w1
    assert [r.request_id for r in got] == ["w1"]
    assert s.queued == 1


def test_queue_full_off_by_one_when_limit_reached():
    s = _sched([make_class("default", request_queue_limit_per_worker=2, **BUSY_500)])
    _one(s.enqueue(make_request("run", isl_tokens=600), 0))
    assert s.enqueue(make_request("q1"), 1) == []
    assert s.enqueue(make_request("q2"), 2) == []
    r = _one(s.enqueue(make_request("q3"), 3))
    assert (r.reason, r.limit_kind, r.current, r.limit) == ("queue_full", "requests", 2, 2)


def test_timeout_rejects_waiting_request_when_class_timeout_passes():
    s = _sched([make_class("default", queue_timeout_s=1.0, **BUSY_500)])
    _one(s.enqueue(make_request("run", isl_tokens=600), 0))
    assert s.enqueue(make_request("q", deadline_us=500_000), 10) == []
    assert s.enqueue(make_request("q2"), 20) == []
    assert s.tick(400_000) == []
    assert [(r.request_id, r.reason) for r in s.tick(500_000)] == [("q", "timeout")]
    assert [(r.request_id, r.reason) for r in s.tick(1_000_020)] == [("q2", "timeout")]
    assert s.queued == 0


def test_cancel_removes_queued_request_when_released_with_slot_minus_one():
    s = _sched()
    run = _one(s.enqueue(make_request("run", isl_tokens=600), 0))
    assert s.enqueue(make_request("q"), 1) == []
    s.release("q", -1, 0, "cancelled", 0, 2)
    assert s.queued == 0
    s.release("run", run.slot, run.generation, "completed", 0, 3)
    assert s.drain_cleanup(3) == []
    assert _one(s.enqueue(make_request("q"), 4)).request_id == "q"  # id reusable


def test_requeue_keeps_seq_and_readmits_when_capacity_frees():
    s = _sched()
    a = _one(s.enqueue(make_request("a", isl_tokens=600), 0))
    assert s.enqueue(make_request("b", isl_tokens=600), 1) == []
    got = s.update("a", a.slot, a.generation, "requeue", None, 2)
    assert [r.request_id for r in got] == ["a"]  # head of its FCFS class, before b
    assert got[0].slot != a.slot or got[0].generation != a.generation
    assert s.queued == 1


def test_pinned_lane_of_full_worker_does_not_hide_other_work_when_worker_7_busy():
    s = _sched(workers=((7, 0), (9, 0)))
    _one(s.enqueue(make_request("fill7", isl_tokens=600, pinned=WorkerKey(7, 0)), 0))
    _one(s.enqueue(make_request("fill9", isl_tokens=600, pinned=WorkerKey(9, 0)), 0))
    assert s.enqueue(make_request("for7", pinned=WorkerKey(7, 0)), 1) == []
    assert s.enqueue(make_request("for9", pinned=WorkerKey(9, 0)), 2) == []
    assert s.enqueue(make_request("any"), 3) == []
    leases = {r.request_id: r for r in s.leases(4)}
    s.update("fill9", leases["fill9"].slot, leases["fill9"].generation, "prefill_done", None, 4)
    got = s.drain_cleanup(4)
    assert [r.request_id for r in got] == ["for9", "any"]
    assert all(r.worker == WorkerKey(9, 0) for r in got)


def test_remove_worker_rejects_its_lane_and_releases_bookings():
    s = _sched(workers=((7, 0), (9, 0)))
    _one(s.enqueue(make_request("run7", isl_tokens=600, pinned=WorkerKey(7, 0)), 0))
    assert s.enqueue(make_request("for7", pinned=WorkerKey(7, 0)), 1) == []
    got = s.remove_worker(7, None, 2)
    assert [(r.request_id, r.reason, r.revoked) for r in got] == [
        ("run7", "no_endpoints", True),
        ("for7", "no_endpoints", False),
    ]
    assert "7:0" in got[0].detail and "removed" in got[0].detail
    assert s.active_leases == 0 and s.ledger.arrays.w_active_requests.sum() == 0


def test_remove_worker_answers_each_class_deferred_first_then_its_queue_in_order():
    """The stranded requests' answers go class by class: the ones an admission policy holds first, then the
    ready ones in queue order (the shared heap, then each worker's lane), after the revocation notices."""
    from kvsched.core.admission import AdmissionPolicy, Defer, Ready

    class DeferEvens(AdmissionPolicy):
        name = "defer_evens"

        def decide(self, request_id, spec, fleet, now_us):
            return Defer() if int(request_id[1:]) % 2 == 0 else Ready(None)

        def notify(self, event, fleet, now_us):
            return []

        def reconfigure(self, cfg):
            pass

        def tracked(self):
            return 0

    s = _sched(workers=((7, 0), (7, 1), (9, 0)))
    s.pq.classes[0].admission = DeferEvens()
    for rid, rank in (("h1", 0), ("h3", 1)):  # both ranks of worker 7 busy: what follows waits
        _one(s.enqueue(make_request(rid, isl_tokens=600, pinned=WorkerKey(7, rank)), 0))
    for i, pin in enumerate([None, None, WorkerKey(7, 0), WorkerKey(7, 1), WorkerKey(7, 0), None], start=2):
        assert s.enqueue(make_request(f"r{i}", pinned=pin, allowed_workers=frozenset({7})), i) == []
    got = s.remove_worker(7, None, 10)
    assert [(r.request_id, r.revoked) for r in got] == [
        ("h1", True),
        ("h3", True),
        ("r2", False),
        ("r4", False),
        ("r6", False),
        ("r3", False),
        ("r7", False),
        ("r5", False),
    ]
    assert s.waiting is False


def test_owner_gone_skips_admission_when_owner_dead():
    dead = {5}
    s = make_scheduler(make_config([make_class("default", **BUSY_500)]), owner_alive=lambda o: o not in dead)
    assert s.enqueue(make_request("x", owner=5), 0) == []
    assert s.active_leases == 0 and s.queued == 0


def test_cancel_owner_aborts_leases_and_queued_when_router_dies():
    s = _sched()
    _one(s.enqueue(make_request("a", isl_tokens=600, owner=3), 0))
    assert s.enqueue(make_request("b", owner=3), 1) == []
    assert s.enqueue(make_request("c", owner=4), 2) == []
    s.cancel_owner(3, 3)
    got = s.drain_cleanup(3)
    assert [r.request_id for r in got] == ["c"]


def test_shutdown_rejects_every_waiting_request():
    s = _sched()
    _one(s.enqueue(make_request("a", isl_tokens=600), 0))
    s.enqueue(make_request("b"), 1)
    assert [(r.request_id, r.reason) for r in s.shutdown(2)] == [("b", "shutting_down")]
    assert _one(s.enqueue(make_request("c"), 3)).reason == "shutting_down"


def test_wspt_uses_uncached_tokens_when_prefix_is_cached():
    s = _sched([make_class("default", ordering="wspt", **BUSY_500)])
    run = _one(s.enqueue(make_request("warm", isl_tokens=600, block_hashes=list(range(1, 38))), 0))
    assert s.enqueue(make_request("raw_small", isl_tokens=300), 1) == []
    assert s.enqueue(make_request("cached_big", isl_tokens=600, block_hashes=list(range(1, 38))), 2) == []
    s.release("warm", run.slot, run.generation, "completed", 0, 3)
    got = s.drain_cleanup(3)
    assert got[0].request_id == "cached_big" and got[0].cached_tokens == 592


def test_explain_returns_per_worker_rows_when_decision_recent():
    s = _sched(workers=((1, 0), (2, 0)))
    a = _one(s.enqueue(make_request("a"), 0))
    rep = s.explain("a")
    assert (rep.chosen_worker_id, rep.chosen_dp_rank) == a.worker
    assert len(rep.rows) == 2 and s.explain("nope") is None
    assert [q.name for q in s.queues(0)] == ["default"] and len(s.workers()) == 2


def test_reload_refused_when_removing_class_that_holds_requests():
    s = _sched([make_class("default", **BUSY_500), make_class("batch", **BUSY_500)])
    _one(s.enqueue(make_request("a", isl_tokens=600, policy_class="batch"), 0))
    s.enqueue(make_request("b", policy_class="batch"), 1)
    with pytest.raises(ValueError, match="batch"):
        s.reload(make_config([make_class("default", **BUSY_500)]))
    s.reload(
        make_config([make_class("default", quantum=7, **BUSY_500), make_class("batch", quantum=9), make_class("new")])
    )
    assert [q.quantum for q in s.queues(2)] == [7, 9, 1024]
    assert [r.request_id for r in s.drain_cleanup(2)] == ["b"]  # batch no longer busy-limited


def test_reload_keeps_queued_requests_when_classes_change_position():
    s = _sched([make_class("default", **BUSY_500), make_class("batch", **BUSY_500)])
    a = _one(s.enqueue(make_request("a", isl_tokens=600, policy_class="batch"), 0))
    s.enqueue(make_request("b", policy_class="batch"), 1)
    s.enqueue(make_request("c"), 2)
    s.reload(make_config([make_class("batch", quantum=5, **BUSY_500), make_class("default", **BUSY_500)]))
    rows = {q.name: q for q in s.queues(3)}
    assert rows["batch"].depth == 1 and rows["default"].depth == 1 and rows["batch"].quantum == 5
    s.release("a", a.slot, a.generation, "completed", 600, 4)
    assert sorted(r.request_id for r in s.drain_cleanup(4)) == ["b", "c"]
    leases = {lease.request_id: lease.policy_class for lease in s.leases(5)}
    assert leases == {"b": "batch", "c": "default"}  # each keeps its class across the reorder


def test_session_cap_defers_excess_and_releases_in_arrival_order():
    cls = ClassConfig(name="agents", admission=AdmissionConfig(type="session_cap", max_active_per_session=1))
    s = _sched([cls])
    a = _one(s.enqueue(make_request("a", session_id="s"), 0))
    assert s.enqueue(make_request("b", session_id="s"), 1) == []
    assert s.enqueue(make_request("c", session_id="s"), 2) == []
    assert _one(s.enqueue(make_request("other", session_id="t"), 3)).request_id == "other"
    assert s.deferred == 2 and s.queued == 0
    s.release("a", a.slot, a.generation, "completed", 150, 4)
    got = s.drain_cleanup(4)
    assert [r.request_id for r in got] == ["b"]
    s.release("c", -1, 0, "cancelled", 0, 5)
    s.release("b", got[0].slot, got[0].generation, "aborted", 0, 6)
    assert s.drain_cleanup(6) == [] and s.deferred == 0


def test_kv_pressure_defers_above_high_water_and_resumes_below_low():
    cls = ClassConfig(
        name="default", admission=AdmissionConfig(type="kv_pressure", high_water_frac=0.5, low_water_frac=0.3)
    )
    s = _sched([cls], total_kv_blocks=100)
    a = _one(s.enqueue(make_request("a", isl_tokens=16 * 60), 0))  # 60 blocks booked > 50
    assert s.enqueue(make_request("b", isl_tokens=16), 1) == []
    assert s.deferred == 1
    assert s.tick(2) == []
    s.release("a", a.slot, a.generation, "completed", 0, 3)
    assert [r.request_id for r in s.drain_cleanup(3)] == ["b"]


def test_busy_worker_ratio_queues_when_share_of_busy_workers_reached():
    s = _sched([make_class("default", busy_worker_ratio=0.5, **BUSY_500)], workers=((1, 0), (2, 0)))
    _one(s.enqueue(make_request("a", isl_tokens=600), 0))
    assert s.enqueue(make_request("b"), 1) == []  # 1 of 2 busy >= 0.5


def test_all_overloaded_rejected_when_do_not_queue():
    from kvsched.config import OverloadConfig

    cfg = make_config(
        [make_class("default", prefill_busy_threshold=10_000)], overload=OverloadConfig(overload_prefill_tokens=100)
    )
    s = make_scheduler(cfg)
    _one(s.enqueue(make_request("a", isl_tokens=600), 0))
    assert _one(s.enqueue(make_request("b", do_not_queue=True), 1)).reason == "all_overloaded"
    assert s.enqueue(make_request("c"), 2) == [] and s.queued == 1  # a queueing class waits


def test_excluded_workers_never_chosen_and_pin_inside_them_rejected():
    s = _sched(workers=((1, 0), (2, 0), (3, 0)))
    for i in range(6):
        got = _one(s.enqueue(make_request(f"e{i}", isl_tokens=10, excluded_workers=frozenset({1, 3})), i))
        assert got.worker == WorkerKey(2, 0)
    bad = _one(s.enqueue(make_request("pin", pinned=WorkerKey(3, 0), excluded_workers=frozenset({3})), 9))
    assert bad.reason == "pinned_not_allowed"
    ok = _one(s.enqueue(make_request("pin2", pinned=WorkerKey(1, 0), excluded_workers=frozenset({3})), 9))
    assert ok.worker == WorkerKey(1, 0)
    none = _one(s.enqueue(make_request("all", excluded_workers=frozenset({1, 2, 3})), 10))
    assert none.reason == "no_endpoints"
    mixed = _one(s.enqueue(make_request("mix", allowed_workers=frozenset({1, 2}), excluded_workers=frozenset({2})), 11))
    assert mixed.worker == WorkerKey(1, 0)
