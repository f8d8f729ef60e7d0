"""WorkerSelector: argmin with random tie-break, softmax, kvsched's own simple selectors (docs/DESIGN.md
§4.12). The kvsched-bench baselines' tests are in tests/bench/test_baselines.py."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from kvsched.config import SelectorConfig
from kvsched.core.selector import create_selector

NONE = np.zeros(6, np.int64)


def sel(kind="kv", **kw):
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
    for kind in ("kv", "round_robin", "random", "least_loaded", "power_of_two"):
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
    assert [a.select(np.array([1.0, 2.0, 3.0]), elig, NONE) for _ in range(50)] == [
        b.select(np.array([100.0, 200.0, 300.0]), elig, NONE) for _ in range(50)
    ]
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
    with pytest.raises(ValueError, match="unknown selector 'nope'; installed selectors"):
        create_selector(cfg)
