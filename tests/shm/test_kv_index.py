"""The KV-index segment: survives its creator's SIGKILL, validates its header, reconciles worker rows."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvsched.errors import ShmLayoutError
from kvsched.shm.kv_index import attach_kv_index, create_kv_index, open_kv_index, reconcile_rows
from kvsched.shm.segments import kv_index_name, unlink_segments

W, CAP = 3, 1 << 8

CREATOR = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from kvsched.shm.kv_index import create_kv_index
    seg = create_kv_index(sys.argv[1], 3, 1 << 8)
    seg.device.insert(np.array([11, 12, 13], np.uint64), 2, 0, None)
    seg.offload.insert(np.array([11], np.uint64), 1, 0, None)
    seg.last_seq[2] = 41
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _depth(idx, hashes):
    out = np.zeros(W, np.int32)
    idx.depth(np.array(hashes, np.uint64), 0, out)
    return out.tolist()


@pytest.mark.multiprocess
def test_segment_and_contents_survive_the_creators_sigkill(instance):
    """Python's resource tracker would unlink a segment its process created when that process dies,
    even by SIGKILL; the segment is unregistered at creation, so it stays with what was written."""
    res = subprocess.run([sys.executable, "-c", CREATOR, instance], capture_output=True, timeout=120)
    assert res.returncode == -9, res.stderr
    assert os.path.exists(f"/dev/shm/{kv_index_name(instance)}")
    seg = attach_kv_index(instance, W, CAP)
    try:
        assert _depth(seg.device, [11, 12, 13]) == [0, 0, 3]
        assert _depth(seg.offload, [11]) == [0, 1, 0]
        assert seg.last_seq.tolist() == [-1, -1, 41]
    finally:
        seg.close()
    unlink_segments(instance)
    assert not os.path.exists(f"/dev/shm/{kv_index_name(instance)}")


def test_attach_rejects_other_capacities_and_open_recreates_instead(instance):
    seg = create_kv_index(instance, W, CAP)
    seg.device.insert(np.array([5], np.uint64), 0, 0, None)
    seg.last_seq[0] = 7
    seg.close()
    with pytest.raises(ShmLayoutError, match="differ"):
        attach_kv_index(instance, W, CAP * 2)
    kept, restored = open_kv_index(instance, W, CAP, restore=True)
    assert restored and kept.last_seq[0] == 7 and _depth(kept.device, [5])[0] == 1
    kept.close()
    fresh, restored = open_kv_index(instance, W, CAP * 2, restore=True)  # invalid: recreated empty
    assert not restored and fresh.capacity == CAP * 2 and (fresh.last_seq == -1).all() and len(fresh.device) == 0
    fresh.close()
    fresh, restored = open_kv_index(instance, W, CAP * 2, restore=False)  # fresh ledger: never kept
    assert not restored
    fresh.close()


def test_reconcile_clears_rows_whose_worker_changed_and_adopts_reset_rows(instance):
    seg = create_kv_index(instance, W, CAP)
    try:
        present = np.array([1, 1, 0], np.uint8)
        ids, ranks, gens = np.array([7, 8, 0], np.uint32), np.zeros(3, np.uint32), np.array([1, 1, 0], np.uint32)
        assert reconcile_rows(seg, present, ids, ranks, gens) == []
        for row in range(W):
            seg.device.insert(np.array([100 + row], np.uint64), row, 0, None)
            seg.last_seq[row] = 10 + row
        seg.present[2] = 0  # row 2 was reset and reused at runtime: its entries are the new worker's
        gens2 = np.array([1, 2, 1], np.uint32)  # row 1 re-registered (generation bumped); row 2 added
        present2, ids2 = np.array([1, 1, 1], np.uint8), np.array([7, 9, 5], np.uint32)
        assert reconcile_rows(seg, present2, ids2, ranks, gens2) == [1]
        assert seg.last_seq.tolist() == [10, -1, 12]
        assert [_depth(seg.device, [100 + r])[r] for r in range(W)] == [1, 0, 1]
        assert seg.worker_id.tolist() == [7, 9, 5] and seg.present.tolist() == [1, 1, 1]
        assert reconcile_rows(seg, np.array([1, 1, 0], np.uint8), ids2, ranks, gens2) == [2]  # worker left
    finally:
        seg.close()
