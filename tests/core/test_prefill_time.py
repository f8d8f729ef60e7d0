"""The predicted-seconds model of the `kv` selector (`kvsched/core/prefill_time.py`, docs/ROUTING.md):
the queue of each row is the newest admitted bookings covering its active prefill, each priced by the
prefill cost model; the opt-in lead rule keeps a turn home while its predicted TTFT there is within
`lead_max_extra_ttft_s` of the best other worker's."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.config import SelectorConfig
from kvsched.core.kv_cost import KvSelector
from kvsched.core.prefill_time import PrefillTimeModel
from kvsched.core.selector import SelectionView, create_selector

A, B = 30.0, 1.33  # µs per token, µs per token per 1,000 tokens of context (the defaults)


def _ref_us(u: float, cached: float) -> float:
    """Reference: prefilling u tokens after `cached` ones, token by token (the i-th sees cached + i + 1/2)."""
    return sum(A + B * (cached + i + 0.5) / 1000.0 for i in range(int(u)))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 3000), st.integers(0, 50_000))
def test_own_us_is_the_sum_over_tokens_of_the_per_token_cost(u, cached):
    m = PrefillTimeModel(A, B)
    assert m.own_us(float(u), float(cached)) == pytest.approx(_ref_us(u, cached), rel=1e-9, abs=1e-6)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 100_000), st.data())
def test_a_deeper_cached_prefix_never_predicts_a_longer_prefill(isl, data):
    """u x (a + b x (isl - u + u/2)) grows with u = isl - cached: more cached tokens never cost more."""
    m = PrefillTimeModel(A, B)
    c1 = data.draw(st.integers(0, isl))
    c2 = data.draw(st.integers(c1, isl))
    assert m.own_us(float(isl - c2), float(c2)) <= m.own_us(float(isl - c1), float(c1)) + 1e-9


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.integers(0, 20_000), st.integers(0, 30_000)), min_size=1, max_size=30),
    st.lists(st.integers(0, 2), max_size=30),
)
def test_queue_is_the_bookings_not_yet_prefilled_first_come_first_served(bookings, done_rows):
    """Reference model: a list of bookings per row, finished oldest first (a chunked-prefill engine's
    FCFS queue); the ledger's active prefill is the sum of the unfinished ones' tokens. `queue_us`
    must equal the sum of their predicted µs, whatever the order of admissions and completions."""
    m = PrefillTimeModel(A, B)
    ref: list[list[tuple[int, float]]] = [[], [], []]
    for row, u, cached in bookings:
        m.admitted(row, u, u + cached)
        ref[row].append((u, float(m.own_us(float(u), float(cached)))))
    for row in done_rows:
        if ref[row]:
            ref[row].pop(0)
    active = np.array([sum(u for u, _ in q) for q in ref], np.int64)
    got = m.queue_us(active)
    want = [sum(us for _, us in q) for q in ref]
    # equal bookings of 0 tokens cannot be told apart by the token sum: they add 0 µs either way
    assert got.tolist() == pytest.approx(want, rel=1e-9, abs=1e-6)


def test_prefill_the_model_never_saw_is_charged_at_the_base_rate():
    m = PrefillTimeModel(A, B)
    assert m.queue_us(np.array([1000, 0], np.int64)).tolist() == [1000 * A, 0.0]
    m.admitted(0, 500, 500)
    assert m.queue_us(np.array([1500], np.int64))[0] == pytest.approx(m.own_us(500.0, 0.0) + 1000 * A)


MOONCAKE_BS = 512


def _home_or_away(queue_prompts: list[int], max_extra_s: float) -> int:
    """2 workers, block size 512: a 20-block turn whose history (19 blocks) is cached only on worker 0,
    whose queue holds `queue_prompts` (uncached prompts, nothing cached); worker 1 is idle and holds
    nothing. Load and release rules off, so only the prefill and lead terms decide. Returns the row."""
    sel = KvSelector(
        seed=0,
        active_blocks_weight=0.0,
        recent_weight=0.0,
        interference_weight=0.0,
        lead_release_requests_ratio=0.0,
        lead_release_recent_ratio=0.0,
        lead_max_extra_ttft_s=max_extra_s,
    )
    for p in queue_prompts if sel.ttft_model is not None else ():
        sel.ttft_model.admitted(0, p, p)
    isl = 20 * MOONCAKE_BS
    cached = np.array([19, 0]) * MOONCAKE_BS
    queue = np.array([sum(queue_prompts), 0], np.int64)
    prefill = queue + isl - cached
    view = SelectionView(
        prefill,
        np.zeros(2, np.int64),
        queue,
        np.zeros(2, np.int64),
        np.full(2, 10_000, np.int64),
        np.full(2, 8192, np.int64),
        isl,
        MOONCAKE_BS,
        0,
    )
    return sel.select(
        np.zeros(2),
        np.ones(2, np.uint8),
        np.zeros(2, np.int64),
        overlap_blocks=np.array([19, 0], np.int32),
        request_blocks=20,
        view=view,
    )


def test_the_seconds_rule_tells_a_queue_of_short_prompts_from_one_long_prompt_of_the_same_tokens():
    """100,000 queued tokens at home as 50 prompts of 2,000 tokens predict ~3.1 s of queue; as one
    100,000-token prompt, ~9.7 s (attention over its own context). Recomputing the 9,728-token history
    on the idle worker predicts ~0.36 s. With 5 s of allowed extra TTFT the turn stays home behind the
    short prompts and leaves the long one. In tokens the two queues are the same, and the default
    rule (extra-wait cap max(10 x 8192, 3 x 9,728) = 81,920 tokens < 100,000 - 9,728) sends both away."""
    assert _home_or_away([2000] * 50, 5.0) == 0
    assert _home_or_away([100_000], 5.0) == 1
    assert _home_or_away([2000] * 50, 0.0) == 1  # off: the token cap decides
    assert _home_or_away([100_000], 0.0) == 1


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 5), st.floats(0.1, 20.0), st.data())
def test_the_lead_never_buys_more_predicted_extra_ttft_than_allowed(w, max_extra_s, data):
    """Reference: with the seconds rule on and the token cap off, whenever the chosen row is not the one
    of least predicted TTFT, it is the lead row and its predicted TTFT is within the allowance."""
    depth = np.array(data.draw(st.lists(st.integers(0, 40), min_size=w, max_size=w)), np.int32)
    prompts = [data.draw(st.lists(st.integers(1, 60_000), max_size=4)) for _ in range(w)]
    sel = KvSelector(
        seed=0,
        active_blocks_weight=0.0,
        recent_weight=0.0,
        interference_weight=0.0,
        lead_release_requests_ratio=0.0,
        lead_release_recent_ratio=0.0,
        lead_release_steps=1e9,
        lead_max_wait_steps=0.0,
        lead_bonus=0.0,
        lead_max_extra_ttft_s=max_extra_s,
    )
    for r, ps in enumerate(prompts):
        for p in ps:
            sel.ttft_model.admitted(r, p, p)
    bs = 512
    isl = bs * (int(depth.max()) + data.draw(st.integers(1, 10)))
    queue = np.array([sum(ps) for ps in prompts], np.int64)
    prefill = queue + isl - np.minimum(isl, depth.astype(np.int64) * bs)
    view = SelectionView(
        prefill,
        np.zeros(w, np.int64),
        queue,
        np.zeros(w, np.int64),
        np.full(w, 10_000, np.int64),
        np.full(w, 8192, np.int64),
        isl,
        bs,
        0,
    )
    ttft = sel.ttft_model.predicted_ttft_us(view)
    row = sel.select(np.zeros(w), np.ones(w, np.uint8), np.zeros(w, np.int64), overlap_blocks=depth, view=view)
    if prefill[row] > prefill.min():  # not what the prefill term alone picks: the lead rule held it
        others = np.delete(np.arange(w), row)
        assert depth[row] > depth[others].max()
        assert ttft[row] <= ttft[others].min() + max_extra_s * 1e6 + 1e-6


def test_off_by_default_and_the_keys_reach_the_selector():
    assert KvSelector(seed=0).ttft_model is None
    sel = create_selector(
        SelectorConfig(
            type="kv",
            lead_max_extra_ttft_s=2.0,
            prefill_seconds_ref_us=45.0,
            prefill_us_per_token=20.0,
            prefill_attn_us_per_token_ktoken=2.0,
        )
    )
    assert isinstance(sel, KvSelector) and sel.ttft_model is not None
    assert (sel.lead_max_extra_ttft_s, sel.prefill_seconds_ref_us) == (2.0, 45.0)
    assert (sel.ttft_model.a, sel.ttft_model.b) == (20.0, 2.0)


def test_admitted_feeds_the_model_with_the_decision_s_prompt_length():
    sel = KvSelector(seed=0, lead_max_extra_ttft_s=1.0)
    view = SelectionView(
        np.array([4096, 4096], np.int64),
        np.zeros(2, np.int64),
        np.zeros(2, np.int64),
        np.zeros(2, np.int64),
        np.full(2, 10_000, np.int64),
        np.full(2, 8192, np.int64),
        8192,
        512,
        0,
    )
    sel.select(
        np.zeros(2), np.ones(2, np.uint8), np.zeros(2, np.int64), overlap_blocks=np.zeros(2, np.int32), view=view
    )
    sel.admitted(1, 4096, 0)  # 4,096 uncached after 4,096 cached
    q = sel.ttft_model.queue_us(np.array([0, 4096], np.int64))
    assert q[1] == pytest.approx(sel.ttft_model.own_us(4096.0, 4096.0)) and q[0] == 0.0
