"""Selection kernels == the plain-Python reference (tests/shm/reference.py), bit for bit; the kv selector's
decisions == the reference's rule (its argmin, ties drawn by `CostSelector.select`)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.core.kv_cost import KvSelector
from kvsched.core.selector import CostSelector, SelectionView, TermTable
from kvsched.shm.select_kernels import (
    ADMIT_PARAMS,
    KV_TERMS,
    KV_TERMS_HOME,
    P,
    count_busy,
    credit_rows,
    kv_cost_terms,
    pairwise_sum,
)
from tests.shm import reference


@settings(max_examples=200, deadline=None)
@given(n=st.one_of(st.integers(0, 130), st.integers(131, 1100)), seed=st.integers(0, 2**31))
def test_pairwise_sum_equals_numpy_sum_bit_for_bit(n, seed):
    rng = np.random.default_rng(seed)
    a = rng.random(n + 3) * 10.0 ** rng.integers(-6, 9, n + 3)
    want = float(a[3 : 3 + n].sum())
    assert pairwise_sum(a, 3, n) == want
    assert reference.pairwise_sum(a, 3, n) == want


def _state(seed: int, n: int, n_recent: int):
    rng = np.random.default_rng(seed)
    elig = (rng.random(n) < 0.8).astype(np.uint8)
    overlap = rng.integers(0, 6, n).astype(np.int32)  # small depths: ties between rows are frequent
    if rng.random() < 0.5 and n:
        overlap[rng.integers(n)] += rng.integers(1, 70)  # one deep row (the lead bonus)
    prefill = np.where(elig != 0, rng.integers(0, 5000, n), -1).astype(np.int64)
    blocks = np.where(elig != 0, rng.integers(0, 3000, n), -1).astype(np.int64)
    active_prefill = rng.integers(0, 40000, n).astype(np.int64)
    max_batched = rng.choice([512, 2048, 8192], n).astype(np.int64)
    recent = rng.random(n_recent) * rng.choice([0.0, 100.0, 10000.0])
    return elig, overlap, prefill, blocks, active_prefill, max_batched, recent


PARAMS = dict(
    prefill_weight=16.0,
    active_blocks_weight=0.1,
    lead_bonus=160.0,
    lead_cap_blocks=64.0,
    lead_release_steps=16.0,
    lead_release_recent_ratio=2.0,
    recent_weight=1.0,
    lead_release_requests_ratio=2.0,
    lead_max_wait_steps=10.0,
    lead_max_wait_per_lead=3.0,
    interference_weight=1.0,
    interference_cap_prompts=0.1,
)
# values that switch each term on, off and to edges where it binds or not (interference cap 0.0 = uncapped)
TERM_KNOBS = dict(
    lead_release_requests_ratio=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    lead_max_wait_steps=st.sampled_from([0.0, 0.05, 1.0, 8.0, 10.0]),
    lead_max_wait_per_lead=st.sampled_from([0.0, 1.0, 3.0]),
    interference_weight=st.sampled_from([0.0, 1.0, 0.37]),
    interference_cap_prompts=st.sampled_from([0.0, 0.01, 0.1, 5.0]),
)
# the opt-in keys: the home term and the predicted-seconds prefill / outright lead
OPT_IN_KNOBS = dict(
    home=st.sampled_from([0.0, 0.08, 0.5]),
    home_min=st.sampled_from([0, 2000, 16384]),
    ref_us=st.sampled_from([0.0, 0.0, 30.0]),
    extra_ttft_s=st.sampled_from([0.0, 0.0, 0.05, 5.0]),
)


def _requests(seed: int, n: int) -> np.ndarray:
    """Active requests per row: small, often a nearly idle fleet (the rule's floor of 1 on the others'
    mean), sometimes one row far above the others (the release rule)."""
    rng = np.random.default_rng(seed + 1)
    active = rng.integers(0, rng.choice([2, 9]), n).astype(np.int64)
    if n and rng.random() < 0.4:
        active[rng.integers(n)] += rng.integers(5, 60)
    return active


def _params(p: dict, block_size: int = 16) -> np.ndarray:
    """The kernel's params array from keyword values (`ADMIT_PARAMS` names)."""
    params = np.zeros(len(ADMIT_PARAMS))
    params[P["inv_bs"]], params[P["block_size"]] = 1.0 / block_size, float(block_size)
    for name, v in p.items():
        params[P[name]] = v
    return params


@settings(max_examples=400, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n=st.one_of(st.integers(1, 40), st.integers(129, 300)),
    recent_short=st.integers(0, 5),
    zero_weights=st.booleans(),
    decay=st.sampled_from([1.0, 0.5, 0.013]),
    isl=st.integers(0, 20000),
    **TERM_KNOBS,
    **OPT_IN_KNOBS,
)
def test_kv_cost_terms_agree_with_reference(
    seed, n, recent_short, zero_weights, decay, isl, home, home_min, ref_us, extra_ttft_s, **knobs
):
    """Terms, total, argmin and tie count equal the reference's, bit for bit, with every term on or off,
    the home term given or not, the predicted-seconds keys on or off and more rows than one pairwise
    block (the recent-work release rule's mean)."""
    elig, overlap, prefill, blocks, ap, mb, recent = _state(seed, n, max(0, n - recent_short))
    active = _requests(seed, n)
    p = dict(PARAMS, **knobs)
    if zero_weights:
        p.update(active_blocks_weight=0.0, recent_weight=0.0)
    p.update(home_weight=home, home_min_prefill_tokens=home_min, prefill_seconds_ref_us=ref_us)
    p.update(lead_max_extra_ttft_s=extra_ttft_s)
    rng = np.random.default_rng(seed + 2)
    extra = np.stack([rng.random(n) * rng.choice([0.0, 1.0, 30.0]), rng.integers(0, 4, n) * 1e5 + 7.0])
    n_terms = 6 if home > 0.0 else 5
    outs = []
    for fn in (kv_cost_terms, reference.kv_cost_terms):
        terms, total, pick = np.zeros((n_terms, n)), np.zeros(n), np.zeros(2, np.int64)
        i = fn(
            prefill,
            blocks,
            ap,
            mb,
            elig,
            overlap,
            recent,
            decay,
            active,
            isl,
            _params(p),
            extra.copy(),
            np.zeros((2, n)),
            terms,
            total,
            pick,
        )
        outs.append((i, terms, total, pick))
    (i, terms, total, pick), (ri, rterms, rtotal, rpick) = outs
    assert i == ri and (pick == rpick).all()
    np.testing.assert_array_equal(terms, rterms)
    np.testing.assert_array_equal(total, rtotal)


def _decayed_home(sel: KvSelector, n: int, now_us: int) -> np.ndarray:
    """The selector's home counts brought to `now_us` (what it gives the kernel as `extra[0]`)."""
    h = np.zeros(n)
    m = min(n, sel.home.size)
    h[:m] = sel.home[:m] * 2.0 ** (-max(0, now_us - sel.home_at_us) / sel.home_half_life_us)
    return h


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n=st.integers(1, 24),
    isl=st.integers(0, 40000),
    temperature=st.sampled_from([0.0, 0.0, 0.5]),
    **TERM_KNOBS,
    **OPT_IN_KNOBS,
)
def test_kv_select_explained_decides_the_reference_rule(
    seed, n, isl, temperature, home, home_min, ref_us, extra_ttft_s, **knobs
):
    """`KvSelector.select_explained` (the Python path: its packed keys, learnt recent work and home
    counts, the predicted-seconds model, ties and softmax drawn from its RNG) picks what
    `CostSelector.select` picks on the reference's total, with the reference's terms ("home" shown
    for a prompt the home term may price); `terms` gives the same rows by name."""
    elig, overlap, prefill, blocks, ap, mb, recent = _state(seed, n, n)
    if not elig.any():
        elig[0] = 1
    kw = dict(seed=seed % 97, temperature=temperature, home_weight=home, home_min_prefill_tokens=home_min)
    kw.update(prefill_seconds_ref_us=ref_us, lead_max_extra_ttft_s=extra_ttft_s, **knobs)
    sel, twin = KvSelector(**kw), KvSelector(**kw)  # twin: its RNG and model stand in for the reference's
    now = 5_000_000
    for s in (sel, twin):
        s.recent = recent.copy()
        for r in range(0, n, 3):  # cache-reusing admissions: home counts on some rows
            s.note_home(r, 1000, 100 * (r % 4), now - 1_000_000 * (r % 5))
    view = SelectionView(prefill, blocks, ap, blocks, blocks, mb, isl, 16, now)
    costs = np.zeros(n)
    active = _requests(seed, n)
    with_home = home > 0.0 and (twin.ttft_model is not None or isl >= home_min)
    for _ in range(3):  # repeated: tie-breaks and softmax draw from each selector's RNG the same way
        row, table = sel.select_explained(costs, elig, active, overlap_blocks=overlap, view=view)
        ttft = twin.ttft_model.predicted_ttft_us(view) if twin.ttft_model is not None else np.zeros(n)
        extra = np.stack([_decayed_home(twin, n, now), ttft])
        terms, total = np.zeros((6 if with_home else 5, n)), np.zeros(n)
        params = _params({name: getattr(twin, name) for name in ADMIT_PARAMS[3:15] + ADMIT_PARAMS[19:]})
        reference.kv_cost_terms(
            prefill,
            blocks,
            ap,
            mb,
            elig,
            overlap,
            twin.recent,
            twin.decay(now),
            active,
            isl,
            params,
            extra,
            None,
            terms,
            total,
            np.zeros(2, np.int64),
        )
        assert row == CostSelector.select(twin, total, elig, active)
        assert isinstance(table, TermTable) and table.names == (KV_TERMS_HOME if with_home else KV_TERMS)
        np.testing.assert_array_equal(table.rows, terms)
        by_name = sel.terms(costs, elig, overlap, view, active)
        assert list(by_name) == list(KV_TERMS_HOME if home > 0.0 else KV_TERMS)
        for k, name in enumerate(KV_TERMS):
            np.testing.assert_array_equal(by_name[name], terms[k])


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n=st.integers(1, 30),
    thr=st.sampled_from([-1, 0, 100, 4000]),
    frac=st.sampled_from([-1.0, 0.5, 1.0, 2.5]),
)
def test_count_busy_agrees_with_reference(seed, n, thr, frac):
    elig, _, _, _, ap, mb, _ = _state(seed, n, 0)
    got = count_busy(ap, mb, elig, thr, frac)
    assert got == reference.count_busy(ap, mb, elig, thr, frac)


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n=st.integers(1, 70),
    has_offload=st.booleans(),
    credit=st.sampled_from([0.0, 0.25, 0.5, 1.0, 0.3]),
)
def test_credit_rows_agrees_with_reference(seed, n, has_offload, credit):
    rng = np.random.default_rng(seed)
    approx, device, offload, spec = (rng.integers(0, 40, n).astype(np.int32) for _ in range(4))
    fed = (rng.random(n) < 0.7).astype(np.uint8)
    flags = rng.choice(np.array([0, 1, 2, 4, 5, 6], np.uint8), n)
    outs = []
    for fn in (credit_rows, reference.credit_rows):
        raw, out = np.full(n, -9, np.int32), np.full(n, -9, np.int32)
        fn(approx, device, offload, spec, fed, flags, 4, credit, has_offload, raw, out)
        outs.append((raw, out))
    for raw, out in outs:
        np.testing.assert_array_equal(raw, spec)
        np.testing.assert_array_equal(out, outs[0][1])
