"""A deliberately simple reference model of PolicyQueue (plain lists, full scans, no indexes).

Used by the hypothesis state machines in test_policy_queue_model.py: the real PolicyQueue must
produce the same dispatch sequence. Worker readiness is instantaneous here; the real queue's
blocked-lane bookkeeping must be invisible as long as every readiness change is followed by
`on_capacity_change(worker)` (the Scheduler's contract). docs/DESIGN.md §4 is the only source.
"""

from __future__ import annotations

from dataclasses import dataclass, field

US_PER_S = 1_000_000


@dataclass
class MEntry:
    request_id: str
    seq: int
    arrival_us: int
    priority: int
    strict: int
    cost: int
    isl: int
    placement: object = None  # worker or None
    key: tuple = ()
    requeued: bool = False


@dataclass
class MClass:
    quantum: int
    ordering: str
    ready: list[MEntry] = field(default_factory=list)
    deferred: list[MEntry] = field(default_factory=list)
    deficit: int = 0


def model_key(ordering: str, e: MEntry) -> tuple:
    jump = max(0, e.priority)
    if ordering == "fcfs":  # a requeued entry: ahead of its strict tier's arrivals, by enqueue order
        if e.requeued:
            return (1, -e.strict, 0, e.seq)
        return (1, -e.strict, 1, e.arrival_us - jump * US_PER_S, e.seq)
    if ordering == "priority":
        return (1, -e.strict, e.priority, e.arrival_us, e.seq)
    return (1, -e.strict, -(1 + jump) / max(1, e.cost), e.seq)


class ModelPolicyQueue:
    def __init__(self, classes: list[tuple[int, str]]) -> None:
        self.classes = [MClass(q, o) for q, o in classes]
        self.cursor = 0
        self.carry: int | None = None

    def add(self, c: int, e: MEntry, deferred: bool = False) -> None:
        e.key = model_key(self.classes[c].ordering, e)
        (self.classes[c].deferred if deferred else self.classes[c].ready).append(e)

    def requeue(self, c: int, e: MEntry) -> None:
        e.requeued = True
        e.key = model_key(self.classes[c].ordering, e)
        self.classes[c].ready.append(e)

    def make_ready(self, c: int, rid: str, placement: object) -> bool:
        cl = self.classes[c]
        for e in cl.deferred:
            if e.request_id == rid:
                cl.deferred.remove(e)
                if placement is not None:
                    e.placement = placement
                cl.ready.append(e)
                return True
        for e in cl.ready:
            if e.request_id == rid and e.placement is None and placement is not None:
                cl.ready.remove(e)
                e.placement = placement
                e.key = model_key(cl.ordering, e)  # a requeued FCFS entry stays ahead of arrivals
                cl.ready.append(e)
                return True
        return False

    def cancel(self, c: int, rid: str) -> bool:
        cl = self.classes[c]
        for lst in (cl.ready, cl.deferred):
            for e in lst:
                if e.request_id == rid:
                    lst.remove(e)
                    if not cl.ready:
                        cl.deficit = 0
                        if self.carry == c:
                            self.carry = None
                    return True
        return False

    def candidate(self, c: int, worker_ready, shared_ok) -> MEntry | None:
        cl = self.classes[c]
        if not cl.ready:
            cl.deficit = 0
            return None
        shared = [e for e in cl.ready if e.placement is None]
        root = min(shared, key=lambda e: e.key) if shared else None
        lane_heads = []
        for w in {e.placement for e in cl.ready if e.placement is not None}:
            if worker_ready(c, w):
                lane_heads.append(min((e for e in cl.ready if e.placement == w), key=lambda e: e.key))
        best = min(lane_heads, key=lambda e: e.key) if lane_heads else None
        if root is not None and (best is None or root.key < best.key) and shared_ok(c, root):
            return root
        return best

    def pop_next(self, worker_ready, shared_ok) -> MEntry | None:
        n = len(self.classes)
        if self.carry is not None:
            cand = self.candidate(self.carry, worker_ready, shared_ok)
            if cand is not None and cand.cost <= self.classes[self.carry].deficit:
                return self._take(self.carry, cand)
            self.carry = None
        ring = [(self.cursor + k) % n for k in range(n)]
        cands = {c: self.candidate(c, worker_ready, shared_ok) for c in ring}
        cands = {c: e for c, e in cands.items() if e is not None}
        if not cands:
            return None
        for c in ring:
            if c in cands and cands[c].cost <= self.classes[c].deficit:
                return self._take(c, cands[c])
        for c in ring:
            if c in cands:
                self.classes[c].deficit += self.classes[c].quantum
                if cands[c].cost <= self.classes[c].deficit:
                    return self._take(c, cands[c])
        r = None
        for c in cands:
            cl = self.classes[c]
            need = cands[c].cost - cl.deficit
            k = (need + cl.quantum - 1) // cl.quantum
            r = k if r is None else min(r, k)
        for c in cands:
            self.classes[c].deficit += r * self.classes[c].quantum
        for c in ring:
            if c in cands and cands[c].cost <= self.classes[c].deficit:
                return self._take(c, cands[c])
        raise AssertionError("model: nothing affordable")

    def _take(self, c: int, e: MEntry) -> MEntry:
        cl = self.classes[c]
        cl.ready.remove(e)
        cl.deficit -= e.cost
        self.cursor = (c + 1) % len(self.classes)
        self.carry = c
        if not cl.ready:
            cl.deficit = 0
            self.carry = None
        return e

    def waiting_ids(self) -> set[str]:
        return {e.request_id for cl in self.classes for e in cl.ready + cl.deferred}


# ---- the whole scheduler, at the level of its contracts -----------------------------------------
@dataclass
class MRequest:
    pin: object  # WorkerKey or None
    allowed: frozenset | None  # worker ids or None
    state: str = "waiting"  # "waiting" (ready or deferred) | "leased"
    worker: object = None


class ModelScheduler:
    """Contract-level reference of `Scheduler` (no ordering, cost or selection): which workers are
    registered / drained, which request ids are live or still being cleaned up, and what every answer
    must satisfy. Contracts (docs/PROTOCOL.md "Scheduling contracts"):

    * an id is `duplicate_request` while live or until its cleanup reached the policies (drain / tick);
    * `no_endpoints` at enqueue exactly when no registered, undrained worker is within pin / allowed;
    * an admission runs on a registered, undrained worker within pin / allowed, whatever placement an
      admission policy asked for;
    * removing a worker answers `no_endpoints`, in that step, exactly the waiting requests no remaining
      registered worker (drained ones count) can take.
    """

    AFTER_DECIDE = ("do_not_queue", "queue_full")  # rejections after the policy decided (it is told)

    def __init__(self, workers) -> None:
        self.workers: dict = {w: False for w in workers}  # key -> drained
        self.live: dict[str, MRequest] = {}
        self.cleanup: set[str] = set()

    def placeable(self, pin, allowed, drained_count: bool = False) -> set:
        return {
            w
            for w, drained in self.workers.items()
            if (drained_count or not drained)
            and (pin is None or w == pin)
            and (allowed is None or w.worker_id in allowed)
        }

    def expect_enqueue(self, rid: str, pin, allowed) -> str | None:
        """The rejection reason the contracts force for this enqueue, or None (any other answer)."""
        if pin is not None and allowed is not None and pin.worker_id not in allowed:
            return "pinned_not_allowed"
        if rid in self.live or rid in self.cleanup:
            return "duplicate_request"
        if not self.placeable(pin, allowed):
            return "no_endpoints"
        return None

    def enqueued(self, rid: str, pin, allowed) -> None:
        self.live[rid] = MRequest(pin, allowed)

    def admitted(self, rid: str, worker) -> None:
        req = self.live.get(rid)
        assert req is not None and req.state == "waiting", f"admission of {rid} that is not waiting"
        assert worker in self.placeable(req.pin, req.allowed), f"{rid} admitted on {worker}, outside its workers"
        req.state, req.worker = "leased", worker

    def rejected(self, rid: str, reason: str, tracked: bool, at_enqueue: bool) -> None:
        req = self.live.pop(rid, None)
        assert req is not None and req.state == "waiting", f"rejection of {rid} that is not waiting"
        if not at_enqueue or reason == "overloaded" or (tracked and reason in self.AFTER_DECIDE):
            self.cleanup.add(rid)

    def released(self, rid: str) -> None:
        del self.live[rid]
        self.cleanup.add(rid)

    def requeued(self, rid: str) -> None:
        self.live[rid].state, self.live[rid].worker = "waiting", None

    def cleaned(self) -> None:
        """drain_cleanup / tick told the policies: every buffered id is reusable."""
        self.cleanup.clear()

    def remove(self, worker_id: int) -> set[str]:
        """Remove every rank of `worker_id`; returns the waiting ids that must be answered no_endpoints."""
        for w in [w for w in self.workers if w.worker_id == worker_id]:
            del self.workers[w]
        for rid, req in list(self.live.items()):
            if req.state == "leased" and req.worker.worker_id == worker_id:
                self.released(rid)
        return {
            rid
            for rid, req in self.live.items()
            if req.state == "waiting" and not self.placeable(req.pin, req.allowed, drained_count=True)
        }

    def waiting(self) -> set[str]:
        return {rid for rid, req in self.live.items() if req.state == "waiting"}

    def leased(self) -> set[str]:
        return {rid for rid, req in self.live.items() if req.state == "leased"}
