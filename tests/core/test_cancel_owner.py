"""A dead router's requests cancelled in bulk (`Scheduler.cancel_owner`) end exactly as releasing them one by
one does: the way the scheduler cancelled them before it had a bulk path, `release(..., "aborted")` per lease
and `release(request_id, -1, 0, "cancelled")` per waiting request, in the owner's request order.

Two twin schedulers run the same random operations (requests of three owners in two classes, one class with a
deferring, placing admission policy and per-connection shares of a queue limit, pinned lanes, a slot table
small enough that requests wait); then one owner's router dies: the first twin calls `cancel_owner`, the
second releases its requests one by one. Everything observable must then be equal, and stay equal while the
operations go on: the records returned, the admin views (queues, workers, leases), the waiting counts of
every owner and class, which ids are still being cleaned up, the policy events buffered and those the
policies received, in order.
"""

from __future__ import annotations

import random

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvsched.config import DaemonConfig
from kvsched.core.admission import AdmissionPolicy, Defer, MakeReady, Ready, Reconcile
from kvsched.core.live import LEASED
from kvsched.core.types import WorkerKey

from .factories import make_class, make_config, make_request, make_scheduler

WORKERS = ((1, 0), (2, 0), (2, 1))
KEYS = [WorkerKey(w, r) for w, r in WORKERS]
OWNERS = (1, 2, 3)
HOLDER = 9  # holds two workers busy from the start; never releases


class RecordingPolicy(AdmissionPolicy):
    """Defers a third of its requests and places some on a worker (valid or not), from a seeded RNG;
    records every event it is told, in order."""

    name = "recording"

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.deferred: list[str] = []
        self.log: list[tuple[str, str]] = []

    def decide(self, request_id, spec, fleet, now_us):
        r = self.rng.random()
        if r < 0.35:
            self.deferred.append(request_id)
            return Defer()
        return Ready(self.rng.choice([None, *KEYS, WorkerKey(9, 0)]) if r < 0.6 else None)

    def notify(self, ev, fleet, now_us):
        self.log.append((type(ev).__name__, getattr(ev, "request_id", "")))
        rid = getattr(ev, "request_id", None)
        if rid in self.deferred:
            self.deferred.remove(rid)
        if isinstance(ev, Reconcile) and self.deferred and self.rng.random() < 0.5:
            return [MakeReady(self.deferred.pop(0), self.rng.choice([None, *KEYS]))]
        return []

    def reconfigure(self, cfg):
        pass

    def tracked(self):
        return len(self.deferred)


def _twin(seed: int):
    classes = [
        make_class("a", prefill_busy_threshold=120, quantum=256),
        make_class("b", ordering="wspt", prefill_busy_threshold=120, quantum=128, request_queue_limit_per_worker=12),
    ]
    s = make_scheduler(make_config(classes, daemon=DaemonConfig(max_waiting_share=0.5)), workers=WORKERS, max_slots=12)
    for key in KEYS[:2]:  # two of the three workers busy for good: requests wait whenever the third is busy too
        assert (
            type(
                s.enqueue(
                    make_request(f"hold-{key.worker_id}-{key.dp_rank}", isl_tokens=400, owner=HOLDER, pinned=key), 0
                )[0]
            ).__name__
            == "Admit"
        )
    policy = s.pq.classes[0].admission = RecordingPolicy(seed)
    return s, policy


def _old_cancel_owner(s, owner: int, now_us: int) -> None:
    """How `cancel_owner` worked before its bulk path: one `release` per request of the owner."""
    table = s.lease_table
    for rid in list(table.by_owner.get(owner, ())):
        live = table.live[rid]
        if live.state == LEASED:
            s.release(rid, live.slot, live.generation, "aborted", 0, now_us)
        else:
            s.release(rid, -1, 0, "cancelled", 0, now_us)


def _observed(s, policy, now_us: int, ids: list[str]) -> tuple:
    """Everything a client, an operator or a policy can see of the scheduler."""
    n_classes = len(s.pq.classes)
    return (
        s.queues(now_us),
        s.workers(),
        s.leases(now_us),
        s.waiting,
        s.queued,
        s.deferred,
        s.active_leases,
        s.decisions_total,
        {(o, c): s.shares.of(o, c) for o in OWNERS for c in range(n_classes)},
        [s.cleanup_pending(rid) for rid in ids],
        [(c, type(e).__name__, e.request_id) for c, e in s.feed.events],
        list(policy.log),
        s.pq.cursor,
        s.pq.carry,
    )


OP = st.tuples(
    st.sampled_from(["enqueue"] * 8 + ["release", "prefill_done", "tick", "cancel", "drain"]),
    st.sampled_from(OWNERS),
    st.sampled_from(["a", "b"]),
    st.integers(1, 400),
    st.sampled_from([None, None, None, *KEYS]),
    st.integers(0, 10**6),
)


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    before=st.lists(OP, min_size=5, max_size=80),
    dead=st.sampled_from(OWNERS),
    after=st.lists(OP, max_size=30),
)
def test_cancel_owner_ends_requests_as_releasing_them_one_by_one(seed, before, dead, after):
    bulk, bulk_policy = _twin(seed)
    ref, ref_policy = _twin(seed)
    ids: list[str] = []
    leases: dict[str, tuple[int, int]] = {}
    now = 0

    def step(op) -> None:
        nonlocal now
        kind, owner, cls, isl, pin, k = op
        now += 1000
        outs = []
        for s in (bulk, ref):
            if kind == "enqueue":
                rid = f"r{len(ids)}"
                outs.append(
                    s.enqueue(make_request(rid, isl_tokens=isl, policy_class=cls, pinned=pin, owner=owner), now)
                )
            elif kind in ("release", "prefill_done") and leases:
                rid = sorted(leases)[k % len(leases)]
                slot, gen = leases[rid]
                if kind == "release":
                    outs.append(s.release(rid, slot, gen, "completed", 10, now))
                else:
                    outs.append(s.update(rid, slot, gen, "prefill_done", None, now))
            elif kind == "cancel":
                waiting = sorted(
                    set(s.lease_table.live) - {lv.spec.request_id for lv in s.lease_table.by_slot.values()}
                )
                if waiting:
                    outs.append(s.release(waiting[k % len(waiting)], -1, 0, "cancelled", 0, now))
            elif kind == "tick":
                outs.append(s.tick(now))
            else:
                outs.append(s.drain_cleanup(now))
        if kind == "enqueue":
            ids.append(f"r{len(ids)}")
        if kind == "release" and leases:
            del leases[sorted(leases)[k % len(leases)]]
        assert outs[:1] == outs[1:], (op, outs)
        for r in (outs[0] or []) if outs else []:
            if type(r).__name__ == "Admit":
                leases[r.request_id] = (r.slot, r.generation)
            elif r.request_id in leases and r.revoked:
                del leases[r.request_id]

    for op in before:
        step(op)
    assert _observed(bulk, bulk_policy, now, ids) == _observed(ref, ref_policy, now, ids)
    held = [bulk.lease_table.live[rid] for rid in bulk.lease_table.by_owner.get(dead, ())]
    event(
        f"dead owner's requests: {'leased ' if any(lv.state == LEASED for lv in held) else ''}"
        f"{'deferred ' if any(lv.state == 'deferred' for lv in held) else ''}"
        f"{'in a lane ' if any(lv.state == 'ready' and lv.entry.placement for lv in held) else ''}"
        f"{'in the shared heap' if any(lv.state == 'ready' and not lv.entry.placement for lv in held) else ''}"
    )

    now += 1000
    bulk.cancel_owner(dead, now)
    _old_cancel_owner(ref, dead, now)
    for rid in [rid for rid in leases if bulk.owner_of(rid) is None]:
        del leases[rid]
    assert bulk.owned_count(dead) == 0
    assert _observed(bulk, bulk_policy, now, ids) == _observed(ref, ref_policy, now, ids)
    assert bulk.drain_cleanup(now) == ref.drain_cleanup(now)
    assert _observed(bulk, bulk_policy, now, ids) == _observed(ref, ref_policy, now, ids)
    for op in after:
        step(op)
        assert _observed(bulk, bulk_policy, now, ids) == _observed(ref, ref_policy, now, ids)


def test_cancel_owner_of_a_flood_leaves_the_other_owners_queue_whole():
    """A dead flooder's 3,000 waiting requests (shared heap, a pinned lane, deferred) go at once; the other
    owner's requests keep their place, counts and order, and run when the workers free up."""
    s, _ = _twin(0)
    assert (
        type(s.enqueue(make_request("hold-2-1", isl_tokens=400, owner=HOLDER, pinned=KEYS[2]), 1)[0]).__name__
        == "Admit"
    )  # with `_twin`'s two: every worker busy, what follows waits
    mine = []
    for i in range(3000):
        cls = "b" if i % 3 == 0 else "a"
        out = s.enqueue(make_request(f"f{i}", owner=1, policy_class=cls, pinned=KEYS[1] if i % 7 == 0 else None), 2 + i)
        assert out == [] or out[0].reason == "queue_full", out
        if i % 50 == 0:
            rid = f"o{i}"
            if s.enqueue(make_request(rid, owner=2, policy_class="a"), 2 + i) == []:
                mine.append(rid)
    before = [s.owner_of(rid) for rid in mine]
    s.cancel_owner(1, 10_000)
    assert s.owned_count(1) == 0 and s.shares.of(1, 0) == (0, 0) and s.shares.of(1, 1) == (0, 0)
    assert [s.owner_of(rid) for rid in mine] == before == [2] * len(mine)
    assert sum(q.depth + q.deferred for q in s.queues(10_000)) == len(mine)
    for w, r in WORKERS:
        lease = next(x for x in s.leases(10_000) if x.request_id == f"hold-{w}-{r}")
        s.release(lease.request_id, lease.slot, lease.generation, "completed", 10, 10_001)
    s.drain_cleanup(10_001)
    admitted = {r.request_id for r in s.tick(10_002)} | {x.request_id for x in s.leases(10_002)}
    assert admitted and admitted <= set(mine)


def test_cancel_owner_resets_the_credit_of_a_class_it_empties():
    """DRR credit left over in a class whose ready requests were all the dead router's goes with them
    (docs/DESIGN.md §4.7: a class with no ready entry has no credit), as one-by-one cancels reset it."""
    bulk, _ = _twin(0)
    ref, _ = _twin(0)
    for s in (bulk, ref):
        s.pq.classes[0].admission = None
        assert (
            type(s.enqueue(make_request("hold-2-1", isl_tokens=400, owner=HOLDER, pinned=KEYS[2]), 1)[0]).__name__
            == "Admit"
        )
        for i in range(4):
            assert s.enqueue(make_request(f"f{i}", isl_tokens=50, owner=1, policy_class="a"), 2 + i) == []
        hold = next(x for x in s.leases(10) if x.request_id == "hold-2-1")
        s.release(hold.request_id, hold.slot, hold.generation, "completed", 10, 10)
        assert len(s.drain_cleanup(10)) == 3  # 3 x 50 prefill tokens before the worker is busy (> 120)
    assert bulk.queues(11)[0].deficit == 256 - 3 * 50 and bulk.queues(11)[0].depth == 1
    bulk.cancel_owner(1, 11)
    _old_cancel_owner(ref, 1, 11)
    assert bulk.queues(11)[0].deficit == ref.queues(11)[0].deficit == 0
    assert bulk.queues(11) == ref.queues(11)


def test_cancel_owner_ends_a_routers_requests_in_the_order_they_came():
    """The owner's requests are released in arrival order, leases and waiting ones alike, so the policies
    hear `Aborted` in that order and the freed slots are reused in the same order in every process (a set of
    ids would walk them in string-hash order, which changes with PYTHONHASHSEED)."""
    s, policy = _twin(3)
    policy.decide = lambda request_id, spec, fleet, now_us: Ready(None)  # every request tracked, none deferred
    came = []
    for i in range(40):
        rid = f"x{i * 7919 % 1000}"  # ids whose string order and hash order are not their arrival order
        s.enqueue(make_request(rid, isl_tokens=60, owner=2, policy_class="a"), 10 + i)
        came.append(rid)
    assert 0 < s.active_leases - 2 < 40 and s.waiting  # some leased (beside the holder's two), some waiting
    s.cancel_owner(2, 100)
    s.drain_cleanup(100)
    assert [rid for kind, rid in policy.log if kind == "Aborted"] == came
