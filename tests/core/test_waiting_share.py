"""One connection holds at most `max_waiting_share` of each limit of a class (property test against
a counting model): past it `overloaded`, and counts always equal the owner's waiting requests."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.config import DaemonConfig
from kvsched.core.types import Admit, Reject
from tests.core.factories import make_class, make_config, make_request, make_scheduler

NOW = 1_000_000


def _sched(share: float = 0.5, req_limit: int = 10, isl_limit=None):
    cls = make_class(prefill_busy_threshold=100, request_queue_limit_per_worker=req_limit,
                     isl_token_queue_limit_per_worker=isl_limit)
    cfg = make_config([cls], daemon=DaemonConfig(max_waiting_share=share))
    return make_scheduler(cfg, max_num_batched_tokens=100_000)


def test_a_flooding_owner_is_capped_at_its_share_and_others_still_queue():
    s = _sched()
    assert isinstance(s.enqueue(make_request("blocker", isl_tokens=500, owner=1), NOW)[0], Admit)  # busy now
    answers = [s.enqueue(make_request(f"f{i}", owner=1), NOW) for i in range(8)]
    assert all(a == [] for a in answers[:5])  # 5 = 0.5 x limit 10 x 1 worker id
    for a in answers[5:]:
        assert isinstance(a[0], Reject) and a[0].reason == "overloaded" and a[0].limit == 5 and a[0].current == 5
    assert [s.enqueue(make_request(f"g{i}", owner=2), NOW) for i in range(5)] == [[]] * 5  # its own share
    assert s.enqueue(make_request("f-late", owner=1), NOW)[0].reason == "overloaded"
    s.release("f0", -1, 0, "cancelled", 0, NOW)  # one of owner 1's leaves: room for one more
    assert s.enqueue(make_request("f-again", owner=1), NOW) == []


def test_share_one_means_only_the_class_limit():
    s = _sched(share=1.0)
    s.enqueue(make_request("blocker", isl_tokens=500, owner=1), NOW)
    answers = [s.enqueue(make_request(f"f{i}", owner=1), NOW) for i in range(11)]
    assert answers[9] == [] and answers[10][0].reason == "queue_full"


def test_isl_token_share():
    s = _sched(req_limit=None, isl_limit=1000)
    s.enqueue(make_request("blocker", isl_tokens=500, owner=1), NOW)
    assert s.enqueue(make_request("a", isl_tokens=499, owner=1), NOW) == []
    assert s.enqueue(make_request("b", isl_tokens=10, owner=1), NOW) == []  # 499 < 500: accepted, crosses
    got = s.enqueue(make_request("c", isl_tokens=10, owner=1), NOW)[0]
    assert got.reason == "overloaded" and got.limit_kind == "isl_tokens" and got.limit == 500


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["enq", "enq", "cancel", "owner_gone"]),
                          st.integers(1, 3), st.integers(0, 30)), max_size=60))
def test_counts_follow_the_waiting_requests_of_each_owner(ops):
    """Model: the count of an owner equals its requests in state ready/deferred, never negative, and
    an enqueue is refused `overloaded` exactly when the owner already holds its share (5)."""
    s = _sched()
    s.enqueue(make_request("blocker", isl_tokens=500, owner=99), NOW)
    waiting: dict[int, set[str]] = {1: set(), 2: set(), 3: set()}
    t = NOW
    for i, (op, owner, k) in enumerate(ops):
        t += 1
        if op == "enq":
            rid = f"r{i}"
            before = len(waiting[owner])
            out = s.enqueue(make_request(rid, owner=owner), t)
            total = sum(len(w) for w in waiting.values())
            if before >= 5:
                assert out and out[0].reason == "overloaded"
            elif total >= 10:
                assert out and out[0].reason == "queue_full"
            else:
                assert out == []
                waiting[owner].add(rid)
        elif op == "cancel" and waiting[owner]:
            rid = sorted(waiting[owner])[k % len(waiting[owner])]
            s.release(rid, -1, 0, "cancelled", 0, t)
            waiting[owner].discard(rid)
        elif op == "owner_gone":
            s.cancel_owner(owner, t)
            waiting[owner].clear()
        for o in (1, 2, 3):
            assert s.shares.of(o, 0)[0] == len(waiting[o])
