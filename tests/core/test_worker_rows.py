"""WorkerRows, the ledger's worker-row table, against a plain dict model: registration, freeing,
re-adoption from the arrays, flags and the eligibility memo (docs/ARCHITECTURE.md, core)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.config import OverloadConfig
from kvsched.core.types import WorkerKey
from kvsched.core.worker_rows import WorkerRows
from kvsched.shm.layout import FLAG_DRAINED, LedgerArrays

W = 4
keys = st.builds(WorkerKey, st.integers(0, 3), st.integers(0, 1))
ops = st.lists(st.tuples(st.sampled_from(["add", "free", "drain", "undrain"]), keys), max_size=40)


def _rows() -> WorkerRows:
    return WorkerRows(LedgerArrays.private(W, 4, 4, 16, 4), OverloadConfig())


@settings(max_examples=200, deadline=None)
@given(ops=ops)
def test_rows_match_a_dict_model_and_survive_readoption(ops):
    rows = _rows()
    model: dict[WorkerKey, int] = {}  # key -> row
    drained: set[WorkerKey] = set()
    for op, key in ops:
        v = rows.version
        if op == "add":
            if key in model or len(model) == W:
                with pytest.raises(ValueError):
                    rows.add(key, 100, 64)
                assert rows.version == v
                continue
            row = rows.add(key, 100, 64)
            assert row == min(set(range(W)) - set(model.values()))  # the lowest free row
            model[key] = row
            assert rows.version > v
        elif key not in model:
            continue
        elif op == "free":
            rows.free(model.pop(key))
            drained.discard(key)
            assert rows.version > v
        else:
            rows.set_flag(model[key], FLAG_DRAINED, op == "drain")
            changed = (op == "drain") != (key in drained)
            (drained.add if op == "drain" else drained.discard)(key)
            assert (rows.version > v) == changed
    for r in (rows, WorkerRows(rows.arrays, OverloadConfig())):  # a second table adopts the same arrays
        assert {k: r.row_of(k) for k in model} == model
        assert all(r.key_of(row) == k for k, row in model.items())
        assert r.live_rows().tolist() == sorted(model.values())
        assert r.worker_ids() == frozenset(k.worker_id for k in model)
        assert all(r.ranks_of(i) == sum(k.worker_id == i for k in model) for i in range(4))
        out = np.zeros(W, np.uint8)
        n = r.eligible_mask(None, None, out)
        want = sorted(model[k] for k in model if k not in drained)
        assert n == len(want) and np.flatnonzero(out).tolist() == want


def test_eligibility_memo_follows_flag_changes():
    rows = _rows()
    a, b = rows.add(WorkerKey(1, 0), 100, 64), rows.add(WorkerKey(2, 0), 100, 64)
    out = rows.elig_cache
    assert rows.eligible_mask(None, None, out) == 2
    rows.set_flag(a, FLAG_DRAINED, True)
    assert rows.eligible_mask(None, None, out) == 1 and out.tolist()[:2] == [0, 1]
    assert rows.eligible_mask(WorkerKey(2, 0), None, out) == 1 and out[b] == 1
    assert rows.eligible_mask(WorkerKey(1, 0), None, out) == 0  # pinned to a drained worker
    assert rows.eligible_mask(None, frozenset({1}), out) == 0


def test_free_zeroes_the_row_and_unknown_rows_raise():
    rows = _rows()
    row = rows.add(WorkerKey(7, 0), 100, 64)
    a = rows.arrays
    a.w_active_blocks[row], a.ref_counts[row, 0] = 5, 3
    rows.free(row)
    assert a.w_active_blocks[row] == 0 and not a.ref_counts[row].any() and a.w_present[row] == 0
    with pytest.raises(KeyError):
        rows.free(row)
    with pytest.raises(KeyError):
        rows.key_of(row)
    assert rows.add(WorkerKey(8, 0), 100, 64) == row and a.w_generation[row] == 2  # generation grows per use
