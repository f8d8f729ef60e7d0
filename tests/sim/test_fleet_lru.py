"""The fleet-LRU reference (`Trace.fleet_lru_hit_tokens`) against a list-based LRU model and its bounds."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.sim.trace import Trace

BS = 4


def _trace(reqs: list[list[int]]) -> Trace:
    lens = np.array([len(r) for r in reqs], np.int64)
    offs = np.zeros(len(reqs) + 1, np.int64)
    np.cumsum(lens, out=offs[1:])
    flat = np.array([h for r in reqs for h in r], np.uint64)
    isl = np.maximum(1, lens * BS)
    return Trace(np.arange(len(reqs), dtype=np.int64), isl, np.ones(len(reqs), np.int64), offs, flat, BS)


def _model(reqs: list[list[int]], cap: int) -> int:
    lru: list[int] = []  # least recently used first
    total = 0
    for r in reqs:
        hit = 0
        for h in r:
            if h not in lru:
                break
            hit += 1
        total += min(hit * BS, max(1, len(r) * BS) - 1)
        for h in r:
            if h in lru:
                lru.remove(h)
            lru.append(h)
        del lru[: max(0, len(lru) - cap)]
    return total


reqs_st = st.lists(st.lists(st.integers(0, 12), min_size=0, max_size=6, unique=True), min_size=1, max_size=30)


@settings(max_examples=150, deadline=None)
@given(reqs_st, st.integers(1, 20))
def test_fleet_lru_matches_a_list_model_and_sits_under_the_infinite_bound(reqs, cap):
    t = _trace(reqs)
    got = t.fleet_lru_hit_tokens(cap)
    assert got == _model(reqs, cap)
    assert got <= t.infinite_cache_hit_tokens()
    assert t.fleet_lru_hit_tokens(10_000) == t.infinite_cache_hit_tokens()


def test_a_small_cache_evicts_the_oldest_conversation():
    a, b = [1, 2, 3], [7, 8, 9]
    t = _trace([a, b, a])
    assert t.fleet_lru_hit_tokens(6) == 3 * BS - 1  # a's 3 blocks hit (capped at isl - 1, as the bound is)
    assert t.fleet_lru_hit_tokens(3) == 0  # b evicted a
