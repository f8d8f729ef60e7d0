"""RequestQueue (vLLM's interface, docs/DESIGN.md §4.5): orderings vs a sorted-list model, edge cases,
removal."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.core.ordering import QueueEntry
from kvsched.core.request_queue import create_request_queue

from .factories import make_entry
from .model import MEntry, model_key

POLICIES = ["fcfs", "priority", "wspt"]


def _model_order(policy: str, entries: list[QueueEntry]) -> list[str]:
    keyed = [
        (
            model_key(
                policy,
                MEntry(e.request_id, e.enqueue_seq, e.arrival_us, e.priority, e.strict_priority, e.cost, e.isl_tokens),
            ),
            e.request_id,
        )
        for e in entries
    ]
    return [rid for _, rid in sorted(keyed)]


entry_fields = st.tuples(st.integers(-2, 3), st.integers(0, 2), st.integers(1, 5000), st.integers(0, 5_000_000))


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(POLICIES),
    fields=st.lists(entry_fields, max_size=40),
    removals=st.sets(st.integers(0, 39)),
    pops=st.integers(0, 10),
)
def test_order_matches_sorted_list_model_when_adding_removing_popping(policy, fields, removals, pops):
    q = create_request_queue(policy)
    entries = [make_entry(priority=p, strict_priority=s, cost=c, arrival_us=a) for p, s, c, a in fields]
    for e in entries:
        q.add_request(e)
    gone = q.discard_requests({entries[i].request_id for i in removals if i < len(entries)})
    q.compact()
    live = [e for e in entries if e not in gone]
    expected = _model_order(policy, live)
    assert [e.request_id for e in q] == expected
    assert len(q) == len(expected) and bool(q) == bool(expected)
    popped = [q.pop_request().request_id for _ in range(min(pops, len(expected)))]
    assert popped == expected[: len(popped)]
    assert [e.request_id for e in q] == expected[len(popped) :]


@pytest.mark.parametrize("policy", POLICIES)
def test_peek_and_pop_raise_index_error_when_empty(policy):
    q = create_request_queue(policy)
    with pytest.raises(IndexError, match="peek from an empty queue"):
        q.peek_request()
    with pytest.raises(IndexError, match="pop from an empty queue"):
        q.pop_request()
    assert not q and len(q) == 0 and list(q) == []


def test_create_request_queue_raises_value_error_when_policy_unknown():
    with pytest.raises(ValueError, match="lifo"):
        create_request_queue("lifo")


@pytest.mark.parametrize("policy", POLICIES)
def test_discard_ignores_absent_ids_and_discard_entry_only_the_very_entry(policy):
    q = create_request_queue(policy)
    a = make_entry("a")
    q.add_request(a)
    assert q.discard_requests(["b"]) == [] and len(q) == 1
    assert not q.discard_entry(make_entry("a"))  # same id, another entry: it stays
    assert q.get("a") is a and "a" in q
    assert q.discard_entry(a) and "a" not in q and q.get("a") is None
    assert not q.discard_entry(a) and q.discard_requests(["a"]) == []


def test_add_request_raises_value_error_when_id_already_queued():
    q = create_request_queue("fcfs")
    q.add_request(make_entry("a"))
    with pytest.raises(ValueError):
        q.add_request(make_entry("a"))


def test_iter_does_not_mutate_when_called_twice():
    q = create_request_queue("priority")
    for p in (3, 1, 2):
        q.add_request(make_entry(f"p{p}", priority=p))
    assert [e.request_id for e in q] == ["p1", "p2", "p3"]
    assert [e.request_id for e in q] == ["p1", "p2", "p3"]
    assert len(q) == 3


def test_wspt_orders_by_uncached_tokens_when_raw_isl_differs():
    q = create_request_queue("wspt")
    q.add_request(make_entry("big_but_cached", isl_tokens=8000, cost=100))
    q.add_request(make_entry("small_uncached", isl_tokens=1000, cost=1000))
    assert q.peek_request().request_id == "big_but_cached"


def test_fcfs_jump_moves_request_earlier_when_priority_positive():
    q = create_request_queue("fcfs")
    q.add_request(make_entry("old", arrival_us=0))
    q.add_request(make_entry("jumper", arrival_us=500_000, priority=1))  # 1 s jump
    q.add_request(make_entry("negative", arrival_us=1, priority=-5))  # clamps to 0
    assert [e.request_id for e in q] == ["jumper", "old", "negative"]


def test_strict_priority_outranks_score_when_set():
    q = create_request_queue("wspt")
    q.add_request(make_entry("cheap", cost=1))
    q.add_request(make_entry("strict", cost=10_000, strict_priority=1))
    assert q.peek_request().request_id == "strict"


def test_heap_compacts_when_many_removed():
    q = create_request_queue("fcfs")
    entries = [make_entry() for _ in range(1000)]
    for e in entries:
        q.add_request(e)
    for e in entries[:990]:
        q.discard_requests([e])
        q.compact()
    assert len(q._heap) <= 2 * len(q) + 33
    assert [e.request_id for e in q] == [e.request_id for e in entries[990:]]
