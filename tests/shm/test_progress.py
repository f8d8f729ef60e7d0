"""Progress words: packing, stale generations ignored, late writes never touch a reused slot
(docs/DESIGN.md §3.2)."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.core.ledger import Ledger
from kvsched.core.types import WorkerKey
from kvsched.shm.layout import LedgerArrays
from kvsched.shm.progress import pack_progress, write_progress


def _ledger(block_size=4):
    arrays = LedgerArrays.private(2, 4, 8, 64, block_size)
    progress = np.zeros(4, np.uint64)
    ledger = Ledger(arrays, progress)
    row = ledger.add_worker(WorkerKey(1, 0), 1000, 1000)
    return ledger, progress, row


def _unpack(word: int) -> tuple[int, int]:
    return word >> 32, word & (2**32 - 1)


def test_pack_round_trips_when_values_in_range():
    for gen, tok in [(0, 0), (1, 5), (2**32 - 1, 2**32 - 1), (7, 123456)]:
        assert _unpack(pack_progress(gen, tok)) == (gen, tok)
    assert _unpack(pack_progress(3, 2**40)) == (3, 2**32 - 1)
    with pytest.raises(ValueError):
        pack_progress(2**32, 0)


def test_fold_ignores_word_when_generation_is_stale():
    ledger, progress, row = _ledger()
    slot, gen = ledger.reserve("a", row, 8, np.arange(2, dtype=np.uint64), 0, None, 0, 0, 0)
    write_progress(progress, slot, gen + 1, 50)
    assert ledger.fold_progress() == 0
    assert ledger.slot_info(slot).output_tokens == 0
    assert ledger.arrays.w_active_prefill[row] == 8
    write_progress(progress, slot, gen, 5)
    assert ledger.fold_progress() == 1
    info = ledger.slot_info(slot)
    assert info.output_tokens == 5 and info.prefill == 0 and info.state == 3
    assert ledger.arrays.w_active_blocks[row] == 2 + 2  # ceil((8+5)/4) = 4 blocks
    assert ledger.fold_progress() == 0  # unchanged word: nothing to do


def test_late_write_after_release_does_not_affect_reused_slot():
    ledger, progress, row = _ledger()
    slot, gen = ledger.reserve("a", row, 8, np.arange(2, dtype=np.uint64), 0, None, 0, 0, 0)
    assert ledger.release(slot, gen)
    slot2, gen2 = ledger.reserve("b", row, 8, np.arange(10, 12, dtype=np.uint64), 0, None, 0, 0, 0)
    assert slot2 == slot and gen2 != gen
    write_progress(progress, slot, gen, 400)  # the old lease's router writes late
    assert ledger.fold_progress() == 0
    info = ledger.slot_info(slot2)
    assert info.request_id == "b" and info.output_tokens == 0 and info.prefill == 8
    assert ledger.arrays.w_active_blocks[row] == 2


def test_fold_ignores_free_slots_when_word_matches_old_generation():
    ledger, progress, row = _ledger()
    slot, gen = ledger.reserve("a", row, 8, np.arange(2, dtype=np.uint64), 0, None, 0, 0, 0)
    ledger.release(slot, gen)
    write_progress(progress, slot, gen, 9)
    assert ledger.fold_progress() == 0
    assert ledger.arrays.w_active_blocks[row] == 0
