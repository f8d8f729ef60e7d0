"""Numpy and pure-Python twins of the booking kernels (`booking_kernels.py`); `reference.py`
exposes them as `numpy_twin.<kernel>` / `python_twin.<kernel>`.

The Python twins are the ledger's per-event methods as they were written before the kernels
(`Ledger.release` / `dispatched` / `prefill_done` / `set_output_tokens`: a liveness check, then
scalar reads and writes); the numpy twins do the same with array expressions and the numpy twin
of `ref_remove`.
"""

from __future__ import annotations

import numpy as np

from .layout import SLOT_ADMITTED, SLOT_DISPATCHED, SLOT_FREE, SLOT_PREFILL_DONE


def _py_live_row(slot, generation, s_state, s_generation, s_worker_row, n_rows) -> int:
    if not (0 <= slot < len(s_state) and int(s_state[slot]) != SLOT_FREE and int(s_generation[slot]) == generation):
        return -1
    row = int(s_worker_row[slot])
    return row if 0 <= row < n_rows else -1


def _py_slot_dispatched(slot, generation, s_state, s_generation) -> bool:
    if not (0 <= slot < len(s_state) and int(s_state[slot]) != SLOT_FREE and int(s_generation[slot]) == generation):
        return False
    if int(s_state[slot]) == SLOT_ADMITTED:
        s_state[slot] = SLOT_DISPATCHED
    return True


def _py_slot_prefill_done(slot, generation, s_state, s_generation, s_worker_row, s_prefill, w_active_prefill) -> int:
    row = _py_live_row(slot, generation, s_state, s_generation, s_worker_row, len(w_active_prefill))
    if row < 0:
        return -1
    w_active_prefill[row] = int(w_active_prefill[row]) - int(s_prefill[slot])
    s_prefill[slot] = 0
    s_state[slot] = SLOT_PREFILL_DONE
    return row


def _py_slot_output_tokens(
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
) -> int:
    from .reference import python_twin

    row = _py_live_row(slot, generation, s_state, s_generation, s_worker_row, len(w_active_blocks))
    if row < 0 or not python_twin.apply_output_tokens(
        slot,
        max(0, int(n)),
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


def _py_release_booking(
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
) -> int:
    from .reference import python_twin

    row = _py_live_row(slot, generation, s_state, s_generation, s_worker_row, len(w_active_blocks))
    if row < 0:
        return -1
    off, nh = int(s_arena_off[slot]), int(s_arena_len[slot])
    died = python_twin.ref_remove(ref_keys[row], ref_counts[row], [int(h) for h in arena[off : off + nh]])
    w_active_blocks[row] = int(w_active_blocks[row]) - died - int(s_extra_blocks[slot])
    w_active_prefill[row] = int(w_active_prefill[row]) - int(s_prefill[slot])
    w_active_requests[row] = int(w_active_requests[row]) - 1
    s_state[slot] = SLOT_FREE
    s_prefill[slot] = s_extra_blocks[slot] = s_arena_len[slot] = 0
    return row


# ---- numpy ---------------------------------------------------------------------------------


def _np_live_row(slot, generation, s_state, s_generation, s_worker_row, n_rows) -> int:
    if not 0 <= slot < s_state.shape[0]:
        return -1
    ok = (s_state[slot] != SLOT_FREE) & (s_generation[slot].astype(np.int64) == generation)
    row = s_worker_row[slot]
    return int(row) if ok and (0 <= row < n_rows) else -1


def _np_slot_dispatched(slot, generation, s_state, s_generation) -> bool:
    if (
        not 0 <= slot < s_state.shape[0]
        or s_state[slot] == SLOT_FREE
        or s_generation[slot].astype(np.int64) != generation
    ):
        return False
    s_state[slot : slot + 1] = np.where(
        s_state[slot : slot + 1] == SLOT_ADMITTED, SLOT_DISPATCHED, s_state[slot : slot + 1]
    )
    return True


def _np_slot_prefill_done(slot, generation, s_state, s_generation, s_worker_row, s_prefill, w_active_prefill) -> int:
    row = _np_live_row(slot, generation, s_state, s_generation, s_worker_row, w_active_prefill.shape[0])
    if row < 0:
        return -1
    np.subtract.at(w_active_prefill, [row], s_prefill[slot : slot + 1])
    s_prefill[slot : slot + 1] = 0
    s_state[slot : slot + 1] = SLOT_PREFILL_DONE
    return row


def _np_slot_output_tokens(
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
) -> int:
    from .reference import numpy_twin

    row = _np_live_row(slot, generation, s_state, s_generation, s_worker_row, w_active_blocks.shape[0])
    if row < 0:
        return -1
    # one slot as a one-word progress fold: the fold's numpy twin applies the forward-only rule
    sel = np.array([slot])
    word = (s_generation[sel].astype(np.uint64) << np.uint64(32)) | np.uint64(max(0, int(n)))
    progress = np.zeros(s_state.shape[0], np.uint64)
    progress[sel] = word
    mask = np.zeros(s_state.shape[0], np.uint8)
    mask[sel] = s_state[sel]  # only this slot is folded
    state = mask.copy()
    changed = numpy_twin.fold_progress(
        progress,
        state,
        s_generation,
        s_worker_row,
        s_isl,
        s_prefill,
        s_output_tokens,
        s_extra_blocks,
        w_active_blocks,
        w_active_prefill,
        block_size,
    )
    s_state[sel] = state[sel]
    return row if changed else -1


def _np_release_booking(
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
) -> int:
    from .reference import numpy_twin

    row = _np_live_row(slot, generation, s_state, s_generation, s_worker_row, w_active_blocks.shape[0])
    if row < 0:
        return -1
    off = int(s_arena_off[slot])
    died = numpy_twin.ref_remove(ref_keys[row], ref_counts[row], arena[off : off + int(s_arena_len[slot])])
    delta = np.array([died + s_extra_blocks[slot], s_prefill[slot], 1], np.int64)
    w_active_blocks[row : row + 1] -= delta[0]
    w_active_prefill[row : row + 1] -= delta[1]
    w_active_requests[row : row + 1] -= delta[2]
    s_state[slot : slot + 1] = SLOT_FREE
    s_prefill[slot : slot + 1] = 0
    s_extra_blocks[slot : slot + 1] = 0
    s_arena_len[slot : slot + 1] = 0
    return row


NAMES = ("slot_dispatched", "slot_prefill_done", "slot_output_tokens", "release_booking")
