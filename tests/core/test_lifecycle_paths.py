"""The per-event paths after admission: what they do (and skip) with nothing to dispatch, and the
rows a fold of the routers' words reports (docs/ARCHITECTURE.md "The core")."""

from __future__ import annotations

import numpy as np

from kvsched.config import OverloadConfig
from kvsched.core.create import create_scheduler
from kvsched.core.ledger import Ledger
from kvsched.core.types import Admit, WorkerKey
from kvsched.shm.layout import LedgerArrays
from kvsched.shm.overlap import OverlapIndex
from kvsched.shm.progress import write_progress
from kvsched.shm.words import STATE_DISPATCHED, STATE_PREFILL_DONE, write_state
from tests.core.factories import make_class, make_config, make_request, make_scheduler


def _count_dispatch(s) -> list[int]:
    calls = [0]
    real = s.admitter.dispatch

    def counted(now_us):
        calls[0] += 1
        return real(now_us)

    s.admitter.dispatch = counted
    return calls


def test_drain_cleanup_runs_no_dispatch_pass_over_empty_queues():
    """A release frees capacity, but with nothing waiting the cleanup runs no dispatch pass; the
    released id is reusable right after it."""
    s = make_scheduler()
    calls = _count_dispatch(s)
    [a] = s.enqueue(make_request("a"), 1)
    s.update("a", a.slot, a.generation, "prefill_done", None, 2)
    s.release("a", a.slot, a.generation, "completed", 100, 3)
    assert s.cleanup_pending("a")
    assert s.drain_cleanup(4) == [] and calls[0] == 0
    assert not s.cleanup_pending("a")
    [again] = s.enqueue(make_request("a"), 5)
    assert isinstance(again, Admit) and (again.slot, again.generation) != (a.slot, a.generation)


def test_drain_cleanup_dispatches_once_when_a_request_waits():
    s = make_scheduler(classes=[make_class(prefill_busy_threshold=100)])
    calls = _count_dispatch(s)
    [a] = s.enqueue(make_request("a", isl_tokens=500), 1)
    assert s.enqueue(make_request("b", isl_tokens=50), 2) == []  # busy: b waits
    calls[0] = 0
    s.release("a", a.slot, a.generation, "completed", 500, 3)
    [b] = s.drain_cleanup(4)
    assert b.request_id == "b" and calls[0] == 1
    assert s.drain_cleanup(5) == [] and calls[0] == 1  # nothing changed since: no second pass


def test_stale_release_after_reuse_keeps_the_new_lease():
    s = make_scheduler()
    [a] = s.enqueue(make_request("a"), 1)
    s.release("a", a.slot, a.generation, "completed", 100, 2)
    s.drain_cleanup(3)
    [b] = s.enqueue(make_request("a"), 4)  # same id, same slot, next generation
    assert b.slot == a.slot and b.generation == a.generation + 1
    s.release("a", a.slot, a.generation, "completed", 100, 5)  # the late duplicate of the first release
    s.drain_cleanup(6)
    assert s.active_leases == 1 and s.ledger.arrays.w_active_requests[0] == 1
    s.update("a", b.slot, b.generation, "dispatched", None, 7)  # the new lease still answers


def test_ledger_fold_reports_changed_rows_and_new_dispatches():
    """`Ledger.fold`: a dispatched store changes no load (no row) but is reported once; a
    prefill_done store frees the row's prefill; a progress word adding a decode block changes the
    row; a word of another generation changes nothing."""
    config = make_config(classes=[make_class()])
    arrays = LedgerArrays.private(4, 8, 64, block_size=config.daemon.block_size)
    progress, state = np.zeros(8, np.uint64), np.zeros(8, np.uint64)
    s = create_scheduler(
        config,
        ledger=Ledger(arrays, progress, OverloadConfig(), state=state),
        overlap=OverlapIndex(4, 1024),
        add_workers=False,
    )
    s.add_worker(WorkerKey(1, 0), 1000, 1000)
    s.add_worker(WorkerKey(2, 0), 1000, 1000)
    [a] = s.enqueue(make_request("a", isl_tokens=32, pinned=WorkerKey(2, 0)), 1)
    ledger, row = s.ledger, s.ledger.row_of(WorkerKey(2, 0))
    assert ledger.fold() == ([], [])
    write_state(state, a.slot, a.generation, STATE_DISPATCHED)
    assert ledger.fold() == ([], [a.slot])
    assert ledger.fold() == ([], [])  # reported once
    write_state(state, a.slot, a.generation, STATE_PREFILL_DONE)
    assert ledger.fold() == ([row], [])
    write_progress(progress, a.slot, a.generation + 1, 40)  # another generation: ignored
    assert ledger.fold() == ([], [])
    write_progress(progress, a.slot, a.generation, 1)  # 33 tokens: a third block
    assert ledger.fold() == ([row], [])
    write_progress(progress, a.slot, a.generation, 2)  # 34 tokens: same blocks, count moves on
    assert ledger.fold() == ([], []) and arrays.s_output_tokens[a.slot] == 2


def test_finished_requests_leave_no_reference_cycles():
    """A request's records (its `Live` and queue entry) are freed by reference counting when it
    ends, immediate or queued: the cyclic garbage collector finds nothing to collect afterwards (a
    cycle per request would cost every lifecycle a share of a collector pass)."""
    import gc

    s = make_scheduler(classes=[make_class(prefill_busy_threshold=100)])
    gc.collect()
    gc.disable()
    try:
        for i in range(50):
            [a] = s.enqueue(make_request(f"a{i}", isl_tokens=500), 10 * i)
            assert s.enqueue(make_request(f"b{i}", isl_tokens=50), 10 * i + 1) == []  # busy: b queues
            s.update(a.request_id, a.slot, a.generation, "prefill_done", None, 10 * i + 2)
            s.release(a.request_id, a.slot, a.generation, "completed", 500, 10 * i + 3)
            [b] = s.drain_cleanup(10 * i + 4)
            s.release(b.request_id, b.slot, b.generation, "completed", 50, 10 * i + 5)
            s.drain_cleanup(10 * i + 6)
        assert s.active_leases == 0
        assert gc.collect() < 20  # before the cycle was broken: 2 objects per request, 200 here
    finally:
        gc.enable()
