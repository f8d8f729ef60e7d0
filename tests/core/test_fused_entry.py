"""The fused path calls `admit_kv_packed` through its compiled entry point only for C-contiguous uint64
hashes (`Admitter.admit`, `core/admitter.py`): the entry point checks nothing but an array's item size, so a strided
view must go through numba's dispatcher. Both layouts decide and book exactly as the Python path."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.core.types import Admit

from .factories import make_request
from .test_fused_admission import _pair, _same_state, count_fused


@pytest.mark.parametrize("layout", ["contiguous", "strided", "writable"])
def test_fused_entry_point_reads_every_hash_layout(layout):
    fast, slow = _pair(events=False, busy_frac=None, max_slots=64, overload_prefill=None)
    calls = count_fused(fast)
    now, ids = 1_000_000, []
    for i in range(12):
        now += 1_000
        base = np.array([7000 + k for k in range(3)] + [10**6 + i * 64 + k for k in range(5)], dtype=np.uint64)
        if layout == "strided":  # every other element of a longer array: strides (16,)
            wide = np.zeros(2 * base.size, np.uint64)
            wide[::2] = base
            hashes = wide[::2]
            assert hashes.strides == (16,)
        elif layout == "writable":
            hashes = base.copy()
        else:
            hashes = np.frombuffer(base.tobytes(), dtype="<u8")
        rid = f"r{i}"
        got = [s.enqueue(make_request(rid, isl_tokens=8 * 16, block_hashes=hashes, owner=1), now) for s in (fast, slow)]
        assert got[0] == got[1]
        assert type(got[0][0]) is Admit
        ids.append(rid)
    assert calls["fused"] >= 6  # most admissions were the fused path's (a tie on the idle fleet is not)
    _same_state(fast, slow, ids)
