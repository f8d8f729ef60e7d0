"""State words: packing, the fold's Update-frame semantics, stale generations, restart folding."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.core.ledger import Ledger
from kvsched.core.types import WorkerKey
from kvsched.shm.layout import SLOT_ADMITTED, SLOT_DISPATCHED, SLOT_PREFILL_DONE, LedgerArrays
from kvsched.shm.progress import write_progress
from kvsched.shm.words import STATE_DISPATCHED, STATE_PREFILL_DONE, pack_state, unpack_state, write_state


def _ledger(slots=4):
    arrays = LedgerArrays.private(2, slots, 8, 64, 4)
    progress, state = np.zeros(slots, np.uint64), np.zeros(slots, np.uint64)
    ledger = Ledger(arrays, progress, state=state)
    row = ledger.add_worker(WorkerKey(1, 0), 1000, 1000)
    return ledger, progress, state, row


def test_pack_state_sets_dispatched_when_prefill_done():
    assert unpack_state(pack_state(7, STATE_PREFILL_DONE)) == (7, STATE_DISPATCHED | STATE_PREFILL_DONE)
    assert unpack_state(pack_state(2**32 - 1, STATE_DISPATCHED)) == (2**32 - 1, STATE_DISPATCHED)
    with pytest.raises(ValueError):
        pack_state(2**32, 1)
    with pytest.raises(ValueError):
        pack_state(1, 4)


def test_write_state_keeps_flags_of_same_generation_and_drops_older_ones():
    state = np.zeros(2, np.uint64)
    write_state(state, 0, 5, STATE_PREFILL_DONE)
    write_state(state, 0, 5, STATE_DISPATCHED)  # a late dispatched() must not clear prefill_done
    assert unpack_state(state[0]) == (5, 3)
    write_state(state, 0, 6, STATE_DISPATCHED)
    assert unpack_state(state[0]) == (6, STATE_DISPATCHED)


def test_fold_moves_slot_like_update_frames_when_words_stored():
    ledger, progress, state, row = _ledger()
    slot, gen = ledger.reserve("a", row, 8, np.arange(2, dtype=np.uint64), 0, None, 0, 0, 0)
    assert ledger.fold_progress() == 0 and ledger.take_dispatched() == []
    write_state(state, slot, gen, STATE_DISPATCHED)
    assert ledger.fold_progress() == 0  # dispatched changes no load
    assert ledger.take_dispatched() == [slot]
    assert ledger.slot_info(slot).state == SLOT_DISPATCHED and ledger.arrays.w_active_prefill[row] == 8
    write_state(state, slot, gen, STATE_PREFILL_DONE)
    assert ledger.fold_progress() == 1
    assert ledger.take_dispatched() == []  # dispatched is reported once per lease
    info = ledger.slot_info(slot)
    assert info.state == SLOT_PREFILL_DONE and info.prefill == 0 and ledger.arrays.w_active_prefill[row] == 0
    write_progress(progress, slot, gen, 5)
    assert ledger.fold_progress() == 1
    assert ledger.slot_info(slot).output_tokens == 5
    assert ledger.fold_progress() == 0  # nothing new


def test_stale_state_word_does_not_touch_reused_slot():
    ledger, _progress, state, row = _ledger()
    slot, gen = ledger.reserve("a", row, 8, np.arange(2, dtype=np.uint64), 0, None, 0, 0, 0)
    assert ledger.release(slot, gen)
    slot2, gen2 = ledger.reserve("b", row, 8, np.arange(10, 12, dtype=np.uint64), 0, None, 0, 0, 0)
    assert slot2 == slot and gen2 != gen
    state[slot] = pack_state(gen, STATE_PREFILL_DONE)  # the old lease's router stores late
    assert ledger.fold_progress() == 0 and ledger.take_dispatched() == []
    info = ledger.slot_info(slot2)
    assert info.request_id == "b" and info.state == SLOT_ADMITTED and info.prefill == 8
    assert ledger.arrays.w_active_prefill[row] == 8


def test_restart_folds_words_stored_while_no_daemon_ran():
    ledger, progress, state, row = _ledger()
    slot, gen = ledger.reserve("a", row, 8, np.arange(2, dtype=np.uint64), 0, None, 0, 0, 0)
    state[slot] = pack_state(gen, STATE_PREFILL_DONE)  # stored after the old daemon's last fold
    fresh = Ledger(ledger.arrays, progress, state=state)  # the restarted daemon's ledger
    fresh.fold_progress(every_slot=True)
    fresh.rebuild_aggregates()
    assert fresh.slot_info(slot).state == SLOT_PREFILL_DONE
    assert fresh.arrays.w_active_prefill[row] == 0 and fresh.arrays.w_active_requests[row] == 1
