"""The scheduler folds local routers' state and progress words like Update frames (restart included)."""

from __future__ import annotations

import numpy as np

from kvsched.config import OverloadConfig
from kvsched.core.create import create_scheduler
from kvsched.core.ledger import Ledger
from kvsched.core.types import Admit, WorkerKey
from kvsched.shm.layout import LedgerArrays
from kvsched.shm.overlap import OverlapIndex
from kvsched.shm.words import STATE_DISPATCHED, STATE_PREFILL_DONE, write_state
from tests.core.factories import make_class, make_config, make_request


def _scheduler(arrays=None, words=None, add_worker=True):
    config = make_config(classes=[make_class(prefill_busy_threshold=100)])
    arrays = arrays if arrays is not None else LedgerArrays.private(4, 8, 64, block_size=config.daemon.block_size)
    progress, state = words if words is not None else (np.zeros(8, np.uint64), np.zeros(8, np.uint64))
    ledger = Ledger(arrays, progress, OverloadConfig(), state=state)
    s = create_scheduler(config, ledger=ledger, overlap=OverlapIndex(4, 1024), add_workers=False)
    if add_worker:
        s.add_worker(WorkerKey(1, 0), 1000, 1000)
    return s, arrays, (progress, state)


def test_prefill_done_word_admits_waiting_request_when_folded():
    s, arrays, (_, state) = _scheduler()
    [a] = s.enqueue(make_request("a", isl_tokens=500), 1)
    assert isinstance(a, Admit)
    assert s.enqueue(make_request("b", isl_tokens=50), 2) == []  # the worker is busy: b waits
    assert s.waiting
    write_state(state, a.slot, a.generation, STATE_DISPATCHED)
    assert s.fold_words() is False  # dispatched frees nothing
    assert s.drain_cleanup(3) == []
    write_state(state, a.slot, a.generation, STATE_PREFILL_DONE)
    assert s.fold_words() is True
    [b] = s.drain_cleanup(4)
    assert isinstance(b, Admit) and b.request_id == "b" and not s.waiting
    assert arrays.w_active_prefill[0] == 50


def test_restart_folds_words_before_rebuilding_aggregates():
    s, arrays, words = _scheduler()
    [a] = s.enqueue(make_request("a", isl_tokens=500), 1)
    write_state(words[1], a.slot, a.generation, STATE_PREFILL_DONE)  # stored; the daemon dies unfolded
    assert arrays.w_active_prefill[0] == 500
    fresh, _, _ = _scheduler(arrays, words, add_worker=False)
    assert fresh.restore_after_restart(10, 1_000_000).adopted == 1
    assert arrays.w_active_prefill[0] == 0 and arrays.w_active_requests[0] == 1
    assert fresh.leases(10)[0].state == "prefill_done"
