"""PolicyQueue vs the simple reference model (tests/core/model.py) over random interleavings of
enqueue / defer / pop / cancel / requeue / capacity changes / MakeReady: same dispatch sequence,
nothing lost, nothing dispatched twice."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvsched.config import ClassConfig
from kvsched.core.ordering import QueueEntry
from kvsched.core.policy_queue import PolicyQueue
from kvsched.core.types import WorkerKey

from .model import MEntry, ModelPolicyQueue

WORKERS = [WorkerKey(7, 0), WorkerKey(9, 0), WorkerKey(9, 1)]
placements = st.sampled_from([None, None, *WORKERS])


class PolicyQueueMachine(RuleBasedStateMachine):
    @initialize(
        specs=st.lists(
            st.tuples(st.sampled_from([64, 128, 512, 1000]), st.sampled_from(["fcfs", "priority", "wspt"])),
            min_size=1,
            max_size=3,
        )
    )
    def setup(self, specs):
        self.real = PolicyQueue([ClassConfig(name=f"c{i}", quantum=q, ordering=o) for i, (q, o) in enumerate(specs)])
        self.model = ModelPolicyQueue(specs)
        self.n_classes = len(specs)
        self.ready = {w: True for w in WORKERS}
        self.shared_ok = [True] * len(specs)
        self.entries: dict[str, tuple[QueueEntry, MEntry]] = {}
        self.waiting: set[str] = set()
        self.out: set[str] = set()  # dispatched and not requeued
        self.dispatched: list[str] = []
        self.seq = 0

    def _worker_ready(self, c, w):
        return self.ready[w]

    def _shared(self, c, e):
        return self.shared_ok[c]

    @rule(
        c=st.integers(0, 2),
        placement=placements,
        priority=st.integers(-1, 3),
        strict=st.integers(0, 1),
        cost=st.integers(1, 1200),
        deferred=st.booleans(),
    )
    def enqueue(self, c, placement, priority, strict, cost, deferred):
        c %= self.n_classes
        self.seq += 1
        rid = f"r{self.seq}"
        arrival = self.seq * 300_000
        real = QueueEntry(
            rid,
            enqueue_seq=self.seq,
            arrival_us=arrival,
            priority=priority,
            strict_priority=strict,
            cost=cost,
            isl_tokens=cost,
            placement=placement,
        )
        model = MEntry(rid, self.seq, arrival, priority, strict, cost, cost, placement)
        if deferred:
            assert self.real.defer(c, real, 1) is None
        else:
            assert self.real.enqueue(c, real, 1) is None
        self.model.add(c, model, deferred)
        self.entries[rid] = (real, model)
        self.waiting.add(rid)

    @rule(n=st.integers(1, 4))
    def pop(self, n):
        for _ in range(n):
            got = self.real.pop_next(self._worker_ready, self._shared)
            want = self.model.pop_next(self._worker_ready, self._shared)
            assert (got and got.request_id) == (want and want.request_id)
            if got is None:
                return
            assert got.request_id not in self.out, "dispatched twice"
            self.out.add(got.request_id)
            self.waiting.discard(got.request_id)
            self.dispatched.append(got.request_id)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def cancel(self, data):
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        real, _model = self.entries[rid]
        assert self.real.remove(real)
        assert self.model.cancel(real.class_idx, rid)
        self.waiting.discard(rid)

    @precondition(lambda self: self.out)
    @rule(data=st.data())
    def requeue(self, data):
        rid = data.draw(st.sampled_from(sorted(self.out)))
        real, model = self.entries[rid]
        self.real.requeue(real)
        self.model.requeue(real.class_idx, model)
        self.out.discard(rid)
        self.waiting.add(rid)

    @rule(w=st.sampled_from(WORKERS))
    def toggle_worker(self, w):
        self.ready[w] = not self.ready[w]
        self.real.on_capacity_change(w)

    @rule(c=st.integers(0, 2))
    def toggle_shared(self, c):
        self.shared_ok[c % self.n_classes] = not self.shared_ok[c % self.n_classes]

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), placement=placements)
    def make_ready(self, data, placement):
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        real, _ = self.entries[rid]
        c = real.class_idx
        moved = self.real.classes[c].make_ready(rid, placement) is not None
        assert moved == self.model.make_ready(c, rid, placement)

    @invariant()
    def same_contents(self):
        if not hasattr(self, "real"):
            return
        real_ids = {e.request_id for cq in self.real.classes for e in cq.iter_all()}
        assert real_ids == self.model.waiting_ids() == self.waiting
        for cq, mc in zip(self.real.classes, self.model.classes, strict=True):
            assert cq.n_ready == len(mc.ready)
            assert cq.deficit == mc.deficit
            assert cq.n_waiting == len(mc.ready) + len(mc.deferred)


PolicyQueueMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
test_policy_queue_matches_model_when_operations_interleave = PolicyQueueMachine.TestCase
