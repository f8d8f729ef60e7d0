"""Selection kernels: the `kv` selector's cost terms, a class's busy count and the credited overlap
of event-fed rows, one call each.

`kv_cost_terms` is the statement of the `kv` rule in the product (docs/ROUTING.md has each term's
source): `core.kv_cost.KvSelector` and the fused admission kernel (`shm.admit_kernels.admit_kv`)
both call it, with the selector's keys packed once into a `params` array (`pack_selector_params`).
`count_busy` is `core/admitter.py`'s busy rule and `credit_rows` `core/overlap_view.py`'s credited
overlap. The plain-Python reference of every kernel, written for reading, is tests/shm/reference.py;
property tests in tests/shm/test_select_kernels.py hold the kernels to it (and to numpy's sums).
"""

from __future__ import annotations

import numpy as np

from .kernel_cache import njit

KV_TERMS = ("prefill", "active_blocks", "lead", "recent", "interference")  # row order of the `terms` array
KV_TERMS_HOME = (*KV_TERMS, "home")  # the same with the home term (`kv_cost_terms` given six rows)

# The float64 `params` array of `kv_cost_terms` and of `admit_kernels.admit_kv`, in this order: the
# projection's weights (`[selector]` prefill_load_scale, overlap_credit), 1 / block size, the kv
# selector's keys, a class's busy rule (threshold -1 / frac -1.0 = unset), the block size (tokens)
# and the kv selector's opt-in keys (home term, predicted seconds).
ADMIT_PARAMS = (
    "prefill_load_scale",
    "overlap_credit",
    "inv_bs",
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
    "busy_threshold",
    "busy_threshold_frac",
    "busy_worker_ratio",
    "block_size",
    "home_weight",
    "home_min_prefill_tokens",
    "lead_max_extra_ttft_s",
    "prefill_seconds_ref_us",
)
P = {name: i for i, name in enumerate(ADMIT_PARAMS)}
SELECTOR_PARAMS = ADMIT_PARAMS[3:15] + ADMIT_PARAMS[19:]  # the kv selector's keys (`pack_selector_params`)

# indices read by the kernel (module globals: compile-time constants for numba)
_INV_BS, _PREFILL_W, _BLOCKS_W, _RECENT_W = (
    P["inv_bs"],
    P["prefill_weight"],
    P["active_blocks_weight"],
    P["recent_weight"],
)
_LEAD, _LEAD_CAP, _REL_STEPS = P["lead_bonus"], P["lead_cap_blocks"], P["lead_release_steps"]
_REL_RECENT, _REL_REQUESTS = P["lead_release_recent_ratio"], P["lead_release_requests_ratio"]
_WAIT_STEPS, _WAIT_PER_LEAD = P["lead_max_wait_steps"], P["lead_max_wait_per_lead"]
_INTERF_W, _INTERF_CAP = P["interference_weight"], P["interference_cap_prompts"]
_BLOCK_SIZE, _HOME_W, _HOME_MIN = P["block_size"], P["home_weight"], P["home_min_prefill_tokens"]
_EXTRA_TTFT, _SECONDS_REF = P["lead_max_extra_ttft_s"], P["prefill_seconds_ref_us"]


def pack_selector_params(selector: object, p: np.ndarray | None = None) -> np.ndarray:
    """float64[len(ADMIT_PARAMS)]: `p` (a new zero array if None) with the `SELECTOR_PARAMS` slots set
    from the same-named attributes of `selector` (a `core.kv_cost.KvSelector`). The other slots are the
    caller's (`inv_bs` and `block_size` from the block size; `admit_kernels.pack_kv_params` the rest)."""
    if p is None:
        p = np.zeros(len(ADMIT_PARAMS), np.float64)
    for name in SELECTOR_PARAMS:
        p[P[name]] = float(getattr(selector, name))
    return p


PAIRWISE_BLOCK = 128  # numpy's PW_BLOCKSIZE: above it, numpy splits the sum in two


@njit(cache=True, nogil=True)
def _pairwise_block(a, lo, n):
    """Sum of a[lo:lo+n] (float64, n <= `PAIRWISE_BLOCK`) in numpy's order: one running sum below 8
    values, else 8 accumulators combined as a tree, then the rest."""
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


@njit(cache=True, nogil=True)
def pairwise_sum(a, lo, n):
    """Sum of a[lo:lo+n] (float64) in numpy's pairwise order, so the result equals `a[lo:lo+n].sum()`
    bit for bit: up to `PAIRWISE_BLOCK` values `_pairwise_block`, above it the sum of the two halves
    split at a multiple of 8, each summed the same way. The halving is walked with an explicit stack
    (numba's cache does not reload self-recursive functions safely)."""
    if n <= PAIRWISE_BLOCK:
        return _pairwise_block(a, lo, n)
    st_lo = np.empty(64, np.int64)  # frames: a run (lo, n), its stage and its left half's sum
    st_n = np.empty(64, np.int64)
    st_stage = np.zeros(64, np.int64)
    st_left = np.zeros(64)
    sp = 0
    st_lo[0], st_n[0] = lo, n
    ret = 0.0
    while sp >= 0:
        m = st_n[sp]
        if m <= PAIRWISE_BLOCK:
            ret = _pairwise_block(a, st_lo[sp], m)
            sp -= 1
            continue
        half = m // 2
        half -= half % 8
        stage = st_stage[sp]
        if stage == 2:  # both halves summed
            ret = st_left[sp] + ret
            sp -= 1
            continue
        if stage == 1:
            st_left[sp] = ret
        st_stage[sp] = stage + 1
        sp += 1
        st_lo[sp] = st_lo[sp - 1] + (0 if stage == 0 else half)
        st_n[sp] = half if stage == 0 else m - half
        st_stage[sp] = 0
    return ret


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
    params,
    extra,
    scratch,
    terms,
    total,
    pick,
):
    """The `kv` selector's cost terms per row, their total and its argmin (lower wins; docs/ROUTING.md).

    Cost per eligible row w, in blocks (B tokens per block; the keys are `[selector]` keys):

        prefill_weight x (active prefill_w + isl - cached_w) / B                       "prefill"
      + active_blocks_weight x projected active blocks_w                               "active_blocks"
      - min(lead_bonus x min(lead_w, lead_cap_blocks),                                 "lead"
            prefill_weight x max(lead_max_wait_steps x max_batched_w / B, lead_max_wait_per_lead x lead_w))
      + recent_weight x recent_w / B                                                   "recent"
      + interference_weight x own_w / B x active_requests_w, own_w = projected - active prefill
            (cap c = interference_cap_prompts > 0: minus the least over eligible rows, at most
            c x prefill_weight x isl / B)                                             "interference"
      + home_weight x prefill_weight x own_w / B x (h_w - min h) / mean h, where own_w >=
            home_min_prefill_tokens and mean h > 0 (only when `terms` has a sixth row)  "home"

    lead_w = overlap_w minus the deepest overlap on any other eligible row (> 0 only on the unique
    deepest row). The lead is released (0) while the row's active prefill > lead_release_steps x its
    step budget, or (more than one eligible row) its active requests > lead_release_requests_ratio x
    the other rows' mean (at least 1), or its recent work > lead_release_recent_ratio x the other rows'
    mean (`recent` non-empty). recent_w = recent[w] x decay (0 past the end of `recent`).
    Opt-in predicted seconds (TTFT_w from `core.prefill_time.PrefillTimeModel`, µs): with
    prefill_seconds_ref_us > 0 "prefill" is prefill_weight x TTFT_w / prefill_seconds_ref_us / B; with
    lead_max_extra_ttft_s > 0 the lead row wins outright (by its bonus, no extra-wait cap) while
    TTFT_top <= min TTFT of the other rows + that many seconds.

    Args:
        prefill_tokens / blocks: int64[W], projected prefill tokens / active blocks (projection kernel).
        active_prefill / max_batched: int64[W], current prefill tokens / step budget per row (tokens).
        eligible: uint8[W]; overlap: int32[W], credited overlap blocks.
        recent: float64[R] (R may be < W), recent work per row (tokens, decayed to its own time);
            decay: the factor bringing it to now (used only when R > 0).
        active_requests: int64[W], live bookings per row (interference term, requests release rule).
        isl_tokens: the request's prompt tokens (interference cap).
        params: float64[len(ADMIT_PARAMS)] (`pack_selector_params`, plus `inv_bs` and `block_size`).
        extra: float64[2, W]: row 0 the home counts decayed to now (read only with a sixth `terms` row),
            row 1 the predicted TTFT (µs; read only when a predicted-seconds key is > 0).
        scratch: float64[2, W], work space (decayed recent work, eligible rows' values).
        terms: float64[5, W] (or [6, W] with "home"), written: rows in `KV_TERMS` (`KV_TERMS_HOME`)
            order; ineligible rows +inf in "prefill", 0 elsewhere.
        total: float64[W], written: the sum of the rows, in that order.
        pick: int64[2], written: [argmin of total (first), rows whose total equals that minimum].
    Returns:
        int: the argmin of `total` (as `pick[0]`); -1 (pick [-1, 0]) when `total` holds a NaN.
    """
    n = eligible.shape[0]
    n_terms = terms.shape[0]
    rt = scratch[0]
    vals = scratch[1]
    n_rows = 0
    for w in range(n):
        terms[0, w] = np.inf
        for k in range(1, n_terms):
            terms[k, w] = 0.0
        rt[w] = 0.0
        if eligible[w] != 0:
            n_rows += 1
    prefill_weight = params[_PREFILL_W]
    inv_bs = params[_INV_BS]
    ttft_ref = params[_SECONDS_REF]
    extra_ttft = params[_EXTRA_TTFT]
    if n_rows > 0:
        pscale = prefill_weight * inv_bs
        m = min(n, recent.shape[0])
        recent_weight = params[_RECENT_W]
        blocks_weight = params[_BLOCKS_W]
        rscale = recent_weight * inv_bs
        for w in range(n):
            if eligible[w] == 0:
                continue
            if ttft_ref > 0.0:  # predicted µs as tokens at the reference rate
                terms[0, w] = extra[1, w] / ttft_ref * pscale
            else:
                terms[0, w] = prefill_tokens[w] * pscale
            if blocks_weight != 0.0:
                terms[1, w] = blocks[w] * blocks_weight
            if w < m:
                rt[w] = recent[w] * decay
                if recent_weight != 0.0:
                    terms[3, w] = rt[w] * rscale
        interference_weight = params[_INTERF_W]
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
            if params[_INTERF_CAP] > 0.0:  # measured from the least, at most cap
                cap = params[_INTERF_CAP] * prefill_weight * float(isl_tokens) * inv_bs
                for w in range(n):
                    if eligible[w] == 0:
                        continue
                    x = terms[4, w] - low
                    terms[4, w] = cap if x > cap else x
        if n_terms > 5:  # home: long prompts go where few conversations return
            k = 0
            h_min = np.inf
            for w in range(n):
                if eligible[w] != 0:
                    vals[k] = extra[0, w]
                    k += 1
                    if extra[0, w] < h_min:
                        h_min = extra[0, w]
            mean = pairwise_sum(vals, 0, k) / n_rows
            if mean > 0.0:
                scale = params[_HOME_W] * prefill_weight / params[_BLOCK_SIZE] / mean
                for w in range(n):
                    if eligible[w] == 0:
                        continue
                    own = prefill_tokens[w] - active_prefill[w]
                    if own < 0:
                        own = 0
                    if own >= params[_HOME_MIN]:
                        terms[5, w] = float(own) * (extra[0, w] - h_min) * scale
        lead_bonus = params[_LEAD]
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
                saturated = active_prefill[top] > params[_REL_STEPS] * max_batched[top]
                ratio = params[_REL_REQUESTS]
                if not saturated and ratio > 0.0 and n_rows > 1:
                    req = 0
                    for w in range(n):
                        if eligible[w] != 0:
                            req += active_requests[w]
                    mean_req = (float(req) - float(active_requests[top])) / (n_rows - 1)
                    saturated = active_requests[top] > ratio * (1.0 if mean_req < 1.0 else mean_req)
                ratio = params[_REL_RECENT]
                if not saturated and m > 0 and ratio > 0.0 and n_rows > 1:
                    k = 0
                    for w in range(n):
                        if eligible[w] != 0:
                            vals[k] = rt[w]
                            k += 1
                    mine = rt[top]
                    mean_others = (pairwise_sum(vals, 0, k) - mine) / (n_rows - 1)
                    saturated = mine > ratio * mean_others
                if not saturated:
                    gap = float(first - max(0, second))
                    lead_cap = params[_LEAD_CAP]
                    bonus = lead_bonus * (lead_cap if lead_cap < gap else gap)
                    outright = False
                    if extra_ttft > 0.0 and n_rows > 1:
                        t_min = np.inf
                        for w in range(n):
                            if eligible[w] != 0 and w != top and extra[1, w] < t_min:
                                t_min = extra[1, w]
                        outright = extra[1, top] <= t_min + extra_ttft * 1e6
                    if outright:  # the lead row wins by `bonus`
                        b_min = np.inf
                        b_top = 0.0
                        for w in range(n):
                            if eligible[w] == 0:
                                continue
                            b = ((terms[0, w] + terms[1, w]) + terms[3, w]) + terms[4, w]
                            if n_terms > 5:
                                b = b + terms[5, w]
                            if w == top:
                                b_top = b
                            elif b < b_min:
                                b_min = b
                        margin = b_top - b_min
                        terms[2, top] = -((margin if margin > 0.0 else 0.0) + bonus)
                    else:
                        if params[_WAIT_STEPS] > 0.0:  # the extra-wait cap
                            a = params[_WAIT_STEPS] * float(max_batched[top]) * inv_bs
                            b = params[_WAIT_PER_LEAD] * gap
                            wait_cap = prefill_weight * (b if b > a else a)
                            if wait_cap < bonus:
                                bonus = wait_cap
                        terms[2, top] = -bonus
    best = -1
    lo = 0.0
    nan = False
    for w in range(n):
        t = (((terms[0, w] + terms[1, w]) + terms[2, w]) + terms[3, w]) + terms[4, w]
        if n_terms > 5:
            t = t + terms[5, w]
        total[w] = t
        if t != t:
            nan = True
        elif best < 0 or t < lo:
            best = w
            lo = t
    if nan:  # numpy's argmin would return the NaN: the caller's `CostSelector.select` decides
        pick[0] = -1
        pick[1] = 0
        return -1
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
    """Compile (or load from the cache) the three kernels for the dtypes the core uses."""
    w = 2
    i8, u1 = np.zeros(w, np.int64), np.ones(w, np.uint8)
    params = np.zeros(len(ADMIT_PARAMS))
    params[P["inv_bs"]], params[P["block_size"]] = 1.0 / 16, 16.0
    for terms in (np.zeros((5, w)), np.zeros((6, w))):  # without and with the home term
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
            params,
            np.zeros((2, w)),
            np.zeros((2, w)),
            terms,
            np.zeros(w),
            np.zeros(2, np.int64),
        )
    count_busy(i8, i8, u1, -1, 1.0)
    i4, flags = np.zeros(w, np.int32), np.zeros(w, np.uint8)
    credit_rows(i4, i4, i4, i4, u1, flags, 4, 0.5, True, np.zeros(w, np.int32), np.zeros(w, np.int32))
