"""Reading the ledger's slot table back: one booking as a `SlotInfo`, and the per-worker aggregates
recomputed from the whole table after a daemon restart (docs/DESIGN.md §3.1).

Pure: no I/O. `ledger.Ledger` keeps the booking maps and calls these; nothing here is on the
per-request path (introspection, lease takeover and restart adoption only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..shm.kernels import ref_add
from ..shm.layout import SLOT_FREE, LedgerArrays


@dataclass(frozen=True, slots=True)
class SlotInfo:
    """One booking as read from the slot table (tokens, µs)."""

    request_id: str
    generation: int
    row: int
    state: int  # 0 free, 1 admitted, 2 dispatched, 3 prefill_done
    isl: int
    cached: int
    prefill: int  # outstanding prefill tokens
    output_tokens: int
    expected_osl: int  # -1 = unknown
    class_idx: int
    admit_us: int
    enqueue_us: int
    owner_pid: int


def read_slot(a: LedgerArrays, slot: int) -> SlotInfo:
    """The booking in `slot` of `a` as plain Python ints (a free slot reads as its last booking's
    values with state 0). Raises IndexError for a slot outside [0, max_slots)."""
    return SlotInfo(
        request_id=a.s_request_id[slot].decode(),
        generation=int(a.s_generation[slot]),
        row=int(a.s_worker_row[slot]),
        state=int(a.s_state[slot]),
        isl=int(a.s_isl[slot]),
        cached=int(a.s_cached[slot]),
        prefill=int(a.s_prefill[slot]),
        output_tokens=int(a.s_output_tokens[slot]),
        expected_osl=int(a.s_expected_osl[slot]),
        class_idx=int(a.s_class[slot]),
        admit_us=int(a.s_admit_us[slot]),
        enqueue_us=int(a.s_enqueue_us[slot]),
        owner_pid=int(a.s_owner_pid[slot]),
    )


def rebuild_aggregates(a: LedgerArrays) -> None:
    """Recompute w_active_blocks / w_active_prefill / w_active_requests and the refcount index of
    `a` from its slot table + arena. Bookings on rows that no longer hold a worker (`w_present` 0)
    are freed (state set to free). The caller re-adopts its Python-side maps afterwards."""
    a.w_active_blocks[:] = a.w_active_prefill[:] = a.w_active_requests[:] = 0
    for row in range(a.max_workers):
        if a.ref_counts[row].any():
            a.ref_counts[row, :] = 0
    for slot in np.flatnonzero(a.s_state).tolist():
        row = int(a.s_worker_row[slot])
        if not (0 <= row < a.max_workers and a.w_present[row]):
            a.s_state[slot] = SLOT_FREE
            continue
        off, nh = int(a.s_arena_off[slot]), int(a.s_arena_len[slot])
        a.w_active_blocks[row] += (
            ref_add(a.ref_keys[row], a.ref_counts[row], a.arena[off : off + nh]) + a.s_extra_blocks[slot]
        )
        a.w_active_prefill[row] += a.s_prefill[slot]
        a.w_active_requests[row] += 1
