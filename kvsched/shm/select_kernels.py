"""Selection kernels: the `kv` selector's cost terms, a class's busy count and the credited overlap
of event-fed rows, one call each.

They compute exactly what the numpy code of `core/kv_cost.py` (`KvSelector.terms` + the total,
extra-wait cap, requests release rule and capped interference included),
`core/admitter.py` (`Admitter.busy_count`) and `core/overlap_view.py`
(the credit rule of docs/DESIGN.md §6.4) compute — same float operations in the same
order, so decisions are bit-identical — without the dozen small numpy calls per decision. The plain-Python
reference with the same names and signatures is tests/shm/reference.py; property tests in
tests/shm/test_select_kernels.py.
"""

from __future__ import annotations

import numpy as np

from .kernel_cache import njit

KV_TERMS = ("prefill", "active_blocks", "lead", "recent", "interference")  # row order of the `terms` array


@njit(cache=True, nogil=True)
def pairwise_sum(a, lo, n):
    """Sum of a[lo:lo+n] (float64, n <= 128) in numpy's pairwise order (8 accumulators), so the
    result equals `a[lo:lo+n].sum()` bit for bit. Longer runs are split recursively by numpy; the
    caller handles them (see `kv_cost_terms`)."""
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[lo + i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    end = n - (n % 8)
    while i < end:
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


PAIRWISE_BLOCK = 128  # numpy's PW_BLOCKSIZE: above it, numpy splits the sum recursively


@njit(cache=True, nogil=True)
def kv_cost_terms(
    prefill_tokens,
    blocks,
    active_prefill,
    max_batched,
    eligible,
    overlap,
    recent,
    decay,
    active_requests,
    isl_tokens,
    inv_bs,
    prefill_weight,
    active_blocks_weight,
    recent_weight,
    lead_bonus,
    lead_cap_blocks,
    lead_release_steps,
    lead_release_recent_ratio,
    lead_release_requests_ratio,
    lead_max_wait_steps,
    lead_max_wait_per_lead,
    interference_weight,
    interference_cap_prompts,
    scratch,
    terms,
    total,
    pick,
):
    """The `kv` selector's terms, their total and its argmin (docs/ROUTING.md; `KvSelector.terms`).

    Args:
        prefill_tokens / blocks: int64[W], projected prefill tokens / active blocks (projection kernel).
        active_prefill / max_batched: int64[W], current prefill tokens / step budget per row (tokens).
        eligible: uint8[W]; overlap: int32[W], credited overlap blocks.
        recent: float64[R] (R may be < W), recent work per row (tokens, decayed to its own time);
            decay: the factor bringing it to now (used only when R > 0).
        active_requests: int64[W], live bookings per row (interference term, requests release rule).
        isl_tokens: the request's prompt tokens (interference cap).
        inv_bs: 1 / block size; the weights, lead, release, extra-wait and interference parameters:
            `[selector]` keys of the kv selector (docs/ROUTING.md).
        scratch: float64[2, W], work space (decayed recent work, eligible rows' values).
        terms: float64[5, W], written: rows in `KV_TERMS` order; ineligible rows +inf / 0 / 0 / 0 / 0.
        total: float64[W], written: the sum of the five rows, in that order.
        pick: int64[2], written: [argmin of total (first), rows whose total equals that minimum].
    Returns:
        int: the argmin of `total` (as `pick[0]`); -1 when `total` holds a NaN, -2 when the lead's
        release rule must sum more than `PAIRWISE_BLOCK` rows (callers fall back to the numpy path
        in both cases; `terms` / `total` are then incomplete).
    """
    n = eligible.shape[0]
    rt = scratch[0]
    vals = scratch[1]
    n_rows = 0
    for w in range(n):
        terms[0, w] = np.inf
        terms[1, w] = 0.0
        terms[2, w] = 0.0
        terms[3, w] = 0.0
        terms[4, w] = 0.0
        rt[w] = 0.0
        if eligible[w] != 0:
            n_rows += 1
    if n_rows > 0:
        pscale = prefill_weight * inv_bs
        m = min(n, recent.shape[0])
        rscale = recent_weight * inv_bs
        for w in range(n):
            if eligible[w] == 0:
                continue
            terms[0, w] = prefill_tokens[w] * pscale
            if active_blocks_weight != 0.0:
                terms[1, w] = blocks[w] * active_blocks_weight
            if w < m:
                rt[w] = recent[w] * decay
                if recent_weight != 0.0:
                    terms[3, w] = rt[w] * rscale
        if interference_weight != 0.0:  # own uncached prefill x the requests it slows
            iscale = interference_weight * inv_bs
            low = np.inf
            for w in range(n):
                if eligible[w] == 0:
                    continue
                own = prefill_tokens[w] - active_prefill[w]
                if own < 0:
                    own = 0
                v = own * active_requests[w] * iscale
                terms[4, w] = v
                if v < low:
                    low = v
            if interference_cap_prompts > 0.0:  # measured from the least, at most cap
                cap = interference_cap_prompts * prefill_weight * float(isl_tokens) * inv_bs
                for w in range(n):
                    if eligible[w] == 0:
                        continue
                    x = terms[4, w] - low
                    terms[4, w] = cap if x > cap else x
        if lead_bonus > 0.0:
            first = -1
            top = -1
            second = -(1 << 40)
            for w in range(n):
                if eligible[w] == 0:
                    continue
                d = int(overlap[w])
                if d > first:
                    if top >= 0:
                        second = first
                    first = d
                    top = w
                elif d > second:
                    second = d
            if n_rows == 1:
                second = 0
            if first > 0 and first > second:
                saturated = active_prefill[top] > lead_release_steps * max_batched[top]
                if not saturated and lead_release_requests_ratio > 0.0 and n_rows > 1:
                    req = 0
                    for w in range(n):
                        if eligible[w] != 0:
                            req += active_requests[w]
                    mean_req = (float(req) - float(active_requests[top])) / (n_rows - 1)
                    saturated = active_requests[top] > lead_release_requests_ratio * (
                        1.0 if mean_req < 1.0 else mean_req
                    )
                if not saturated and m > 0 and lead_release_recent_ratio > 0.0 and n_rows > 1:
                    if n_rows > PAIRWISE_BLOCK:  # numpy's recursive split: the caller's numpy path decides
                        pick[0] = -2
                        pick[1] = 0
                        return -2
                    k = 0
                    for w in range(n):
                        if eligible[w] != 0:
                            vals[k] = rt[w]
                            k += 1
                    mine = rt[top]
                    mean_others = (pairwise_sum(vals, 0, k) - mine) / (n_rows - 1)
                    saturated = mine > lead_release_recent_ratio * mean_others
                if not saturated:
                    gap = float(first - max(0, second))
                    bonus = lead_bonus * (lead_cap_blocks if lead_cap_blocks < gap else gap)
                    if lead_max_wait_steps > 0.0:  # the extra-wait cap
                        a = lead_max_wait_steps * float(max_batched[top]) * inv_bs
                        b = lead_max_wait_per_lead * gap
                        wait_cap = prefill_weight * (b if b > a else a)
                        if wait_cap < bonus:
                            bonus = wait_cap
                    terms[2, top] = -bonus
    best = -1
    lo = 0.0
    for w in range(n):
        t = (((terms[0, w] + terms[1, w]) + terms[2, w]) + terms[3, w]) + terms[4, w]
        total[w] = t
        if t != t:  # NaN: numpy's argmin would return it; let the caller's numpy path decide
            pick[0] = -1
            pick[1] = 0
            return -1
        if best < 0 or t < lo:
            best = w
            lo = t
    ties = 0
    for w in range(n):
        if total[w] == lo:
            ties += 1
    pick[0] = best
    pick[1] = ties
    return best


@njit(cache=True, nogil=True)
def count_busy(active_prefill, max_batched, eligible, threshold, threshold_frac):
    """Eligible rows whose active prefill exceeds a class's busy threshold (`Admitter.busy_count`).

    Args:
        active_prefill / max_batched: int64[W] (tokens); eligible: uint8[W].
        threshold: tokens, or -1 for none; threshold_frac: fraction of max_batched, or -1.0 for none.
    Returns:
        int: busy eligible rows (0 when neither threshold is set).
    """
    n_busy = 0
    for w in range(eligible.shape[0]):
        if eligible[w] == 0:
            continue
        busy = threshold >= 0 and active_prefill[w] > threshold
        if not busy and threshold_frac >= 0.0:
            busy = active_prefill[w] > threshold_frac * max_batched[w]
        if busy:
            n_busy += 1
    return n_busy


@njit(cache=True, nogil=True)
def credit_rows(
    approx, device, offload, spec, event_fed, w_flags, stale_flag, offload_credit, has_offload, spec_raw, out
):
    """The credited overlap of every row (docs/DESIGN.md §6.4: the credit rule, floored), in place.

    Args:
        approx / device / offload / spec: int32[W], raw prefix depths (blocks) in the approximate,
            device, offload and speculative indexes (`offload` ignored unless `has_offload`).
        event_fed: uint8[W]; w_flags: uint8[W] worker flags; stale_flag: the FLAG_STALE bit.
        offload_credit: credit of an offload-only block (0..1).
        spec_raw: int32[W], written: a copy of `spec` (what `OverlapView.record` reads).
        out: int32[W], written: approx for stale or unfed rows, else
            floor(max(device, spec) + offload_credit * max(0, offload - max(device, spec))).
    """
    for w in range(out.shape[0]):
        s = spec[w]
        spec_raw[w] = s
        if event_fed[w] == 0 or (w_flags[w] & stale_flag) != 0:
            out[w] = approx[w]
            continue
        base = device[w] if device[w] > s else s
        credit = float(base)
        if has_offload and offload_credit > 0:
            extra = np.int64(offload[w]) - np.int64(base)
            credit += offload_credit * float(extra if extra > 0 else 0)
        out[w] = np.int32(np.floor(credit))


def warm_select_kernels() -> None:
    """Compile (or load from the cache) both kernels for the dtypes the core uses."""
    w = 2
    i8, u1 = np.zeros(w, np.int64), np.ones(w, np.uint8)
    kv_cost_terms(
        i8,
        i8,
        i8,
        i8,
        u1,
        np.zeros(w, np.int32),
        np.zeros(0, np.float64),
        1.0,
        i8,
        64,
        1.0 / 16,
        16.0,
        0.1,
        1.0,
        160.0,
        64.0,
        16.0,
        2.0,
        2.0,
        10.0,
        3.0,
        1.0,
        0.1,
        np.zeros((2, w)),
        np.zeros((5, w)),
        np.zeros(w),
        np.zeros(2, np.int64),
    )
    count_busy(i8, i8, u1, -1, 1.0)
    i4, flags = np.zeros(w, np.int32), np.zeros(w, np.uint8)
    credit_rows(i4, i4, i4, i4, u1, flags, 4, 0.5, True, np.zeros(w, np.int32), np.zeros(w, np.int32))
