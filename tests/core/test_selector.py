"""WorkerSelector: argmin with random tie-break, softmax, baselines (docs/DESIGN.md §4.12)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from kvsched.config import SelectorConfig
from kvsched.core.selector import create_selector

NONE = np.zeros(6, np.int64)


def sel(kind="dynamo_cost", **kw):
    return create_selector(SelectorConfig(type=kind, seed=kw.pop("seed", 1), **kw))


def test_kv_picks_argmin_when_unique():
    s = sel()
    costs = np.array([5.0, 2.0, 1.0, 3.0])
    assert s.select(costs, np.array([1, 1, 1, 1], np.uint8), NONE) == 2
    assert s.select(costs, np.array([1, 1, 0, 1], np.uint8), NONE) == 1


def test_kv_tie_break_is_uniform_among_minima():
    s = sel()
    costs = np.array([1.0, 4.0, 1.0, 1.0, np.inf])
    elig = np.array([1, 1, 1, 1, 0], np.uint8)
    counts = Counter(s.select(costs, elig, NONE) for _ in range(3000))
    assert set(counts) == {0, 2, 3}
    for row in (0, 2, 3):
        assert 850 < counts[row] < 1150


def test_every_selector_returns_minus_one_when_none_eligible():
    for kind in ("kv", "dynamo_cost", "round_robin", "random", "least_loaded", "power_of_two", "cache_aware",
                 "lmetric", "llmd", "llmd_sticky"):
        assert sel(kind).select(np.zeros(3), np.zeros(3, np.uint8), np.zeros(3, np.int64)) == -1


def test_softmax_prefers_lower_cost_when_temperature_positive():
    s = sel(temperature=0.5)
    costs = np.array([10.0, 20.0, 30.0])
    counts = Counter(s.select(costs, np.ones(3, np.uint8), NONE) for _ in range(4000))
    assert counts[0] > counts[1] > counts[2] > 0
    # normalised costs 0, 0.5, 1 -> weights e^0, e^-1, e^-2
    assert abs(counts[0] / 4000 - 1 / (1 + np.exp(-1) + np.exp(-2))) < 0.04


def test_softmax_is_scale_free_and_uniform_when_costs_equal():
    a, b = sel(temperature=1.0, seed=3), sel(temperature=1.0, seed=3)
    elig = np.ones(3, np.uint8)
    assert [a.select(np.array([1.0, 2.0, 3.0]), elig, NONE) for _ in range(50)] == [b.select(np.array([100.0, 200.0, 300.0]), elig, NONE) for _ in range(50)]
    counts = Counter(a.select(np.full(3, 7.0), elig, NONE) for _ in range(3000))
    assert set(counts) == {0, 1, 2}


def test_round_robin_cycles_over_eligible_rows():
    s = sel("round_robin")
    elig = np.array([1, 0, 1, 1], np.uint8)
    assert [s.select(np.zeros(4), elig, NONE) for _ in range(5)] == [0, 2, 3, 0, 2]


def test_random_covers_eligible_rows_only():
    s = sel("random")
    elig = np.array([0, 1, 1, 0], np.uint8)
    assert {s.select(np.zeros(4), elig, NONE) for _ in range(200)} == {1, 2}


def test_least_loaded_picks_fewest_active_with_random_ties():
    s = sel("least_loaded")
    active = np.array([3, 1, 1, 0], np.int64)
    elig = np.array([1, 1, 1, 0], np.uint8)
    assert {s.select(np.zeros(4), elig, active) for _ in range(200)} == {1, 2}


def test_power_of_two_never_picks_the_most_loaded_of_many():
    s = sel("power_of_two")
    active = np.array([0, 5, 5, 9], np.int64)
    elig = np.ones(4, np.uint8)
    picks = Counter(s.select(np.zeros(4), elig, active) for _ in range(2000))
    assert 3 not in picks and picks[0] > picks[1]
    assert s.select(np.zeros(4), np.array([0, 0, 1, 0], np.uint8), active) == 2


def test_seeded_selectors_are_reproducible():
    costs = np.zeros(8)
    elig = np.ones(8, np.uint8)
    a, b = sel("random", seed=42), sel("random", seed=42)
    assert [a.select(costs, elig, NONE) for _ in range(20)] == [b.select(costs, elig, NONE) for _ in range(20)]


def test_create_selector_raises_for_unknown_type():
    cfg = SelectorConfig()
    cfg.type = "nope"  # bypasses config validation on purpose
    with pytest.raises(ValueError, match="unknown selector type"):
        create_selector(cfg)


def test_cache_aware_prefers_longest_match_when_above_threshold():
    s = sel("cache_aware")
    elig = np.ones(4, np.uint8)
    active = np.array([3, 0, 5, 1], np.int64)
    depth = np.array([2, 0, 6, 1], np.int32)  # 6 of 10 blocks > 0.3
    assert {s.select(np.zeros(4), elig, active, overlap_blocks=depth, request_blocks=10) for _ in range(20)} == {2}
    # the longest match ties: fewer active requests wins
    depth = np.array([6, 0, 6, 1], np.int32)
    assert s.select(np.zeros(4), elig, active, overlap_blocks=depth, request_blocks=10) == 0


def test_cache_aware_picks_smallest_cache_when_match_below_threshold():
    s = sel("cache_aware")
    elig = np.ones(3, np.uint8)
    active = np.zeros(3, np.int64)
    none = np.zeros(3, np.int32)
    picks = []
    for _ in range(3):
        picks.append(s.select(np.zeros(3), elig, active, overlap_blocks=none, request_blocks=10))
        s.note_admitted(picks[-1], 0, 10)  # each admission grows that row's cache
    assert set(picks) == {0, 1, 2}
    low = np.array([2, 0, 0], np.int32)  # 2 of 10 blocks: not above 0.3, so no cache affinity
    s.note_admitted(0, 2, 10)
    assert s.select(np.zeros(3), elig, active, overlap_blocks=low, request_blocks=10) in (1, 2)


def test_cache_aware_falls_back_to_least_loaded_when_imbalanced():
    s = sel("cache_aware")
    elig = np.array([1, 1, 1, 0], np.uint8)
    depth = np.array([10, 0, 0, 0], np.int32)  # full match on row 0 ...
    active = np.array([100, 20, 30, 0], np.int64)  # ... but 100 - 20 > 64 and 100 > 1.5 * 20
    assert s.select(np.zeros(4), elig, active, overlap_blocks=depth, request_blocks=10) == 1
    balanced = np.array([70, 20, 30, 0], np.int64)  # 70 - 20 <= 64: cache affinity again
    assert s.select(np.zeros(4), elig, balanced, overlap_blocks=depth, request_blocks=10) == 0


def _view(active_prefill, active_blocks=None, isl=160, bs=16, mbt=100):
    from kvsched.core.selector import SelectionView

    w = len(active_prefill)
    ap = np.asarray(active_prefill, np.int64)
    ab = np.zeros(w, np.int64) if active_blocks is None else np.asarray(active_blocks, np.int64)
    return SelectionView(ap + isl, ab + isl // bs, ap, ab, np.full(w, 100, np.int64), np.full(w, mbt, np.int64), isl, bs, 0)


def test_lmetric_multiplies_new_prefill_tokens_by_batch_size():
    s = sel("lmetric")
    elig = np.ones(3, np.uint8)
    depth = np.array([8, 2, 0], np.int32)  # new tokens 32, 128, 160 (isl 160, B 16)
    active = np.array([4, 1, 1], np.int64)  # scores 128, 128, 160: tie -> fewer new tokens (row 0)
    assert s.select(np.zeros(3), elig, active, overlap_blocks=depth, view=_view([0, 0, 0])) == 0
    active = np.array([5, 1, 1], np.int64)  # 160, 128, 160
    assert s.select(np.zeros(3), elig, active, overlap_blocks=depth, view=_view([0, 0, 0])) == 1


def test_llmd_weights_prefix_3_queue_2_kv_2():
    s = sel("llmd")
    elig = np.ones(2, np.uint8)
    # row 0: full prefix match (3) but the longest queue (0) and half the KV used (1) -> 4
    # row 1: no match (0), shortest queue (2), empty KV (2) -> 4 ... tie broken by adding one KV block on row 1
    view = _view([0, 0], active_blocks=[50, 1])
    assert s.select(np.zeros(2), elig, np.array([3, 0], np.int64), overlap_blocks=np.array([10, 0], np.int32),
                    request_blocks=10, view=view) == 0
    view = _view([0, 0], active_blocks=[60, 0])
    assert s.select(np.zeros(2), elig, np.array([3, 0], np.int64), overlap_blocks=np.array([10, 0], np.int32),
                    request_blocks=10, view=view) == 1


def test_llmd_sticky_keeps_affinity_until_tau_then_releases_it():
    s = sel("llmd_sticky")
    elig = np.ones(2, np.uint8)
    depth = np.array([2, 0], np.int32)  # a shallow match: plain llmd prefers the idle row 1
    active = np.array([5, 0], np.int64)
    assert sel("llmd").select(np.zeros(2), elig, active, overlap_blocks=depth, request_blocks=10,
                              view=_view([3500, 0])) == 1
    tau = 35 * 100
    assert s.select(np.zeros(2), elig, active, overlap_blocks=depth, request_blocks=10, view=_view([tau, 0])) == 0
    assert s.select(np.zeros(2), elig, active, overlap_blocks=depth, request_blocks=10, view=_view([tau + 1, 0])) == 1
