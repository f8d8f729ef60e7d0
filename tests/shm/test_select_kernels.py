"""Selection kernels == the plain-Python reference (tests/shm/reference.py) == the kv selector's array code,
bit for bit (decisions must not change when the kernel replaces the array code)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.core.kv_cost import KvSelector
from kvsched.core.selector import CostSelector, SelectionView, TermTable
from kvsched.shm.select_kernels import KV_TERMS, count_busy, credit_rows, kv_cost_terms, pairwise_sum
from tests.shm import reference


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 128), seed=st.integers(0, 2**31))
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
KERNEL_ORDER = (
    "prefill_weight",
    "active_blocks_weight",
    "recent_weight",
    "lead_bonus",
    "lead_cap_blocks",
    "lead_release_steps",
    "lead_release_recent_ratio",
    "lead_release_requests_ratio",
    "lead_max_wait_steps",
    "lead_max_wait_per_lead",
    "interference_weight",
    "interference_cap_prompts",
)

# values that switch each term on, off and to edges where it binds or not (interference cap 0.0 = uncapped)
TERM_KNOBS = dict(
    lead_release_requests_ratio=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    lead_max_wait_steps=st.sampled_from([0.0, 0.05, 1.0, 8.0, 10.0]),
    lead_max_wait_per_lead=st.sampled_from([0.0, 1.0, 3.0]),
    interference_weight=st.sampled_from([0.0, 1.0, 0.37]),
    interference_cap_prompts=st.sampled_from([0.0, 0.01, 0.1, 5.0]),
)


def _requests(seed: int, n: int) -> np.ndarray:
    """Active requests per row: small, often a nearly idle fleet (the rule's floor of 1 on the others'
    mean), sometimes one row far above the others (the release rule)."""
    rng = np.random.default_rng(seed + 1)
    active = rng.integers(0, rng.choice([2, 9]), n).astype(np.int64)
    if n and rng.random() < 0.4:
        active[rng.integers(n)] += rng.integers(5, 60)
    return active


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n=st.integers(1, 40),
    recent_short=st.integers(0, 5),
    zero_weights=st.booleans(),
    decay=st.sampled_from([1.0, 0.5, 0.013]),
    isl=st.integers(0, 20000),
    **TERM_KNOBS,
)
def test_kv_cost_terms_agree_with_reference_and_the_selector(seed, n, recent_short, zero_weights, decay, isl, **knobs):
    elig, overlap, prefill, blocks, ap, mb, recent = _state(seed, n, max(0, n - recent_short))
    active = _requests(seed, n)
    p = dict(PARAMS, **knobs)
    if zero_weights:
        p.update(active_blocks_weight=0.0, recent_weight=0.0)
    head = (prefill, blocks, ap, mb, elig, overlap, recent)
    tail = (active, isl, 1.0 / 16, *(p[k] for k in KERNEL_ORDER))
    outs = []
    for fn in (kv_cost_terms, reference.kv_cost_terms):
        terms, total, pick = np.zeros((5, n)), np.zeros(n), np.zeros(2, np.int64)
        i = fn(*head, decay, *tail, np.zeros((2, n)), terms, total, pick)
        outs.append((i, terms, total, pick))
    for i, terms, total, pick in outs[1:]:
        assert i == outs[0][0] and (pick == outs[0][3]).all()
        np.testing.assert_array_equal(terms, outs[0][1])
        np.testing.assert_array_equal(total, outs[0][2])
    # the selector's array code (`terms`), which the kernel replaces in `select_explained`
    sel = KvSelector(**p)
    sel.recent, sel.recent_at_us = recent, 0
    half = sel.recent_half_life_us
    now = 0 if decay == 1.0 else int(-np.log2(decay) * half)
    view = SelectionView(prefill, blocks, ap, blocks, blocks, mb, isl, 16, now)
    want = sel.terms(None, elig, overlap, view, active)
    if outs[0][0] != -2:
        dec = sel.decay(now)  # the same decay factor for both
        terms, total, pick = np.zeros((5, n)), np.zeros(n), np.zeros(2, np.int64)
        kv_cost_terms(*head, dec, *tail, np.zeros((2, n)), terms, total, pick)
        for k, name in enumerate(KV_TERMS):
            np.testing.assert_array_equal(terms[k], want[name])
        np.testing.assert_array_equal(
            total, want["prefill"] + want["active_blocks"] + want["lead"] + want["recent"] + want["interference"]
        )


@settings(max_examples=400, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 24), isl=st.integers(0, 20000), **TERM_KNOBS)
def test_kv_select_explained_picks_what_the_array_code_picks(seed, n, isl, **knobs):
    """Same row, terms (and the same RNG draws on ties) as `CostSelector.select` on the array
    total, with the extra-wait cap binding or not, the requests release rule on or off and the
    (capped or uncapped) interference term on or off."""
    elig, overlap, prefill, blocks, ap, mb, recent = _state(seed, n, n)
    if not elig.any():
        elig[0] = 1
    kw = dict(seed=seed % 97, home_weight=0.0, **knobs)  # the kernel's configuration (no home term)
    fast, slow = KvSelector(**kw), KvSelector(**kw)
    for s in (fast, slow):
        s.recent = recent.copy()
    view = SelectionView(prefill, blocks, ap, blocks, blocks, mb, isl, 16, 5_000_000)
    costs = np.zeros(n)
    active = _requests(seed, n)
    for _ in range(3):  # repeated: tie-breaks draw from each selector's RNG the same way
        row, table = fast.select_explained(costs, elig, active, overlap_blocks=overlap, view=view)
        assert isinstance(table, TermTable)  # decided by the kernel, not the array fallback
        t = slow.terms(costs, elig, overlap, view, active)
        want = CostSelector.select(
            slow, t["prefill"] + t["active_blocks"] + t["lead"] + t["recent"] + t["interference"], elig, active
        )
        assert row == want
        assert dict((k, v.tolist()) for k, v in table.items()) == {k: v.tolist() for k, v in t.items()}


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
