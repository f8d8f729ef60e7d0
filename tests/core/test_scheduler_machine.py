"""Scheduler state machine: random enqueue / release / cancel / requeue / prefill_done / drain /
tick interleavings. Nothing lost (every request is waiting, leased, or answered exactly once),
nothing admitted twice, cancelled requests never admitted, ledger back to zero at the end."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvsched.config import AdmissionConfig
from kvsched.core.types import Admit, Reject, WorkerKey

from .factories import make_class, make_config, make_request, make_scheduler

WORKERS = ((1, 0), (2, 0), (2, 1))


class SchedulerMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        classes = [
            make_class("a", prefill_busy_threshold=300, quantum=256),
            make_class("b", ordering="wspt", prefill_busy_threshold=300, quantum=128, request_queue_limit_per_worker=3),
            make_class(
                "s", prefill_busy_threshold=300, admission=AdmissionConfig(type="session_cap", max_active_per_session=1)
            ),
        ]
        self.s = make_scheduler(make_config(classes), workers=WORKERS, max_slots=16)
        self.now = 0
        self.n = 0
        self.waiting: set[str] = set()
        self.leased: dict[str, Admit] = {}
        self.done: set[str] = set()

    def _absorb(self, records):
        for r in records:
            rid = r.request_id
            assert rid in self.waiting, f"answer for a request not waiting: {r}"
            self.waiting.discard(rid)
            if isinstance(r, Admit):
                self.leased[rid] = r
            else:
                assert isinstance(r, Reject)
                self.done.add(rid)

    def _tick(self):
        self.now += 1000
        return self.now

    @rule(
        cls=st.sampled_from(["a", "b", "s", ""]),
        isl=st.integers(1, 400),
        pin=st.sampled_from([None, None, *WORKERS]),
        session=st.sampled_from([None, "x", "y"]),
        dnq=st.booleans(),
    )
    def enqueue(self, cls, isl, pin, session, dnq):
        self.n += 1
        rid = f"r{self.n}"
        self.waiting.add(rid)
        spec = make_request(
            rid,
            isl_tokens=isl,
            policy_class=cls,
            pinned=WorkerKey(*pin) if pin else None,
            session_id=session,
            do_not_queue=dnq,
        )
        self._absorb(self.s.enqueue(spec, self._tick()))

    @precondition(lambda self: self.leased)
    @rule(data=st.data(), outcome=st.sampled_from(["completed", "aborted"]))
    def release(self, data, outcome):
        rid = data.draw(st.sampled_from(sorted(self.leased)))
        a = self.leased.pop(rid)
        self.s.release(rid, a.slot, a.generation, outcome, 10, self._tick())
        self.s.release(rid, a.slot, a.generation, outcome, 10, self.now)  # idempotent
        self.done.add(rid)

    @precondition(lambda self: self.leased)
    @rule(data=st.data(), kind=st.sampled_from(["prefill_done", "dispatched", "requeue"]))
    def update(self, data, kind):
        rid = data.draw(st.sampled_from(sorted(self.leased)))
        a = self.leased[rid]
        if kind == "requeue":
            del self.leased[rid]
            self.waiting.add(rid)
        self._absorb(self.s.update(rid, a.slot, a.generation, kind, None, self._tick()))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def cancel(self, data):
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        self.s.release(rid, -1, 0, "cancelled", 0, self._tick())
        self.waiting.discard(rid)
        self.done.add(rid)

    @rule()
    def drain(self):
        self._absorb(self.s.drain_cleanup(self._tick()))

    @rule()
    def tick(self):
        self._absorb(self.s.tick(self._tick()))

    @invariant()
    def accounted(self):
        if not hasattr(self, "s"):
            return
        assert self.s.active_leases == len(self.leased)
        assert self.s.queued + self.s.deferred == len(self.waiting)
        a = self.s.ledger.arrays
        assert a.w_active_requests.sum() == len(self.leased)

    def teardown(self):
        if not hasattr(self, "s"):
            return
        for _ in range(200):
            self._absorb(self.s.drain_cleanup(self._tick()))
            if not self.leased:
                break
            for rid, a in list(self.leased.items()):
                del self.leased[rid]
                self.s.release(rid, a.slot, a.generation, "completed", 0, self._tick())
        assert not self.leased and not self.waiting, (self.leased, self.waiting)
        a = self.s.ledger.arrays
        assert a.w_active_blocks.sum() == a.w_active_prefill.sum() == a.w_active_requests.sum() == 0


SchedulerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_scheduler_accounts_every_request_when_operations_interleave = SchedulerMachine.TestCase
