"""The scheduler's guardrails, one focused test each: request-id reuse only after cleanup, worker
removal, validated policy placements, WSPT cost over placeable workers, requeue order and its own
speculative overlap, overload vs queueing, do_not_queue figures, forward-only token counts, blocked
lanes, compaction per cleanup batch, side-effect free selectors.

Contracts: docs/PROTOCOL.md "Scheduling contracts"; Dynamo kv-router scheduling guardrails (request
ids, selectors without side effects, WSPT over the best allowed worker); vLLM `request_queue.py`
(prepend / requeue order)."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.config import AdmissionConfig, ClassConfig, OverloadConfig
from kvsched.core.admission import AdmissionPolicy, Defer, MakeReady, Ready
from kvsched.core.types import Admit, Reject, WorkerKey

from .factories import make_class, make_config, make_request, make_scheduler

BUSY_500 = dict(prefill_busy_threshold=500)
W1, W2 = WorkerKey(1, 0), WorkerKey(2, 0)


def _one(records):
    assert len(records) == 1, records
    return records[0]


def _sched(classes=None, **kw):
    return make_scheduler(make_config(classes or [make_class("default", **BUSY_500)]), **kw)


def _ids(records):
    return [(r.request_id, r.reason if isinstance(r, Reject) else str(r.worker)) for r in records]


class ScriptedPolicy(AdmissionPolicy):
    """A test policy: `decide` answers from `decisions` (default Ready()); `notify` answers once
    with `answers` (then nothing)."""

    name = "scripted"

    def __init__(self, decisions=None, answers=None):
        self.decisions = dict(decisions or {})
        self.answers = list(answers or [])
        self.events = []

    def decide(self, request_id, spec, fleet, now_us):
        return self.decisions.get(request_id, Ready())

    def notify(self, event, fleet, now_us):
        self.events.append(event)
        out, self.answers = self.answers, []
        return out

    def reconfigure(self, cfg):
        pass

    def tracked(self):
        return 0


# ---- 1. request ids -----------------------------------------------------------------------------
def test_reenqueue_of_released_id_is_duplicate_until_cleanup_reaches_session_cap():
    s = _sched([ClassConfig(name="agents", admission=AdmissionConfig(type="session_cap", max_active_per_session=1))])
    a = _one(s.enqueue(make_request("a", session_id="s"), 0))
    assert s.enqueue(make_request("b", session_id="s"), 1) == []  # deferred behind a
    s.release("a", a.slot, a.generation, "completed", 100, 2)
    again = _one(s.enqueue(make_request("a", session_id="s"), 3))
    assert (again.reason, s.active_leases) == ("duplicate_request", 0)  # never two leases of one session
    assert s.cleanup_pending("a")
    assert _ids(s.drain_cleanup(4)) == [("b", "1:0")]
    assert not s.cleanup_pending("a")
    assert s.enqueue(make_request("a", session_id="s"), 5) == []  # now waits its turn behind b
    assert s.active_leases == 1 and s.deferred == 1


def test_cancelled_and_resent_id_is_answered_under_kv_pressure():
    cls = ClassConfig(
        name="default", admission=AdmissionConfig(type="kv_pressure", high_water_frac=0.5, low_water_frac=0.3)
    )
    s = _sched([cls], total_kv_blocks=100)
    big = _one(s.enqueue(make_request("big", isl_tokens=16 * 60), 0))  # 60 of 100 blocks booked
    assert s.enqueue(make_request("x", isl_tokens=16), 1) == []  # deferred
    s.release("x", -1, 0, "cancelled", 0, 2)
    assert _one(s.enqueue(make_request("x", isl_tokens=16), 3)).reason == "duplicate_request"
    s.drain_cleanup(4)
    assert s.enqueue(make_request("x", isl_tokens=16), 5) == []  # deferred again, now tracked
    assert s.pq.classes[0].admission.tracked() == 1
    s.release("big", big.slot, big.generation, "completed", 0, 6)
    assert _ids(s.drain_cleanup(6)) == [("x", "1:0")]


def test_rejected_tracked_request_id_is_duplicate_until_its_abort_reaches_the_policy():
    cls = ClassConfig(
        name="agents",
        request_queue_limit_per_worker=0,
        admission=AdmissionConfig(type="session_cap", max_active_per_session=1),
    )
    s = _sched([cls])
    a = _one(s.enqueue(make_request("a", session_id="s"), 0))
    assert _one(s.enqueue(make_request("b", session_id="s"), 1)).reason == "queue_full"
    assert _one(s.enqueue(make_request("b", session_id="s"), 2)).reason == "duplicate_request"
    s.drain_cleanup(3)
    assert _one(s.enqueue(make_request("b", session_id="s"), 4)).reason == "queue_full"  # asked again
    assert a.request_id == "a"


# ---- 2. worker removal --------------------------------------------------------------------------
def test_remove_worker_answers_every_request_left_without_a_placeable_worker():
    session = ClassConfig(name="s", admission=AdmissionConfig(type="session_cap", max_active_per_session=1))
    s = _sched([make_class("default", **BUSY_500), session], workers=((1, 0), (2, 0), (3, 0)))
    for w in (W1, W2, WorkerKey(3, 0)):
        _one(s.enqueue(make_request(f"fill{w.worker_id}", isl_tokens=600, pinned=w), 0))
    assert s.enqueue(make_request("only1", allowed_workers=frozenset({1})), 1) == []
    assert s.enqueue(make_request("any"), 2) == []
    assert s.enqueue(make_request("pin1", pinned=W1), 3) == []
    s.set_drained(3, None, True, 4)
    assert s.enqueue(make_request("on13", allowed_workers=frozenset({1, 3})), 5) == []
    _one(s.enqueue(make_request("sess0", policy_class="s", session_id="k", pinned=W2), 6))
    assert s.enqueue(make_request("sess1", policy_class="s", session_id="k", allowed_workers=frozenset({1})), 7) == []
    got = [r for r in s.remove_worker(1, None, 8) if not r.revoked]  # the revocation of fill1 aside
    assert sorted(_ids(got)) == [("only1", "no_endpoints"), ("pin1", "no_endpoints"), ("sess1", "no_endpoints")]
    assert s.queued == 2 and s.deferred == 0  # "any" and "on13" (worker 3 is only drained) keep waiting
    fill2 = next(lease for lease in s.leases(9) if lease.request_id == "fill2")
    s.release("fill2", fill2.slot, fill2.generation, "completed", 0, 9)
    assert _ids(s.drain_cleanup(9)) == [("any", "2:0")]  # no stale head blocks the shared heap


def test_policy_placed_request_returns_to_the_shared_heap_when_its_worker_is_removed():
    s = _sched(workers=((1, 0), (2, 0)))
    policy = s.pq.classes[0].admission = ScriptedPolicy({"placed": Ready(W1)})
    for w in (W1, W2):
        _one(s.enqueue(make_request(f"fill{w.worker_id}", isl_tokens=600, pinned=w), 0))
    assert s.enqueue(make_request("placed"), 1) == []
    assert [(r.request_id, r.revoked) for r in s.remove_worker(1, None, 2)] == [("fill1", True)]
    fill2 = next(lease for lease in s.leases(3) if lease.request_id == "fill2")
    s.release("fill2", fill2.slot, fill2.generation, "completed", 0, 3)
    assert _ids(s.drain_cleanup(3)) == [("placed", "2:0")]
    assert policy is s.pq.classes[0].admission


# ---- 3. admission-policy placements -------------------------------------------------------------
@pytest.mark.parametrize(
    "spec_kw, placement, expect",
    [
        (dict(pinned=W1), W2, "1:0"),  # a placement never overrides the request's pin
        (dict(allowed_workers=frozenset({1})), W2, "1:0"),  # nor its allowed set
        ({}, WorkerKey(9, 0), None),  # nor names an unregistered worker
    ],
)
def test_invalid_ready_placement_is_ignored_counted_and_noted(spec_kw, placement, expect):
    s = _sched(workers=((1, 0), (2, 0)))
    s.pq.classes[0].admission = ScriptedPolicy({"r": Ready(placement)})
    got = _one(s.enqueue(make_request("r", **spec_kw), 0))
    assert isinstance(got, Admit)
    if expect is not None:
        assert str(got.worker) == expect
    assert s.invalid_placements == 1
    notes = s.take_notices()
    assert len(notes) == 1 and str(placement) in notes[0]
    assert s.take_notices() == []


def test_invalid_placement_does_not_stall_other_classes_when_its_worker_is_free():
    s = _sched([make_class("a", **BUSY_500), make_class("b", **BUSY_500)], workers=((1, 0), (2, 0)))
    s.pq.classes[0].admission = ScriptedPolicy({"r": Ready(W2)})
    _one(s.enqueue(make_request("fill1", isl_tokens=600, pinned=W1), 0))
    fill2 = _one(s.enqueue(make_request("fill2", isl_tokens=600, pinned=W2), 0))
    assert s.enqueue(make_request("r", policy_class="a", allowed_workers=frozenset({1})), 1) == []
    assert s.enqueue(make_request("other", policy_class="b"), 2) == []
    s.release("fill2", fill2.slot, fill2.generation, "completed", 0, 3)
    assert _ids(s.drain_cleanup(3)) == [("other", "2:0")]  # r (allowed only on busy worker 1) waits


def test_invalid_make_ready_placement_releases_deferred_request_to_its_own_place():
    s = _sched(workers=((1, 0), (2, 0)))
    policy = s.pq.classes[0].admission = ScriptedPolicy({"d": Defer()})
    assert s.enqueue(make_request("d", pinned=W1), 0) == []
    assert s.deferred == 1
    policy.answers = [MakeReady("d", W2)]  # answered at the next notify
    got = s.tick(1)
    assert _ids(got) == [("d", "1:0")] and s.invalid_placements == 1


# ---- 4. WSPT cost over placeable workers --------------------------------------------------------
def test_wspt_cost_uses_cached_tokens_of_placeable_worker_when_all_overloaded():
    cfg = make_config(
        [make_class("default", ordering="wspt", prefill_busy_threshold=10_000)],
        overload=OverloadConfig(overload_prefill_tokens=100),
    )
    s = make_scheduler(cfg)
    hashes = list(range(1, 38))
    warm = _one(s.enqueue(make_request("warm", isl_tokens=600, block_hashes=hashes), 0))  # overloads worker 1
    assert s.enqueue(make_request("raw_small", isl_tokens=300), 1) == []
    assert s.enqueue(make_request("cached_big", isl_tokens=600, block_hashes=hashes), 2) == []
    s.release("warm", warm.slot, warm.generation, "completed", 0, 3)
    got = s.drain_cleanup(3)
    assert got[0].request_id == "cached_big" and got[0].cached_tokens == 592


# ---- 5. requeue ---------------------------------------------------------------------------------
@pytest.mark.parametrize("order", [("a", "b", "c"), ("c", "b", "a")])
def test_requeues_in_one_step_come_back_in_their_original_order(order):
    s = _sched()
    leases = {}
    for i, rid in enumerate("abc"):
        leases[rid] = _one(s.enqueue(make_request(rid, isl_tokens=200), i))
        s.update(rid, leases[rid].slot, leases[rid].generation, "prefill_done", None, i)
    block = _one(s.enqueue(make_request("block", isl_tokens=600), 5))  # class busy from here
    for rid in order:
        assert s.update(rid, leases[rid].slot, leases[rid].generation, "requeue", None, 6) == []
    s.update("block", block.slot, block.generation, "prefill_done", None, 7)
    assert [r.request_id for r in s.drain_cleanup(7)] == ["a", "b", "c"]


def _event_fed_scheduler():
    from kvsched.core.create import create_scheduler
    from kvsched.core.ledger import Ledger
    from kvsched.shm.layout import LedgerArrays
    from kvsched.shm.overlap import OverlapIndex

    cfg = make_config([make_class("default", **BUSY_500)])
    ledger = Ledger(LedgerArrays.private(8, 64, 64, block_size=16))
    s = create_scheduler(
        cfg, ledger=ledger, overlap=OverlapIndex(8, 1024), event_device=OverlapIndex(8, 1024), add_workers=False
    )
    s.add_worker(W1, 1000, 1000)
    s.set_event_fed(ledger.row_of(W1), True)
    return s


@pytest.mark.parametrize("make", [_sched, _event_fed_scheduler], ids=["approximate", "event_fed"])
def test_requeued_request_is_not_credited_with_its_own_speculative_overlap(make):
    s = make()
    first = _one(s.enqueue(make_request("r", isl_tokens=160, block_hashes=list(range(1, 11))), 0))
    assert first.overlap_blocks == 0
    again = _one(s.update("r", first.slot, first.generation, "requeue", None, 1))
    assert (again.overlap_blocks, again.cached_tokens) == (0, 0)
    assert int(s.ledger.arrays.w_active_prefill.sum()) == 160  # its prefill is booked again


def test_requeue_keeps_overlap_written_by_another_admission():
    s = _sched()
    hashes = list(range(1, 11))
    warm = _one(s.enqueue(make_request("warm", isl_tokens=160, block_hashes=hashes), 0))
    s.release("warm", warm.slot, warm.generation, "completed", 160, 1)
    s.drain_cleanup(1)
    r = _one(s.enqueue(make_request("r", isl_tokens=160, block_hashes=hashes), 2))
    again = _one(s.update("r", r.slot, r.generation, "requeue", None, 3))
    assert r.overlap_blocks == again.overlap_blocks == 10  # warm's admission wrote them, not r's


# ---- 6. overload vs queueing --------------------------------------------------------------------
def test_non_queueing_class_rejects_all_overloaded_at_once_and_queueing_class_waits():
    cfg = make_config(
        [make_class("fast"), make_class("batch", prefill_busy_threshold=10_000)],
        overload=OverloadConfig(overload_prefill_tokens=100),
    )
    s = make_scheduler(cfg)
    big = _one(s.enqueue(make_request("big", isl_tokens=600, policy_class="batch"), 0))
    r = _one(s.enqueue(make_request("f", policy_class="fast"), 1))
    assert r.reason == "all_overloaded"
    assert s.enqueue(make_request("w", policy_class="batch"), 2) == []
    assert _one(s.enqueue(make_request("p", policy_class="fast", pinned=WorkerKey(9, 0)), 3)).reason == "no_endpoints"
    assert _one(s.enqueue(make_request("d", policy_class="batch", do_not_queue=True), 4)).reason == "all_overloaded"
    s.update("big", big.slot, big.generation, "prefill_done", None, 5)  # worker 1 recovers
    assert _ids(s.drain_cleanup(5)) == [("w", "1:0")]


# ---- 7. do_not_queue figures --------------------------------------------------------------------
def test_do_not_queue_rejection_carries_requests_waiting_ahead_and_why():
    s = _sched()
    _one(s.enqueue(make_request("run", isl_tokens=600), 0))
    assert s.enqueue(make_request("q1"), 1) == []
    assert s.enqueue(make_request("q2"), 2) == []
    r = _one(s.enqueue(make_request("d", do_not_queue=True), 3))
    assert (r.reason, r.current) == ("do_not_queue", 2)
    assert "busy" in r.detail and "2 requests" in r.detail


def test_busy_detail_counts_the_eligible_workers_above_either_threshold():
    """The busy rule (tokens or a fraction of the row's batch budget, whichever is set) counts the
    eligible workers above it; the do_not_queue detail names that count, and a pinned request waits
    in its worker's lane until that worker alone is no longer above it."""
    w1, w2 = WorkerKey(1, 0), WorkerKey(2, 0)
    for busy in (dict(prefill_busy_threshold=500), dict(prefill_busy_threshold_frac=0.5)):
        s = _sched([make_class("default", **busy)], workers=((1, 0), (2, 0)))
        a = _one(s.enqueue(make_request("a", isl_tokens=600, pinned=w1), 0))
        r = _one(s.enqueue(make_request("d1", do_not_queue=True), 1))  # 1 of 2 busy: the class is not
        assert isinstance(r, Admit) and r.worker == w2, busy
        r = _one(s.enqueue(make_request("d2", isl_tokens=600, do_not_queue=True), 2))
        assert isinstance(r, Admit) and r.worker == w2, busy  # w2 at 100 tokens: under either threshold
        r = _one(s.enqueue(make_request("d3", do_not_queue=True), 3))
        assert r.reason == "do_not_queue" and "(2 of 2 eligible workers above" in r.detail, (busy, r.detail)
        assert s.enqueue(make_request("p1", pinned=w1), 4) == []  # its lane: w1 is above the threshold
        got = s.update("a", a.slot, a.generation, "prefill_done", None, 5) + s.drain_cleanup(6)
        assert [x.request_id for x in got] == ["p1"], busy


def test_do_not_queue_detail_names_the_backlog_when_not_busy():
    s = _sched()
    run = _one(s.enqueue(make_request("run", isl_tokens=600), 0))
    assert s.enqueue(make_request("q1"), 1) == []
    s.update("run", run.slot, run.generation, "prefill_done", None, 2)  # not busy; no pass ran yet
    r = _one(s.enqueue(make_request("d", do_not_queue=True), 3))
    assert (r.reason, r.current) == ("do_not_queue", 1) and "backlog" in r.detail


# ---- 8. forward-only token count ----------------------------------------------------------------
def test_lower_progress_value_is_ignored():
    s = _sched()
    a = _one(s.enqueue(make_request("a", isl_tokens=100), 0))
    s.update("a", a.slot, a.generation, "progress", 40, 1)
    blocks = int(s.ledger.arrays.w_active_blocks.sum())
    s.update("a", a.slot, a.generation, "progress", 5, 2)
    assert s.ledger.slot_info(a.slot).output_tokens == 40
    assert int(s.ledger.arrays.w_active_blocks.sum()) == blocks


def test_lower_progress_word_is_ignored_when_folded():
    from kvsched.shm.progress import write_progress

    s, progress = _progress_scheduler(workers=(W1,))
    a = _one(s.enqueue(make_request("a", isl_tokens=100), 0))
    write_progress(progress, a.slot, a.generation, 40)
    s.tick(1)
    blocks = int(s.ledger.arrays.w_active_blocks.sum())
    write_progress(progress, a.slot, a.generation, 5)
    s.tick(2)
    assert s.ledger.slot_info(a.slot).output_tokens == 40
    assert int(s.ledger.arrays.w_active_blocks.sum()) == blocks


# ---- 9. blocked lanes ---------------------------------------------------------------------------
def _progress_scheduler(workers):
    from kvsched.core.create import create_scheduler
    from kvsched.core.ledger import Ledger
    from kvsched.shm.layout import LedgerArrays
    from kvsched.shm.overlap import OverlapIndex

    cfg = make_config([make_class("default", **BUSY_500)])
    progress = np.zeros(64, np.uint64)
    ledger = Ledger(LedgerArrays.private(8, 64, 64, block_size=16), progress=progress)
    s = create_scheduler(cfg, ledger=ledger, overlap=OverlapIndex(8, 1024), add_workers=False)
    for w in workers:
        s.add_worker(w, 1000, 1000)
    return s, progress


def test_blocked_lane_is_rechecked_only_when_its_own_worker_changes():
    from kvsched.shm.progress import write_progress

    w7, w9 = WorkerKey(7, 0), WorkerKey(9, 0)
    s, progress = _progress_scheduler((w7, w9))
    _one(s.enqueue(make_request("fill7", isl_tokens=600, pinned=w7), 0))
    f9 = _one(s.enqueue(make_request("fill9", isl_tokens=600, pinned=w9), 0))
    assert s.enqueue(make_request("for7", pinned=w7), 1) == []
    assert s.enqueue(make_request("for9", pinned=w9), 1) == []
    write_progress(progress, f9.slot, f9.generation, 1)  # worker 9's prefill is done
    assert _ids(s.tick(2)) == [("for9", "9:0")]
    assert w7 in s.pq.classes[0].blocked_workers
    checked = []
    real = s.admitter.lane_ready
    s.admitter.lane_ready = lambda c, w: checked.append(w) or real(c, w)
    for n in (40, 80, 120):  # worker 9 decodes: its capacity changes, worker 7's does not
        write_progress(progress, f9.slot, f9.generation, n)
        s.tick(3 + n)
    assert w7 not in checked
    assert w7 in s.pq.classes[0].blocked_workers


# ---- 10. compaction per cleanup batch -----------------------------------------------------------
def test_one_compaction_per_class_when_a_batch_cancels_many_requests(monkeypatch):
    import heapq

    from kvsched.core import request_queue

    s = _sched()
    _one(s.enqueue(make_request("run", isl_tokens=600), 0))
    for i in range(1000):
        assert s.enqueue(make_request(f"q{i}"), 1 + i) == []
    count = []

    class CountingHeapq:
        def __getattr__(self, name):
            return getattr(heapq, name)

        @staticmethod
        def heapify(x):
            count.append(len(x))
            heapq.heapify(x)

    monkeypatch.setattr(request_queue, "heapq", CountingHeapq())
    for i in range(1000):
        s.release(f"q{i}", -1, 0, "cancelled", 0, 2000)
    s.drain_cleanup(2000)
    assert len(count) <= 1 and s.queued == 0
    assert len(s.pq.classes[0].pending._heap) <= 32  # dead items were compacted away


# ---- 12. selectors are side-effect free: the cache_aware baseline's tests are in tests/bench/test_baselines.py


def test_requeued_request_stays_behind_a_higher_strict_priority_tier():
    s = _sched()
    a = _one(s.enqueue(make_request("a", isl_tokens=200), 0))
    s.update("a", a.slot, a.generation, "prefill_done", None, 0)
    block = _one(s.enqueue(make_request("block", isl_tokens=600), 1))  # class busy from here
    assert s.enqueue(make_request("urgent", strict_priority=1), 2) == []
    assert s.enqueue(make_request("later"), 3) == []
    assert s.update("a", a.slot, a.generation, "requeue", None, 4) == []
    s.update("block", block.slot, block.generation, "prefill_done", None, 5)
    assert [r.request_id for r in s.drain_cleanup(5)] == ["urgent", "a", "later"]
