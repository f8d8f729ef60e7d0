"""The whole Scheduler against the contract-level reference model (tests/core/model.py
`ModelScheduler`) over random interleavings of enqueue (request ids drawn from a small pool, so ids
are reused), release, cancel, requeue, prefill_done, drain, tick, worker add / remove / drain /
undrain, and an admission policy that asks for random placements (valid, outside the pin or allowed
set, or onto unregistered workers) and defers at random.

Checked at every step: forced rejection reasons (duplicate while live or being cleaned up,
no_endpoints, pinned_not_allowed), `cleanup_pending` equal to the model's, every admission on a
registered, undrained worker within the request's pin and allowed set, worker removal answering
exactly the stranded requests, nothing lost, nothing answered twice; at the end everything drains
and the ledger is back to zero."""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvsched.core.admission import Aborted, AdmissionPolicy, Completed, Defer, MakeReady, Ready, Reconcile
from kvsched.core.types import Admit, Reject, WorkerKey

from .factories import make_class, make_config, make_request, make_scheduler
from .model import ModelScheduler

KEYS = [WorkerKey(1, 0), WorkerKey(2, 0), WorkerKey(2, 1), WorkerKey(3, 0)]
START = KEYS[:3]
IDS = [f"r{i}" for i in range(8)]
ALLOWED = st.sampled_from([None, None, frozenset({1}), frozenset({2}), frozenset({1, 3}), frozenset({2, 3})])


class RandomPlacementPolicy(AdmissionPolicy):
    """Ready(any), Ready(a random worker — valid or not) or Defer at random; deferred requests are
    released at random on Reconcile (to a random worker or anywhere), all of them once `flush`."""

    name = "random_placement"

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.deferred: list[str] = []
        self.flush = False

    def _where(self):
        return self.rng.choice([None, None, *KEYS, WorkerKey(9, 0)])

    def decide(self, request_id, spec, fleet, now_us):
        r = self.rng.random()
        if r < 0.3:
            self.deferred.append(request_id)
            return Defer()
        return Ready(self._where() if r < 0.7 else None)

    def notify(self, event, fleet, now_us):
        if isinstance(event, (Completed, Aborted)):
            if event.request_id in self.deferred:
                self.deferred.remove(event.request_id)
            return []
        if not isinstance(event, Reconcile) or not self.deferred:
            return []
        if self.flush:
            out, self.deferred = [MakeReady(rid) for rid in self.deferred], []
            return out
        if self.rng.random() < 0.5:
            return [MakeReady(self.deferred.pop(0), self._where())]
        return []

    def reconfigure(self, cfg):
        pass

    def tracked(self):
        return len(self.deferred)


class SchedulerModelMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**16))
    def setup(self, seed):
        classes = [
            make_class("a", prefill_busy_threshold=300, quantum=256),
            make_class("b", ordering="wspt", prefill_busy_threshold=300, quantum=128),
        ]
        self.s = make_scheduler(make_config(classes), workers=START, max_slots=64)
        self.policy = self.s.pq.classes[0].admission = RandomPlacementPolicy(seed)
        self.m = ModelScheduler(START)
        self.leases: dict[str, Admit] = {}
        self.now = 0

    def _t(self) -> int:
        self.now += 1000
        return self.now

    def _absorb(self, records, enqueued: str | None = None, tracked: bool = False):
        seen = set()
        for r in records:
            assert r.request_id not in seen, f"two answers for {r.request_id} in one step"
            seen.add(r.request_id)
            if isinstance(r, Admit):
                self.m.admitted(r.request_id, r.worker)
                self.leases[r.request_id] = r
            else:
                assert isinstance(r, Reject) and not r.revoked
                at_enqueue = r.request_id == enqueued
                assert r.reason != "no_endpoints" or not at_enqueue, "no_endpoints although a worker is placeable"
                self.m.rejected(r.request_id, r.reason, tracked, at_enqueue)

    @rule(
        rid=st.sampled_from(IDS),
        cls=st.sampled_from(["a", "b"]),
        isl=st.integers(1, 400),
        pin=st.sampled_from([None, None, None, *KEYS]),
        allowed=ALLOWED,
        dnq=st.integers(0, 5),
    )
    def enqueue(self, rid, cls, isl, pin, allowed, dnq):
        want = self.m.expect_enqueue(rid, pin, allowed)
        spec = make_request(
            rid, isl_tokens=isl, policy_class=cls, pinned=pin, allowed_workers=allowed, do_not_queue=dnq == 0
        )
        got = self.s.enqueue(spec, self._t())
        if want is not None:
            assert [(r.request_id, getattr(r, "reason", None)) for r in got] == [(rid, want)], (want, got)
            return
        self.m.enqueued(rid, pin, allowed)
        self._absorb(got, enqueued=rid, tracked=cls == "a")

    @precondition(lambda self: self.m.leased())
    @rule(data=st.data(), outcome=st.sampled_from(["completed", "aborted"]))
    def release(self, data, outcome):
        rid = data.draw(st.sampled_from(sorted(self.m.leased())))
        a = self.leases.pop(rid)
        self.s.release(rid, a.slot, a.generation, outcome, 10, self._t())
        self.s.release(rid, a.slot, a.generation, outcome, 10, self.now)  # idempotent
        self.m.released(rid)

    @precondition(lambda self: self.m.leased())
    @rule(data=st.data(), kind=st.sampled_from(["prefill_done", "requeue"]))
    def update(self, data, kind):
        rid = data.draw(st.sampled_from(sorted(self.m.leased())))
        a = self.leases[rid]
        if kind == "requeue":
            del self.leases[rid]
            self.m.requeued(rid)
        self._absorb(self.s.update(rid, a.slot, a.generation, kind, None, self._t()))

    @precondition(lambda self: self.m.waiting())
    @rule(data=st.data())
    def cancel(self, data):
        rid = data.draw(st.sampled_from(sorted(self.m.waiting())))
        self.s.release(rid, -1, 0, "cancelled", 0, self._t())
        self.m.released(rid)

    @rule()
    def drain(self):
        self.m.cleaned()
        self._absorb(self.s.drain_cleanup(self._t()))

    @rule()
    def tick(self):
        self.m.cleaned()
        self._absorb(self.s.tick(self._t()))

    @precondition(lambda self: len(self.m.workers) < len(KEYS))
    @rule(data=st.data())
    def add_worker(self, data):
        key = data.draw(st.sampled_from([k for k in KEYS if k not in self.m.workers]))
        self.s.add_worker(key, 1000, 1000)
        self.m.workers[key] = False

    @precondition(lambda self: self.m.workers)
    @rule(data=st.data())
    def remove_worker(self, data):
        wid = data.draw(st.sampled_from(sorted({k.worker_id for k in self.m.workers})))
        lost = {rid for rid, a in self.leases.items() if a.worker.worker_id == wid}
        for rid in lost:
            del self.leases[rid]
        stranded = self.m.remove(wid)
        got = self.s.remove_worker(wid, None, self._t())
        assert all(isinstance(r, Reject) and r.reason == "no_endpoints" for r in got)
        assert {r.request_id for r in got if r.revoked} == lost  # each lease's holder is told
        assert {r.request_id for r in got if not r.revoked} == stranded
        self._absorb([r for r in got if not r.revoked])

    @precondition(lambda self: self.m.workers)
    @rule(data=st.data())
    def toggle_drain(self, data):
        key = data.draw(st.sampled_from(sorted(self.m.workers)))
        drained = not self.m.workers[key]
        self.m.workers[key] = drained
        self._absorb(self.s.set_drained(key.worker_id, key.dp_rank, drained, self._t()))

    @invariant()
    def agrees_with_model(self):
        if not hasattr(self, "s"):
            return
        assert {rid for rid in IDS if self.s.cleanup_pending(rid)} == self.m.cleanup
        assert self.s.active_leases == len(self.m.leased()) == len(self.leases)
        assert self.s.queued + self.s.deferred == len(self.m.waiting())
        for rid in self.m.waiting():  # nobody waits for a worker that was removed
            req = self.m.live[rid]
            assert self.m.placeable(req.pin, req.allowed, drained_count=True), rid

    def teardown(self):
        if not hasattr(self, "s"):
            return
        for key, drained in list(self.m.workers.items()):
            if drained:
                self.m.workers[key] = False
                self._absorb(self.s.set_drained(key.worker_id, key.dp_rank, False, self._t()))
        self.policy.flush = True
        for _ in range(100):
            self.m.cleaned()
            self._absorb(self.s.tick(self._t()))
            for rid, a in list(self.leases.items()):
                del self.leases[rid]
                self.s.release(rid, a.slot, a.generation, "completed", 0, self._t())
                self.m.released(rid)
            if not self.m.live:
                break
        assert not self.m.live, self.m.live
        a = self.s.ledger.arrays
        assert a.w_active_blocks.sum() == a.w_active_prefill.sum() == a.w_active_requests.sum() == 0


SchedulerModelMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
test_scheduler_keeps_its_contracts_when_workers_policies_and_ids_change = SchedulerModelMachine.TestCase
