"""`max_waiting_share` is work-conserving (docs/DESIGN.md §5.9), checked against a plain-Python model.

The rule, per class and per limit kind (requests, ISL tokens), with share = max(1, floor(max_waiting_share
x class limit)): alone, a connection may fill the class limit; while another connection has requests
waiting in the class, one holding its share or more is refused `overloaded`; a connection below its share
is accepted in a full class while another holds more than its share, up to one share past the limit.
"""

from __future__ import annotations

import math

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvsched.config import DaemonConfig
from kvsched.core.types import Admit, Reject, WorkerKey
from tests.core.factories import make_class, make_config, make_request, make_scheduler

NOW = 1_000_000
BLOCKER_OWNER = 99  # holds one lease per worker (never waiting): every request after it waits


def _sched(share: float = 0.5, req_limit: int | None = 10, isl_limit: int | None = None, n_workers: int = 1):
    """A scheduler whose `n_workers` workers are all busy (one leased blocker each), so requests wait."""
    cls = make_class(
        prefill_busy_threshold=100, request_queue_limit_per_worker=req_limit, isl_token_queue_limit_per_worker=isl_limit
    )
    cfg = make_config([cls], daemon=DaemonConfig(max_waiting_share=share))
    workers = tuple((w, 0) for w in range(1, n_workers + 1))
    s = make_scheduler(cfg, workers=workers, max_num_batched_tokens=100_000)
    for w, _ in workers:
        got = s.enqueue(make_request(f"blocker-{w}", isl_tokens=500, owner=BLOCKER_OWNER, pinned=WorkerKey(w, 0)), NOW)
        assert isinstance(got[0], Admit)
    return s


def _reason(out) -> str | None:
    """None when the request was accepted to wait, else its rejection reason."""
    if out == []:
        return None
    assert len(out) == 1 and isinstance(out[0], Reject), out
    return out[0].reason


class ShareModel:
    """The rule in plain Python over a list of waiting requests; no counters, no incremental state."""

    def __init__(self, share: float, req_limit: int | None, isl_limit: int | None, n_workers: int) -> None:
        self.share = share
        self.limits = {
            "requests": None if req_limit is None else req_limit * n_workers,
            "isl_tokens": None if isl_limit is None else isl_limit * n_workers,
        }
        self.waiting: dict[str, tuple[int, int]] = {}  # request_id -> (owner, isl_tokens)

    def held(self, owner: int | None, kind: str) -> int:
        """What `owner` (None: everybody) holds of `kind`: waiting requests or their ISL tokens."""
        return sum(1 if kind == "requests" else isl for o, isl in self.waiting.values() if owner in (None, o))

    def share_of(self, kind: str) -> int:
        return max(1, math.floor(self.share * self.limits[kind]))

    def decide(self, owner: int, isl: int) -> tuple[str, str, int, int] | None:
        """(reason, limit_kind, current, limit) of the refusal, or None (accepted)."""
        kinds = [k for k, v in self.limits.items() if v is not None]
        capped = self.share < 1.0
        others = {o for o, _ in self.waiting.values() if o != owner}
        for kind in kinds:
            if capped and others and self.held(owner, kind) >= self.share_of(kind):
                return ("overloaded", kind, self.held(owner, kind), self.share_of(kind))
        for kind in kinds:
            mine, s = self.held(owner, kind), self.share_of(kind)
            overrun = capped and mine < s and any(self.held(o, kind) > s for o in others)
            limit = self.limits[kind]
            if self.held(None, kind) >= limit + (s if overrun else 0):
                return ("queue_full", kind, self.held(None, kind), limit)
        return None


def test_a_lone_connection_fills_the_class_limit_then_gets_queue_full():
    s = _sched(share=0.5, req_limit=10)
    answers = [_reason(s.enqueue(make_request(f"f{i}", owner=1), NOW)) for i in range(13)]
    assert answers == [None] * 10 + ["queue_full"] * 3


def test_a_second_connection_gets_its_share_past_a_full_class_and_the_first_is_held_back():
    """1. owner 1 alone fills the class (10 of limit 10), 2. owner 2 asks for 7. Result: owner 2 gets its
    share (5, the limit overrun by one share), then `overloaded`; owner 1 is `overloaded` while it holds
    more than its share and owner 2 waits; a third owner gets `queue_full` (the overrun is spent); once
    owner 1 is back under its share it is accepted again."""
    s = _sched(share=0.5, req_limit=10)
    for i in range(10):
        assert s.enqueue(make_request(f"a{i}", owner=1), NOW) == []
    answers = [s.enqueue(make_request(f"b{i}", owner=2), NOW) for i in range(7)]
    assert [_reason(a) for a in answers] == [None] * 5 + ["overloaded"] * 2
    assert (answers[5][0].limit_kind, answers[5][0].current, answers[5][0].limit) == ("requests", 5, 5)
    late = s.enqueue(make_request("a-late", owner=1), NOW)[0]
    assert (late.reason, late.current, late.limit) == ("overloaded", 10, 5)
    third = s.enqueue(make_request("c0", owner=3), NOW)[0]
    assert (third.reason, third.current, third.limit) == ("queue_full", 15, 10)
    for i in range(6):  # owner 1 leaves down to 4 of its share of 5; the class holds 9 < 10
        s.release(f"a{i}", -1, 0, "cancelled", 0, NOW)
    assert s.enqueue(make_request("a-again", owner=1), NOW) == []
    assert s.shares.of(1, 0) == (5, 500) and s.shares.of(2, 0) == (5, 500)  # both at their shares
    assert _reason(s.enqueue(make_request("a-more", owner=1), NOW)) == "overloaded"
    assert _reason(s.enqueue(make_request("b-more", owner=2), NOW)) == "overloaded"
    assert _reason(s.enqueue(make_request("c1", owner=3), NOW)) == "queue_full"  # full, nobody over its share


def test_share_one_means_only_the_class_limit():
    s = _sched(share=1.0)
    answers = [s.enqueue(make_request(f"f{i}", owner=1), NOW) for i in range(11)]
    assert answers[9] == [] and answers[10][0].reason == "queue_full"
    assert _reason(s.enqueue(make_request("g", owner=2), NOW)) == "queue_full"


def test_isl_token_share_is_checked_before_adding():
    s = _sched(req_limit=None, isl_limit=1000)
    assert s.enqueue(make_request("g", isl_tokens=10, owner=2), NOW) == []  # another connection waits
    assert s.enqueue(make_request("a", isl_tokens=499, owner=1), NOW) == []
    assert s.enqueue(make_request("b", isl_tokens=10, owner=1), NOW) == []  # 499 < 500: accepted, crosses
    got = s.enqueue(make_request("c", isl_tokens=10, owner=1), NOW)[0]
    assert (got.reason, got.limit_kind, got.current, got.limit) == ("overloaded", "isl_tokens", 509, 500)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["enq", "enq", "enq", "cancel", "owner_gone"]),
        st.integers(1, 3),
        st.integers(1, 300),
        st.integers(0, 30),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(
    share=st.sampled_from([0.1, 0.25, 0.3, 0.5, 0.7, 1.0]),
    req_limit=st.one_of(st.none(), st.integers(1, 8)),
    isl_limit=st.one_of(st.none(), st.integers(50, 1500)),
    n_workers=st.integers(1, 2),
    ops=OPS,
)
def test_the_scheduler_follows_the_share_model(share, req_limit, isl_limit, n_workers, ops):
    """Every answer (reason, limit kind, figures) equals the model's, per-owner counts equal the owner's
    waiting requests, and the rule's bounds hold: overrun by at most one share (a request that crosses a
    limit is accepted, as with the class limits), `overloaded` only while another connection waits."""
    s = _sched(share, req_limit, isl_limit, n_workers)
    m = ShareModel(share, req_limit, isl_limit, n_workers)
    for i, (op, owner, isl, k) in enumerate(ops):
        mine = sorted(rid for rid, (o, _) in m.waiting.items() if o == owner)
        if op == "enq":
            rid = f"r{i}"
            alone = all(o == owner for o, _ in m.waiting.values())
            want = m.decide(owner, isl)
            out = s.enqueue(make_request(rid, isl_tokens=isl, owner=owner), NOW + i)
            event("accepted" if want is None else want[0])
            if want is None and m.held(None, "requests") >= (m.limits["requests"] or math.inf):
                event("accepted past the requests limit")
            if want is None:
                assert out == [], out
                m.waiting[rid] = (owner, isl)
            else:
                got = out[0]
                assert (got.reason, got.limit_kind, got.current, got.limit) == want
                assert not (alone and got.reason == "overloaded")
        elif op == "cancel" and mine:
            rid = mine[k % len(mine)]
            s.release(rid, -1, 0, "cancelled", 0, NOW + i)
            del m.waiting[rid]
        elif op == "owner_gone":
            s.cancel_owner(owner, NOW + i)
            m.waiting = {rid: v for rid, v in m.waiting.items() if v[0] != owner}
        for o in (1, 2, 3):
            assert s.shares.of(o, 0) == (m.held(o, "requests"), m.held(o, "isl_tokens"))
        if req_limit is not None and share < 1.0:
            assert m.held(None, "requests") <= m.limits["requests"] + m.share_of("requests")
