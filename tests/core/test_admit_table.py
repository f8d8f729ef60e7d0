"""The fused admission's argument tables (`shm.argtable`) follow the arrays they describe.

`Admitter.kernel_arrays` and `OverlapView.depth` hand the packed kernels tables of array addresses
built once. A table that outlived a replaced array would make the kernel write memory nobody reads
(or memory already freed): these tests replace each kind of array the core may replace and check
that the next admission's kernel reads and writes the new one.
"""

from __future__ import annotations

import numpy as np

from kvsched.config import SelectorConfig
from kvsched.core.create import create_scheduler
from kvsched.core.ledger import Ledger
from kvsched.core.types import Admit, WorkerKey
from kvsched.shm.admit_packed import ADMIT_ARRAYS, CREDITED_ARRAYS
from kvsched.shm.argtable import ENTRY
from kvsched.shm.layout import LedgerArrays
from kvsched.shm.overlap import OverlapIndex

from .factories import make_config, make_request

RECENT = [name for name, _, _ in ADMIT_ARRAYS].index("recent")
CREDITED_OUT = [name for name, _, _ in CREDITED_ARRAYS].index("out")


def _scheduler(events: bool = False):
    config = make_config(selector=SelectorConfig(seed=3, recent_weight=1.0))
    ledger = Ledger(LedgerArrays.private(8, 16, 16, block_size=16), overload=config.overload)
    s = create_scheduler(config, ledger=ledger, overlap=OverlapIndex(8, 256), add_workers=False, events=events)
    for wid in range(3):
        s.add_worker(WorkerKey(wid, 0), 4000, 2048)
    if events:
        s.set_event_fed(0, True)
    assert s.admitter.fused
    return s


def _admit(s, i: int, now: int) -> Admit:
    h = np.frombuffer(np.arange(100 * i, 100 * i + 4, dtype=np.uint64).tobytes(), np.uint64)
    got = s.enqueue(make_request(f"r{i}", isl_tokens=64, block_hashes=h), now)
    assert type(got[0]) is Admit, got
    return got[0]


def test_a_replaced_recent_work_array_gets_a_new_table():
    s = _scheduler()
    adm, sel = s.admitter, s.admitter.selector
    a = _admit(s, 1, 1_000)
    old_table = adm.kernel_arrays()[2]
    assert old_table[ENTRY * RECENT] == sel.recent.__array_interface__["data"][0]
    old = sel.recent
    sel.recent = sel.recent.copy()  # as `KvSelector` does when rows are added (a new array)
    old_before = old.copy()
    b = _admit(s, 2, 2_000)
    table = adm.kernel_arrays()[2]
    assert table[ENTRY * RECENT] == sel.recent.__array_interface__["data"][0]
    np.testing.assert_array_equal(old, old_before)  # the replaced array is no longer written
    assert sel.recent[s.ledger.row_of(b.worker)] > 0  # the admission's recent work went to the new array
    assert a.slot != b.slot


def test_a_replaced_depth_array_gets_a_new_credited_table():
    s = _scheduler(events=True)
    view = s.view
    _admit(s, 1, 1_000)
    old_out = view.depth_out
    view.depth_out = np.zeros_like(old_out)
    view.drop_memo()
    _admit(s, 2, 2_000)
    table = view._credited[2]
    assert table[ENTRY * CREDITED_OUT] == view.depth_out.__array_interface__["data"][0]
    assert s.admitter.kernel_arrays()[2][ENTRY * 8] == view.depth_out.__array_interface__["data"][0]


def test_a_copied_scheduler_writes_its_own_arrays():
    """A deep copy must not inherit the tables (they hold the original's addresses): admitting and
    releasing in the copy leaves the original's ledger and indexes as they were."""
    import copy

    s = _scheduler()
    a = _admit(s, 1, 1_000)
    s.release(a.request_id, a.slot, a.generation, "completed", 1, 1_500)
    s.ledger.fold_progress()
    snapshot = {
        n: getattr(s.ledger.arrays, n).copy()
        for n in ("w_active_blocks", "w_active_requests", "s_state", "s_generation", "ref_counts", "arena")
    }
    keys, recent = s.view.approx.keys.copy(), s.admitter.selector.recent.copy()
    c = copy.deepcopy(s)
    b = _admit(c, 2, 2_000)
    assert c.ledger.arrays.w_active_requests.sum() == 1
    c.release(b.request_id, b.slot, b.generation, "completed", 1, 2_500)
    assert c.admitter.kernel_arrays()[2][ENTRY * RECENT] == c.admitter.selector.recent.__array_interface__["data"][0]
    for n, before in snapshot.items():
        np.testing.assert_array_equal(getattr(s.ledger.arrays, n), before, err_msg=n)
    np.testing.assert_array_equal(s.view.approx.keys, keys)
    np.testing.assert_array_equal(s.admitter.selector.recent, recent)
