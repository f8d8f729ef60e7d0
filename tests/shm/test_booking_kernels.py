"""Booking kernels (`booking_kernels.py`) == the plain-Python reference (tests/shm/reference.py) == the packed release
(`booking_packed.py`), event after event, on ledgers built by real reservations; stale events are
no-ops; releasing everything returns every aggregate and refcount to zero (docs/DESIGN.md §3.1, §3.5)."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvsched.config import OverloadConfig
from kvsched.core.ledger import Ledger
from kvsched.core.types import WorkerKey
from kvsched.shm import booking_kernels
from kvsched.shm.argtable import pack_table
from kvsched.shm.booking_packed import RELEASE_ARRAYS, release_booking_packed
from kvsched.shm.layout import SLOT_FREE, LedgerArrays
from tests.shm import reference


class _Packed:
    """`booking_kernels` with `release_booking` through `release_booking_packed` (its arrays as one
    table, as `Ledger` calls it); the other kernels unchanged."""

    slot_dispatched = staticmethod(booking_kernels.slot_dispatched)
    slot_prefill_done = staticmethod(booking_kernels.slot_prefill_done)
    slot_output_tokens = staticmethod(booking_kernels.slot_output_tokens)

    @staticmethod
    def release_booking(slot, generation, *arrays):
        return release_booking_packed(slot, generation, pack_table(arrays, RELEASE_ARRAYS))


IMPLS = {"numba": booking_kernels, "reference": reference, "packed": _Packed}
FAST = settings(max_examples=60, deadline=None)
ROWS, SLOTS, STRIDE, CAP, BS = 3, 6, 5, 16, 4
ARRAYS = (
    "s_state",
    "s_generation",
    "s_worker_row",
    "s_prefill",
    "s_output_tokens",
    "s_extra_blocks",
    "s_arena_len",
    "arena",
    "ref_keys",
    "ref_counts",
    "w_active_blocks",
    "w_active_prefill",
    "w_active_requests",
)


def _ledgers(bookings):
    """One ledger per implementation, holding the same bookings (made by `Ledger.reserve`)."""
    out = {}
    for name in IMPLS:
        ledger = Ledger(LedgerArrays.private(ROWS, SLOTS, STRIDE, CAP, BS), overload=OverloadConfig())
        for w in range(ROWS):
            ledger.add_worker(WorkerKey(w, 0), 1000, 1000)
        for i, (row, isl, cached, hashes) in enumerate(bookings):
            ledger.reserve(f"r{i}", row, isl, np.array(hashes, np.uint64), cached, None, 0, 0, 1)
        out[name] = ledger
    return out


def _apply(impl, a, event, slot, generation, n):
    if event == "release":
        return impl.release_booking(
            slot,
            generation,
            a.s_state,
            a.s_generation,
            a.s_worker_row,
            a.s_arena_off,
            a.s_arena_len,
            a.s_extra_blocks,
            a.s_prefill,
            a.arena,
            a.ref_keys,
            a.ref_counts,
            a.w_active_blocks,
            a.w_active_prefill,
            a.w_active_requests,
        )
    if event == "dispatched":
        return impl.slot_dispatched(slot, generation, a.s_state, a.s_generation)
    if event == "prefill_done":
        return impl.slot_prefill_done(
            slot, generation, a.s_state, a.s_generation, a.s_worker_row, a.s_prefill, a.w_active_prefill
        )
    return impl.slot_output_tokens(
        slot,
        generation,
        n,
        a.s_state,
        a.s_generation,
        a.s_worker_row,
        a.s_isl,
        a.s_prefill,
        a.s_output_tokens,
        a.s_extra_blocks,
        a.w_active_blocks,
        a.w_active_prefill,
        BS,
    )


booking = st.tuples(
    st.integers(0, ROWS - 1),
    st.integers(1, 30),
    st.integers(0, 30),
    st.lists(st.integers(0, 12), max_size=STRIDE, unique=True),
)
event = st.tuples(
    st.sampled_from(["release", "dispatched", "prefill_done", "progress"]),
    st.one_of(st.integers(0, 2), st.integers(-1, SLOTS)),  # mostly booked slots
    st.sampled_from([0, 0, 0, -1, 1, 2]),  # generation offset: mostly the live one
    st.integers(-3, 20),
)


@FAST
@given(bookings=st.lists(booking, min_size=1, max_size=SLOTS), events=st.lists(event, max_size=30))
@example(
    bookings=[(0, 9, 0, [1, 2, 3])],
    events=[
        ("prefill_done", 0, 0, 0),
        ("dispatched", 0, 0, 0),
        ("progress", 0, 0, 5),
        ("progress", 0, 0, 2),
        ("release", 0, 0, 0),
        ("release", 0, 0, 0),
    ],
)
def test_booking_kernels_agree_with_reference_event_after_event(bookings, events):
    """Random events, with slots out of range, free slots and stale generations (generation offset
    -1 / +1 / +2) mixed in: the kernels, the reference and the packed release return the same and leave the
    same arrays."""
    ledgers = _ledgers(bookings)
    a0 = ledgers["numba"].arrays
    for kind, slot, gen_offset, n in events:
        generation = int(a0.s_generation[slot]) + gen_offset if 0 <= slot < SLOTS else 1
        live = 0 <= slot < SLOTS and a0.s_state[slot] != SLOT_FREE and gen_offset == 0
        before = {name: getattr(a0, name).copy() for name in ARRAYS}
        got = {name: _apply(IMPLS[name], ledgers[name].arrays, kind, slot, generation, n) for name in IMPLS}
        assert len({int(v) for v in got.values()}) == 1, (kind, got)
        for name in ("reference", "packed"):
            for arr in ARRAYS:
                assert np.array_equal(getattr(ledgers[name].arrays, arr), getattr(a0, arr)), (name, kind, arr)
        if not live:  # stale, free or out of range: nothing moved
            assert int(got["numba"]) in (-1, 0)
            for arr in ARRAYS:
                assert np.array_equal(getattr(a0, arr), before[arr]), (kind, arr)
    for slot in np.flatnonzero(a0.s_state).tolist():  # release the rest: every aggregate returns to zero
        assert (
            booking_kernels.release_booking(
                slot,
                int(a0.s_generation[slot]),
                a0.s_state,
                a0.s_generation,
                a0.s_worker_row,
                a0.s_arena_off,
                a0.s_arena_len,
                a0.s_extra_blocks,
                a0.s_prefill,
                a0.arena,
                a0.ref_keys,
                a0.ref_counts,
                a0.w_active_blocks,
                a0.w_active_prefill,
                a0.w_active_requests,
            )
            >= 0
        )
    assert not a0.w_active_blocks.any() and not a0.w_active_prefill.any() and not a0.w_active_requests.any()
    assert not a0.ref_counts.any()


def test_release_booking_is_idempotent_and_spares_a_reused_slot():
    """A repeated release, and a stale release after the slot was booked again, change nothing."""
    ledger = _ledgers([(0, 16, 0, [1, 2, 3])])["numba"]
    a = ledger.arrays
    slot, gen = 0, int(a.s_generation[0])
    assert ledger.release_booking(slot, gen) == 0
    assert ledger.release_booking(slot, gen) == -1
    again = ledger.reserve("again", 1, 8, np.array([7], np.uint64), 0, None, 0, 0, 2)
    assert again == (slot, gen + 1)
    snapshot = a.w_active_blocks.copy(), a.w_active_requests.copy(), a.ref_counts.copy()
    assert ledger.release_booking(slot, gen) == -1  # the late release of the first booking
    assert np.array_equal(a.w_active_blocks, snapshot[0]) and np.array_equal(a.w_active_requests, snapshot[1])
    assert np.array_equal(a.ref_counts, snapshot[2]) and a.s_state[slot] != SLOT_FREE
    assert ledger.slot_info(slot).request_id == "again"


def test_output_tokens_only_move_forward():
    ledger = _ledgers([(1, 10, 0, [4, 5])])["numba"]
    a = ledger.arrays
    gen = int(a.s_generation[0])
    assert ledger.output_tokens_row(0, gen, 7) == 1
    blocks = int(a.w_active_blocks[1])
    assert ledger.output_tokens_row(0, gen, 3) == -1 and ledger.output_tokens_row(0, gen, 7) == -1
    assert int(a.s_output_tokens[0]) == 7 and int(a.w_active_blocks[1]) == blocks
    assert a.w_active_prefill[1] == 0  # the first output token ends the prefill
