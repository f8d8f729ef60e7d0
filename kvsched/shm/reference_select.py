"""Numpy and pure-Python twins of the selection kernels (`select_kernels.py`); `reference.py`
exposes them as `numpy_twin.<kernel>` / `python_twin.<kernel>`.

The numpy twin of `kv_cost_terms` is the array code `KvSelector.terms` ran before the kernel
existed (docs/ROUTING.md); the Python twin loops over rows and sums with numpy's pairwise order.
"""

from __future__ import annotations

import numpy as np


def _py_pairwise_sum(a, lo: int, n: int) -> float:
    assert n <= 128
    if n < 8:
        res = 0.0
        for i in range(n):
            res += float(a[lo + i])
        return res
    else:
        r = [float(a[lo + j]) for j in range(8)]
        i, end = 8, n - (n % 8)
        while i < end:
            for j in range(8):
                r[j] += float(a[lo + i + j])
            i += 8
        res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
        while i < n:
            res += float(a[lo + i])
            i += 1
    return res


def _np_pairwise_sum(a, lo: int, n: int) -> float:
    return float(np.asarray(a[lo : lo + n], dtype=np.float64).sum())


def _pick(total: np.ndarray, pick: np.ndarray) -> int:
    if np.isnan(total).any():
        pick[0], pick[1] = -1, 0
        return -1
    i = int(total.argmin())
    pick[0], pick[1] = i, int(np.count_nonzero(total == total[i]))
    return i


def _np_kv_cost_terms(
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
) -> int:
    n = eligible.shape[0]
    rows = np.flatnonzero(eligible)
    terms[0] = np.inf
    terms[1:] = 0.0
    if rows.size:
        terms[0, rows] = prefill_tokens[rows] * (prefill_weight * inv_bs)
        if active_blocks_weight:
            terms[1, rows] = blocks[rows] * active_blocks_weight
        if interference_weight:
            own = np.maximum(prefill_tokens[rows] - active_prefill[rows], 0)
            terms[4, rows] = own * active_requests[rows] * (interference_weight * inv_bs)
            if interference_cap_prompts > 0.0:
                cap = interference_cap_prompts * prefill_weight * float(isl_tokens) * inv_bs
                terms[4, rows] = np.minimum(terms[4, rows] - terms[4, rows].min(), cap)
        m = min(n, recent.size)
        rt = None
        if m:
            rt = np.zeros(n)
            sel = rows[rows < m]
            rt[sel] = recent[sel] * decay
            if recent_weight:
                terms[3, sel] = rt[sel] * (recent_weight * inv_bs)
        if lead_bonus > 0.0:
            depth = overlap[rows]
            k = int(depth.argmax())
            first = int(depth[k])
            if first > 0:
                top = int(rows[k])
                second = int(np.partition(depth, -2)[-2]) if rows.size > 1 else 0
                saturated = bool(active_prefill[top] > lead_release_steps * max_batched[top])
                if not saturated and lead_release_requests_ratio > 0.0 and rows.size > 1:
                    mean_req = (float(active_requests[rows].sum()) - float(active_requests[top])) / (rows.size - 1)
                    saturated = bool(active_requests[top] > lead_release_requests_ratio * max(mean_req, 1.0))
                if not saturated and rt is not None and lead_release_recent_ratio > 0.0 and rows.size > 1:
                    if first > second and rows.size > 128:
                        pick[0], pick[1] = -2, 0
                        return -2
                    mine = rt[top]
                    saturated = bool(
                        mine > lead_release_recent_ratio * ((float(rt[rows].sum()) - mine) / (rows.size - 1))
                    )
                if first > second and not saturated:
                    gap = float(first - max(0, second))
                    bonus = lead_bonus * min(gap, lead_cap_blocks)
                    if lead_max_wait_steps > 0.0:
                        bonus = min(
                            bonus,
                            prefill_weight
                            * max(lead_max_wait_steps * float(max_batched[top]) * inv_bs, lead_max_wait_per_lead * gap),
                        )
                    terms[2, top] = -bonus
    total[:] = terms[0] + terms[1] + terms[2] + terms[3] + terms[4]
    return _pick(total, pick)


def _py_kv_cost_terms(
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
) -> int:
    n = int(eligible.shape[0])
    rows = [w for w in range(n) if eligible[w]]
    m = min(n, int(recent.shape[0]))
    rt = [0.0] * n
    for w in range(n):
        terms[0, w], terms[1, w], terms[2, w], terms[3, w], terms[4, w] = np.inf, 0.0, 0.0, 0.0, 0.0
    for w in rows:
        terms[0, w] = float(prefill_tokens[w]) * (prefill_weight * inv_bs)
        if active_blocks_weight != 0.0:
            terms[1, w] = float(blocks[w]) * active_blocks_weight
        if w < m:
            rt[w] = float(recent[w]) * decay
            if recent_weight != 0.0:
                terms[3, w] = rt[w] * (recent_weight * inv_bs)
    if rows and interference_weight != 0.0:
        inter = [
            float(max(int(prefill_tokens[w]) - int(active_prefill[w]), 0) * int(active_requests[w]))
            * (interference_weight * inv_bs)
            for w in rows
        ]
        if interference_cap_prompts > 0.0:
            cap = interference_cap_prompts * prefill_weight * float(isl_tokens) * inv_bs
            low = min(inter)
            inter = [min(v - low, cap) for v in inter]
        for w, v in zip(rows, inter):
            terms[4, w] = v
    if rows and lead_bonus > 0.0:
        depths = [int(overlap[w]) for w in rows]
        first = max(depths)
        top = rows[depths.index(first)]
        second = sorted(depths)[-2] if len(rows) > 1 else 0
        if first > 0 and first > second:
            saturated = float(active_prefill[top]) > lead_release_steps * float(max_batched[top])
            if not saturated and lead_release_requests_ratio > 0.0 and len(rows) > 1:
                req = sum(int(active_requests[w]) for w in rows)
                mean_req = (float(req) - float(active_requests[top])) / (len(rows) - 1)
                saturated = float(active_requests[top]) > lead_release_requests_ratio * max(mean_req, 1.0)
            if not saturated and m > 0 and lead_release_recent_ratio > 0.0 and len(rows) > 1:
                if len(rows) > 128:
                    pick[0], pick[1] = -2, 0
                    return -2
                vals = [rt[w] for w in rows]
                mean_others = (_py_pairwise_sum(vals, 0, len(vals)) - rt[top]) / (len(rows) - 1)
                saturated = rt[top] > lead_release_recent_ratio * mean_others
            if not saturated:
                gap = float(first - max(0, second))
                bonus = lead_bonus * min(gap, lead_cap_blocks)
                if lead_max_wait_steps > 0.0:
                    bonus = min(
                        bonus,
                        prefill_weight
                        * max(lead_max_wait_steps * float(max_batched[top]) * inv_bs, lead_max_wait_per_lead * gap),
                    )
                terms[2, top] = -bonus
    for w in range(n):
        total[w] = (
            ((float(terms[0, w]) + float(terms[1, w])) + float(terms[2, w])) + float(terms[3, w]) + float(terms[4, w])
        )
    return _pick(total, pick)


def _np_count_busy(active_prefill, max_batched, eligible, threshold, threshold_frac) -> int:
    busy = np.zeros(eligible.shape[0], np.bool_)
    if threshold >= 0:
        busy |= active_prefill > threshold
    if threshold_frac >= 0.0:
        busy |= active_prefill > threshold_frac * max_batched
    return int(np.count_nonzero(busy & (eligible != 0)))


def _py_count_busy(active_prefill, max_batched, eligible, threshold, threshold_frac) -> int:
    n = 0
    for w in range(int(eligible.shape[0])):
        if not eligible[w]:
            continue
        ap = int(active_prefill[w])
        if (threshold >= 0 and ap > threshold) or (
            threshold_frac >= 0.0 and ap > threshold_frac * float(max_batched[w])
        ):
            n += 1
    return n


def _np_credit_rows(
    approx, device, offload, spec, event_fed, w_flags, stale_flag, offload_credit, has_offload, spec_raw, out
) -> None:
    from ..core.overlap_view import credited_overlap

    spec_raw[:] = spec
    stale = (event_fed == 0) | ((w_flags & stale_flag) != 0)
    merged = np.where(stale, approx, spec).astype(np.int32)
    credit = np.zeros(out.shape[0])
    credited_overlap(device, offload if has_offload else None, merged, stale, offload_credit, credit)
    out[:] = np.floor(credit)


def _py_credit_rows(
    approx, device, offload, spec, event_fed, w_flags, stale_flag, offload_credit, has_offload, spec_raw, out
) -> None:
    import math

    for w in range(int(out.shape[0])):
        spec_raw[w] = spec[w]
        if not event_fed[w] or int(w_flags[w]) & stale_flag:
            out[w] = approx[w]
            continue
        base = max(int(device[w]), int(spec[w]))
        credit = float(base)
        if has_offload and offload_credit > 0:
            credit += offload_credit * float(max(0, int(offload[w]) - base))
        out[w] = math.floor(credit)


NAMES = ("pairwise_sum", "kv_cost_terms", "count_busy", "credit_rows")
