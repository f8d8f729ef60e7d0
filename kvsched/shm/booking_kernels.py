"""Numba kernels for one booking's lifecycle after admission: `dispatched`, `prefill_done`, output
tokens, release (docs/DESIGN.md §3.1, §3.5). Each is one call per event, so an `Update` or a
`Release` costs one kernel call instead of a dozen numpy scalar reads and writes.

Every kernel first checks that (slot, generation) names a live booking (slot in range, state not
free, same generation; for the kernels that touch a worker's aggregates also a worker row in
range, which `Ledger.reserve` guarantees) and does nothing otherwise, so stale or repeated events
are no-ops: a late release can never free a reused slot's new booking. Like `kernels.py`, each is
`@njit(cache=True, nogil=True)`, takes arrays (dtypes of `layout.py`) and scalars, allocates
nothing, and has a counterpart of the same name and signature in the plain-Python reference
(tests/shm/reference.py); tests/shm/test_booking_kernels.py requires equal results.
"""

from __future__ import annotations

import numpy as np

from .kernel_cache import njit
from .kernels import apply_output_tokens, ref_remove
from .layout import SLOT_ADMITTED, SLOT_DISPATCHED, SLOT_FREE, SLOT_PREFILL_DONE, LedgerArrays


@njit(cache=True, nogil=True)
def _live(slot, generation, s_state, s_generation):
    return 0 <= slot < s_state.shape[0] and s_state[slot] != SLOT_FREE and np.int64(s_generation[slot]) == generation


@njit(cache=True, nogil=True)
def _live_row(slot, generation, s_state, s_generation, s_worker_row, n_rows):
    """The live booking's worker row, or -1 (stale, free, or a row outside [0, n_rows))."""
    if not _live(slot, generation, s_state, s_generation):
        return -1
    row = s_worker_row[slot]
    return row if 0 <= row < n_rows else -1


@njit(cache=True, nogil=True)
def slot_dispatched(slot, generation, s_state, s_generation):
    """The backend accepted booking (slot, generation): state admitted -> dispatched (never backwards).

    Args:
        slot / generation: the lease (ints; anything out of range is stale).
        s_state: uint8[S]; s_generation: uint32[S] (slot table).
    Returns:
        bool: True when the booking is live (even if it was already past admitted), False if stale.
    """
    if not _live(slot, generation, s_state, s_generation):
        return False
    if s_state[slot] == SLOT_ADMITTED:
        s_state[slot] = SLOT_DISPATCHED
    return True


@njit(cache=True, nogil=True)
def slot_prefill_done(slot, generation, s_state, s_generation, s_worker_row, s_prefill, w_active_prefill):
    """First output token of booking (slot, generation): its outstanding prefill tokens leave its
    worker (`w_active_prefill`) and the slot moves to prefill_done.

    Args:
        s_state / s_generation / s_worker_row / s_prefill: slot table (uint8, uint32, int32, int64 [S]).
        w_active_prefill: int64[W], outstanding prefill tokens per worker row.
    Returns:
        int: the booking's worker row when it is live (its capacity may have changed), -1 if stale.
    """
    row = _live_row(slot, generation, s_state, s_generation, s_worker_row, w_active_prefill.shape[0])
    if row < 0:
        return -1
    w_active_prefill[row] -= s_prefill[slot]
    s_prefill[slot] = 0
    s_state[slot] = SLOT_PREFILL_DONE
    return row


@njit(cache=True, nogil=True)
def slot_output_tokens(
    slot,
    generation,
    n,
    s_state,
    s_generation,
    s_worker_row,
    s_isl,
    s_prefill,
    s_output_tokens,
    s_extra_blocks,
    w_active_blocks,
    w_active_prefill,
    block_size,
):
    """Output tokens so far of booking (slot, generation) (`Update(progress)`): `kernels.apply_output_tokens`
    behind the liveness check. The count only moves forward; `n` < 0 counts as 0.

    Returns:
        int: the booking's worker row when its count moved forward, -1 when stale or unchanged.
    """
    row = _live_row(slot, generation, s_state, s_generation, s_worker_row, w_active_blocks.shape[0])
    if row < 0:
        return -1
    if not apply_output_tokens(
        slot,
        max(n, 0),
        s_state,
        s_worker_row,
        s_isl,
        s_prefill,
        s_output_tokens,
        s_extra_blocks,
        w_active_blocks,
        w_active_prefill,
        block_size,
    ):
        return -1
    return row


@njit(cache=True, nogil=True)
def release_booking(
    slot,
    generation,
    s_state,
    s_generation,
    s_worker_row,
    s_arena_off,
    s_arena_len,
    s_extra_blocks,
    s_prefill,
    arena,
    ref_keys,
    ref_counts,
    w_active_blocks,
    w_active_prefill,
    w_active_requests,
):
    """Free booking (slot, generation) and take its whole load off its worker row, in one call.

    Removes the booking's stored hashes from the row's refcount index (`kernels.ref_remove`: a
    block leaves `w_active_blocks` when its count reaches 0), subtracts its extra (unhashed +
    decode) blocks, its outstanding prefill and the request; the slot becomes free with no
    prefill, no extra blocks and no stored hashes. Generation, request id and the other columns
    stay for introspection until the slot is booked again.

    Args:
        s_state / s_generation / s_worker_row / s_arena_off / s_arena_len / s_extra_blocks /
            s_prefill: slot table columns ([S], `layout.py` dtypes).
        arena: uint64[S * stride], the bookings' hashes; ref_keys / ref_counts: uint64 / int32 [W, C].
        w_active_blocks / w_active_prefill / w_active_requests: int64[W] aggregates.
    Returns:
        int: the freed booking's worker row, or -1 when (slot, generation) is not live (no-op).
    Source: docs/DESIGN.md §3.1 (the ledger's aggregates; releasing every booking returns them to 0).
    """
    row = _live_row(slot, generation, s_state, s_generation, s_worker_row, w_active_blocks.shape[0])
    if row < 0:
        return -1
    off = s_arena_off[slot]
    died = ref_remove(ref_keys[row], ref_counts[row], arena[off : off + s_arena_len[slot]])
    w_active_blocks[row] -= died + s_extra_blocks[slot]
    w_active_prefill[row] -= s_prefill[slot]
    w_active_requests[row] -= 1
    s_state[slot] = SLOT_FREE
    s_prefill[slot] = 0
    s_extra_blocks[slot] = 0
    s_arena_len[slot] = 0
    return row


def warm_booking_kernels() -> None:
    """Compile (or load from NUMBA_CACHE_DIR) the booking kernels for the ledger's dtypes."""
    a = LedgerArrays.private(2, 2, 4, 16, 4)
    slot_dispatched(0, 1, a.s_state, a.s_generation)
    slot_prefill_done(0, 1, a.s_state, a.s_generation, a.s_worker_row, a.s_prefill, a.w_active_prefill)
    slot_output_tokens(0, 1, 1, *a.load, 4)
    release_booking(
        0,
        1,
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
