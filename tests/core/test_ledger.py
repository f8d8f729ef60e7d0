"""Ledger: bookings, incremental aggregates with live-prefix dedup, workers (docs/DESIGN.md §3.1, §4.2)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.config import OverloadConfig
from kvsched.core.ledger import Ledger
from kvsched.core.types import WorkerKey
from kvsched.shm.layout import LedgerArrays
from tests.shm.reference import ref_live_count

B = 4


def make_ledger(*, workers=2, register=None, slots=8, max_blocks=8, ref_capacity=64, overload=None, progress=False):
    arrays = LedgerArrays.private(workers, slots, max_blocks, ref_capacity, B)
    prog = np.zeros(slots, np.uint64) if progress else None
    ledger = Ledger(arrays, prog, overload)
    rows = [ledger.add_worker(WorkerKey(10 + i, 0), 100, 64) for i in range(workers if register is None else register)]
    return ledger, rows


def book(ledger, rid, row, isl, hashes, cached=0):
    return ledger.reserve(rid, row, isl, np.array(hashes, np.uint64), cached, None, 0, 0, 1)


def info(ledger, row):
    """The admin socket's row of worker row `row` (`Ledger.worker_rows`: flags, load)."""
    a = ledger.arrays
    key = (int(a.w_worker_id[row]), int(a.w_dp_rank[row]))
    return next(w for w in ledger.worker_rows() if (w.worker_id, w.dp_rank) == key)


def aggregates(ledger):
    a = ledger.arrays
    return a.w_active_blocks.copy(), a.w_active_prefill.copy(), a.w_active_requests.copy()


def assert_zero(ledger):
    a = ledger.arrays
    assert not a.w_active_blocks.any() and not a.w_active_prefill.any() and not a.w_active_requests.any()
    assert not a.ref_counts.any()


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([8, 256]),
    st.lists(
        st.tuples(st.integers(0, 1), st.integers(1, 40), st.integers(0, 6), st.integers(0, 30), st.integers(0, 2)),
        max_size=40,
    ),
)
def test_random_reserve_release_returns_aggregates_to_zero(ref_capacity, ops):
    """Random bookings (shared prefixes, progress, prefill_done), then release all. With a large
    refcount table the incremental aggregates also equal a from-scratch rebuild; a tiny one (8)
    exercises the full-table path, where only the return to zero is promised."""
    ledger, rows = make_ledger(slots=6, max_blocks=4, ref_capacity=ref_capacity)
    live = []
    for i, (row, isl, prefix, out, action) in enumerate(ops):
        nh = min(prefix, -(-isl // B))
        res = book(ledger, f"r{i}", rows[row], isl, range(nh))
        if res is None:
            assert ledger.n_free_slots() == 0
            slot, gen = live.pop(0)
            assert ledger.release(slot, gen)
            continue
        live.append(res)
        if action == 1:
            ledger.output_tokens_row(*res, out)
        elif action == 2:
            ledger.prefill_done(*res)
        blocks = ledger.arrays.w_active_blocks
        assert (blocks >= 0).all() and (ledger.arrays.w_active_prefill >= 0).all()
    if ref_capacity == 256:
        before = aggregates(ledger)
        ledger.rebuild_aggregates()
        for got, want in zip(aggregates(ledger), before, strict=True):
            assert np.array_equal(got, want)
    for slot, gen in reversed(live):
        assert ledger.release(slot, gen)
    assert_zero(ledger)
    assert ledger.n_free_slots() == 6


def test_shared_prefix_counts_once_when_two_requests_on_one_worker():
    ledger, (r0, _r1) = make_ledger()
    book(ledger, "a", r0, 16, [1, 2, 3, 4])
    blocks, prefill, reqs = aggregates(ledger)
    assert (blocks[r0], prefill[r0], reqs[r0]) == (4, 16, 1)
    book(ledger, "b", r0, 24, [1, 2, 3, 9, 10, 11])
    blocks, prefill, reqs = aggregates(ledger)
    assert (blocks[r0], prefill[r0], reqs[r0]) == (4 + 3, 40, 2)
    eligible = np.ones(2, np.uint8)
    out_blocks, _, _ = ledger.project(
        np.array([1, 2, 3, 4, 5], np.uint64), 20, np.zeros(2, np.int32), eligible, 1.0, 1.0
    )
    assert out_blocks.tolist() == [7 + 5 - 4, 0 + 5]
    assert (
        ref_live_count(ledger.arrays.ref_keys[r0], ledger.arrays.ref_counts[r0], np.arange(1, 5, dtype=np.uint64)) == 4
    )


def test_unhashed_prompt_blocks_count_as_unique_when_hashes_short_or_truncated():
    ledger, (r0, _) = make_ledger(max_blocks=2)
    slot, _ = book(ledger, "a", r0, 20, [1, 2, 3])  # 5 prompt blocks, only 2 hashes stored (max_blocks=2)
    book(ledger, "b", r0, 20, [1, 2, 3])
    assert ledger.arrays.w_active_blocks[r0] == 2 + 3 + 3
    assert ledger.slot_info(slot).request_id == "a"


def test_decode_blocks_grow_when_output_tokens_grow():
    ledger, (r0, _) = make_ledger()
    slot, gen = book(ledger, "a", r0, 6, [1])  # 2 prompt blocks (1 hashed, 1 partial)
    assert ledger.arrays.w_active_blocks[r0] == 2
    ledger.output_tokens_row(slot, gen, 2)  # 8 tokens -> 2 blocks
    assert ledger.arrays.w_active_blocks[r0] == 2
    ledger.output_tokens_row(slot, gen, 3)  # 9 tokens -> 3 blocks
    assert ledger.arrays.w_active_blocks[r0] == 3
    ledger.output_tokens_row(slot, gen, 30)  # 36 tokens -> 9 blocks
    assert ledger.arrays.w_active_blocks[r0] == 9
    assert ledger.release(slot, gen)
    assert_zero(ledger)


def test_prefill_cleared_when_prefill_done_or_first_token():
    ledger, (r0, _) = make_ledger()
    s1 = book(ledger, "a", r0, 30, [1, 2], cached=8)
    s2 = book(ledger, "b", r0, 10, [7])
    assert ledger.arrays.w_active_prefill[r0] == 22 + 10
    assert ledger.prefill_done(*s1)
    assert ledger.arrays.w_active_prefill[r0] == 10
    assert ledger.slot_info(s1[0]).state == 3
    ledger.output_tokens_row(*s2, 1)
    assert ledger.arrays.w_active_prefill[r0] == 0
    assert ledger.dispatched(*s1)  # no state regression after prefill_done
    assert ledger.slot_info(s1[0]).state == 3


def test_remove_worker_releases_bookings_and_bumps_generation():
    ledger, (r0, r1) = make_ledger()
    s1 = book(ledger, "a", r0, 16, [1, 2])
    s2 = book(ledger, "b", r0, 16, [1, 3])
    s3 = book(ledger, "c", r1, 16, [1])
    gen_before = int(ledger.arrays.w_generation[r0])
    assert sorted(ledger.remove_worker_row(r0)) == sorted([s1[0], s2[0]])
    blocks, prefill, reqs = aggregates(ledger)
    assert (blocks[r0], prefill[r0], reqs[r0]) == (0, 0, 0)
    assert reqs[r1] == 1
    assert not ledger.release(*s1)  # already released
    assert ledger.row_of(WorkerKey(10, 0)) is None and ledger.n_worker_ids() == 1
    again = ledger.add_worker(WorkerKey(10, 0), 100, 64)
    assert again == r0 and int(ledger.arrays.w_generation[r0]) == gen_before + 1
    assert ledger.release(*s3)
    assert_zero(ledger)


def test_release_is_noop_when_generation_is_stale():
    ledger, (r0, _) = make_ledger()
    slot, gen = book(ledger, "a", r0, 16, [1])
    assert not ledger.release(slot, gen + 1)
    assert ledger.output_tokens_row(slot, gen + 1, 5) == -1
    assert not ledger.prefill_done(slot, gen + 1)
    assert ledger.arrays.w_active_requests[r0] == 1
    assert ledger.release(slot, gen)
    assert not ledger.release(slot, gen)
    assert not ledger.release(-1, 0) and not ledger.release(10**6, 1)


def test_reserve_returns_none_when_slots_exhausted():
    ledger, (r0, _) = make_ledger(slots=2)
    assert book(ledger, "a", r0, 4, [1]) is not None
    assert book(ledger, "b", r0, 4, [1]) is not None
    assert book(ledger, "c", r0, 4, [1]) is None
    with pytest.raises(ValueError):
        book(ledger, "a", r0, 4, [1])


def test_add_worker_raises_when_duplicate_or_full():
    ledger, _ = make_ledger(workers=2)
    with pytest.raises(ValueError, match="already"):
        ledger.add_worker(WorkerKey(10, 0), 1, 1)
    with pytest.raises(ValueError, match="max_workers=2 reached"):
        ledger.add_worker(WorkerKey(99, 0), 1, 1)


def test_eligible_mask_filters_drained_overloaded_allowed_and_pinned():
    ledger, (r0, r1) = make_ledger(workers=3, register=2, overload=OverloadConfig(overload_prefill_tokens=50))
    out = np.zeros(3, np.uint8)
    assert ledger.eligible_mask(None, None, out) == 2 and out.tolist() == [1, 1, 0]
    ledger.set_drained(r0, True)
    assert info(ledger, r0).drained and ledger.eligible_mask(None, None, out) == 1 and out.tolist() == [0, 1, 0]
    ledger.set_drained(r0, False)
    slot, gen = book(ledger, "big", r1, 60, [])
    assert info(ledger, r1).overloaded and ledger.eligible_mask(None, None, out) == 1
    ledger.prefill_done(slot, gen)
    assert not info(ledger, r1).overloaded
    assert ledger.eligible_mask(None, frozenset({11}), out) == 1 and out.tolist() == [0, 1, 0]
    assert ledger.eligible_mask(WorkerKey(10, 0), None, out) == 1 and out.tolist() == [1, 0, 0]
    assert ledger.eligible_mask(WorkerKey(77, 0), None, out) == 0


def test_overload_on_active_blocks_fraction():
    ledger, (r0, _) = make_ledger(overload=OverloadConfig(overload_active_blocks_frac=0.1))  # 10 of 100
    slot, gen = book(ledger, "a", r0, 40, [])
    assert not info(ledger, r0).overloaded
    ledger.output_tokens_row(slot, gen, 4)
    assert info(ledger, r0).overloaded
    ledger.release(slot, gen)
    assert not info(ledger, r0).overloaded


def test_rebuild_aggregates_and_adoption_when_restarted():
    ledger, (r0, r1) = make_ledger(progress=True)
    book(ledger, "a", r0, 16, [1, 2, 3])
    s2 = book(ledger, "b", r0, 16, [1, 2, 9])
    book(ledger, "c", r1, 8, [4])
    ledger.output_tokens_row(*s2, 7)
    want = aggregates(ledger)
    keys, counts = ledger.arrays.ref_keys.copy(), ledger.arrays.ref_counts.copy()
    ledger.arrays.w_active_blocks[:] = 999
    ledger.arrays.ref_counts[:] = 0
    fresh = Ledger(ledger.arrays, ledger.progress)  # a new daemon adopts the same arrays
    fresh.rebuild_aggregates()
    for got, exp in zip(aggregates(fresh), want, strict=True):
        assert np.array_equal(got, exp)
    assert fresh.row_of(WorkerKey(11, 0)) == r1 and fresh.slot_info(s2[0]).request_id == "b"
    with pytest.raises(ValueError):  # the adopted bookings' ids are known again
        book(fresh, "b", r0, 4, [1])
    assert fresh.n_free_slots() == 8 - 3
    for row in (r0, r1):
        live = np.sort(keys[row][counts[row] > 0])
        assert np.array_equal(np.sort(fresh.arrays.ref_keys[row][fresh.arrays.ref_counts[row] > 0]), live)
    for slot in fresh.live_slots():
        fresh.release(slot, fresh.slot_info(slot).generation)
    assert_zero(fresh)


def test_worker_lookups():
    ledger, (r0, _r1) = make_ledger(workers=3, register=2)
    r2 = ledger.add_worker(WorkerKey(10, 1), 5, 5)
    assert ledger.rows_of_worker_id(10) == [r0, r2]
    assert ledger.key_of(r2) == WorkerKey(10, 1)
    assert ledger.live_rows().tolist() == [0, 1, 2]
    assert ledger.n_worker_ids() == 2
