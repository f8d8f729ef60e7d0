"""The `kv` cost's "home" term (docs/ROUTING.md): a request with a large uncached prefill is charged, on
each worker, its own uncached prefill x that worker's share of recent cache-reusing admissions, so long
prompts do not queue in front of the short turns of the conversations that live there."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.config import SelectorConfig
from kvsched.core.kv_cost import KvSelector
from kvsched.core.selector import SelectionView, create_selector

HALF_LIFE_US = 30_000_000


def _view(prefill, active_prefill, isl, bs=16, now_us=0) -> SelectionView:
    w = len(prefill)
    return SelectionView(
        np.asarray(prefill, np.int64),
        np.zeros(w, np.int64),
        np.asarray(active_prefill, np.int64),
        np.zeros(w, np.int64),
        np.full(w, 10_000, np.int64),
        np.full(w, 8192, np.int64),
        isl,
        bs,
        now_us,
    )


def _admit(sel: KvSelector, row: int, isl: int, cached: int, now_us: int) -> None:
    """One admission as the dispatcher makes it: a decision for an `isl`-token prompt, then `admitted`."""
    sel._last_isl = isl
    sel.admitted(row, isl - cached, now_us)


def _reference(counts, times_us, now_us, own, weight, prefill_weight, bs, min_tokens, half_life_us):
    """Per row, by the definition: h_w = sum over its reusing admissions of 2^-(age / half-life);
    term = weight x prefill_weight x own_w / B x (h_w - min h) / mean h, 0 for own_w < min_tokens."""
    h = [sum(2.0 ** (-(now_us - t) / half_life_us) for t in ts[:c]) for c, ts in zip(counts, times_us, strict=True)]
    mean, low = sum(h) / len(h), min(h)
    if mean <= 0.0:
        return [0.0] * len(h)
    return [
        weight * prefill_weight * o / bs * (x - low) / mean if o >= min_tokens else 0.0
        for o, x in zip(own, h, strict=True)
    ]


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 6), st.data())
def test_home_term_matches_its_definition(w, data):
    """The term against a direct evaluation of its formula: decayed counts of cache-reusing admissions
    per worker, relative to the eligible mean, measured from the least, times own uncached prefill."""
    weight = data.draw(st.floats(0.01, 5.0))
    min_tokens = data.draw(st.sampled_from([0, 1000, 16384]))
    sel = KvSelector(seed=0, home_weight=weight, home_min_prefill_tokens=min_tokens)
    times = [sorted(data.draw(st.lists(st.integers(0, 60_000_000), max_size=5))) for _ in range(w)]
    events = sorted((t, r) for r, ts in enumerate(times) for t in ts)
    for t, r in events:
        _admit(sel, r, isl=4000, cached=3000, now_us=t)
    now = 60_000_000 + data.draw(st.integers(0, 30_000_000))
    own = np.array(data.draw(st.lists(st.integers(0, 60_000), min_size=w, max_size=w)), np.int64)
    queue = np.array(data.draw(st.lists(st.integers(0, 50_000), min_size=w, max_size=w)), np.int64)
    view = _view(queue + own, queue, isl=int(own.max()) + 1, now_us=now)
    t = sel.terms(np.zeros(w), np.ones(w, np.uint8), np.zeros(w, np.int32), view, np.zeros(w, np.int64))
    ref = _reference(
        [len(ts) for ts in times], times, now, own.tolist(), weight, sel.prefill_weight, 16, min_tokens, HALF_LIFE_US
    )
    np.testing.assert_allclose(t["home"], ref, rtol=1e-9, atol=1e-9)


def test_only_admissions_that_reuse_enough_of_their_prompt_count():
    """An admission counts when its cached tokens are > 0 and >= home_min_cached_share of its prompt."""
    sel = KvSelector(seed=0, home_weight=1.0, home_min_cached_share=0.5)
    _admit(sel, 0, isl=1000, cached=500, now_us=0)  # half cached: counts
    _admit(sel, 1, isl=1000, cached=499, now_us=0)  # just under: does not
    _admit(sel, 2, isl=1000, cached=0, now_us=0)  # nothing cached: does not
    assert sel.home.tolist() == [1.0]
    any_share = KvSelector(seed=0, home_weight=1.0, home_min_cached_share=0.0)
    _admit(any_share, 1, isl=1000, cached=1, now_us=0)
    _admit(any_share, 2, isl=1000, cached=0, now_us=0)
    assert any_share.home.tolist() == [0.0, 1.0]


def test_on_by_default_and_switchable_off():
    """On by default (docs/ROUTING.md): the fused kernel is not given the home counts, so it decides only
    prompts shorter than home_min_prefill_tokens (the term is 0 on every row for them).
    home_weight 0: no state, no "home" term, the fused kernel may decide any prompt."""
    assert KvSelector(seed=0).home_weight == SelectorConfig().home_weight == 0.08
    on = KvSelector(seed=0)
    assert on.decides_by_kernel() and on.kernel_may_decide(16383) and not on.kernel_may_decide(16384)
    off = KvSelector(seed=0, home_weight=0.0)
    _admit(off, 0, isl=1000, cached=900, now_us=0)
    assert off.home.size == 0 and off.decides_by_kernel() and off.kernel_may_decide(10**6)
    view = _view([20_000, 20_000], [0, 0], isl=20_000)
    assert "home" not in off.terms(np.zeros(2), np.ones(2, np.uint8), np.zeros(2, np.int32), view)
    sel = create_selector(
        SelectorConfig(
            type="kv", home_weight=0.5, home_half_life_s=10.0, home_min_cached_share=0.25, home_min_prefill_tokens=100
        )
    )
    assert isinstance(sel, KvSelector) and not sel.kernel_may_decide(100) and sel.kernel_may_decide(99)
    assert (sel.home_weight, sel.home_half_life_us, sel.home_min_cached_share, sel.home_min_prefill_tokens) == (
        0.5,
        10e6,
        0.25,
        100,
    )


@pytest.mark.parametrize("seed", range(5))
def test_a_long_uncached_prompt_avoids_the_worker_home_to_recent_cache_reusing_work(seed):
    """Two equally loaded workers; worker 0 just served 10 turns that reused their cached history,
    worker 1 served none. A 40k-token prompt cached nowhere goes to worker 1 with the default weight (a
    tie broken at random with the term off); a short prompt under home_min_prefill_tokens is not steered."""
    on = KvSelector(seed=seed, recent_weight=0.0)  # the default home_weight
    for k in range(10):
        _admit(on, 0, isl=8000, cached=7000, now_us=k * 1_000_000)
    elig, depth, active = np.ones(2, np.uint8), np.zeros(2, np.int32), np.array([5, 5], np.int64)
    long_view = _view([40_000, 40_000], [0, 0], isl=40_000, now_us=10_000_000)
    assert on.select(np.zeros(2), elig, active, overlap_blocks=depth, view=long_view) == 1
    off_picks = {
        KvSelector(seed=s, recent_weight=0.0, home_weight=0.0).select(
            np.zeros(2), elig, active, overlap_blocks=depth, view=long_view
        )
        for s in range(20)
    }
    assert off_picks == {0, 1}
    short = _view([2_000, 2_000], [0, 0], isl=2_000, now_us=10_000_000)
    t = on.terms(np.zeros(2), elig, depth, short, active)
    assert not t["home"].any()
