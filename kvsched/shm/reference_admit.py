"""Numpy and pure-Python twins of the admission kernels (`admit_kernels.py`); `reference.py` exposes
them as `numpy_twin.<kernel>` / `python_twin.<kernel>`.

Each twin composes the twins of the component kernels (`ref_add`, `overlap_depth`, `count_busy`,
`project_and_cost`, `kv_cost_terms`, `credit_rows`) of the same flavour, step by step in each
kernel's order. The
approximate index's insert has no twin of its own (its tests are the overlap index's); both twins
call the `overlap_insert` kernel for that step.
"""

from __future__ import annotations

import numpy as np

from .admit_kernels import (
    BUSY,
    OUT_CACHED,
    OUT_EVICTED,
    OUT_GENERATION,
    OUT_OVERLAP,
    OUT_ROW,
    OUT_SNAPSHOT,
    OUT_TIES,
    UNDECIDED,
)
from .layout import SLOT_ADMITTED
from .overlap import overlap_insert

_U32_MAX = 0xFFFF_FFFF
NAMES = ("reserve_slot", "admit_kv", "credited_depth")


def _reserve_slot(
    t,
    slot,
    row,
    isl_tokens,
    hashes,
    cached_tokens,
    expected_osl,
    class_idx,
    enqueue_us,
    now_us,
    owner_pid,
    block_size,
    stride,
    w_generation,
    w_active_blocks,
    w_active_prefill,
    w_active_requests,
    ref_keys,
    ref_counts,
    arena,
    s_state,
    s_generation,
    s_worker_row,
    s_worker_generation,
    s_isl,
    s_cached,
    s_prefill,
    s_expected_osl,
    s_output_tokens,
    s_extra_blocks,
    s_class,
    s_enqueue_us,
    s_admit_us,
    s_arena_off,
    s_arena_len,
    s_owner_pid,
) -> int:
    gen = int(s_generation[slot]) % _U32_MAX + 1
    request_blocks = -(-int(isl_tokens) // int(block_size))
    nh = min(int(hashes.shape[0]), int(stride), request_blocks)
    off = int(slot) * int(stride)
    arena[off : off + nh] = hashes[:nh]
    became = t.ref_add(ref_keys[row], ref_counts[row], arena[off : off + nh])
    cached = max(0, min(int(cached_tokens), int(isl_tokens)))
    extra = request_blocks - nh
    s_worker_row[slot], s_worker_generation[slot] = row, w_generation[row]
    s_isl[slot], s_cached[slot], s_prefill[slot] = isl_tokens, cached, isl_tokens - cached
    s_expected_osl[slot], s_output_tokens[slot], s_extra_blocks[slot] = expected_osl, 0, extra
    s_class[slot], s_enqueue_us[slot], s_admit_us[slot], s_owner_pid[slot] = class_idx, enqueue_us, now_us, owner_pid
    s_arena_off[slot], s_arena_len[slot] = off, nh
    w_active_blocks[row] += became + extra
    w_active_prefill[row] += isl_tokens - cached
    w_active_requests[row] += 1
    s_generation[slot] = gen
    s_state[slot] = SLOT_ADMITTED
    return gen


def _admit_kv(
    t,
    hashes,
    isl_tokens,
    now_us,
    slot,
    expected_osl,
    class_idx,
    enqueue_us,
    owner_pid,
    expiry_us,
    decay,
    decay_recent,
    depth_given,
    ring_i,
    params,
    block_size,
    stride,
    eligible,
    placeable,
    ov_keys,
    ov_used,
    ov_perm,
    ov_ttlm,
    ov_ttl_exp,
    ov_scratch,
    depth,
    w_generation,
    w_active_blocks,
    w_active_prefill,
    w_active_requests,
    w_max_batched,
    ref_keys,
    ref_counts,
    arena,
    s_state,
    s_generation,
    s_worker_row,
    s_worker_generation,
    s_isl,
    s_cached,
    s_prefill,
    s_expected_osl,
    s_output_tokens,
    s_extra_blocks,
    s_class,
    s_enqueue_us,
    s_admit_us,
    s_arena_off,
    s_arena_len,
    s_owner_pid,
    recent,
    scratch,
    ring_elig,
    ring_depth,
    ring_blocks,
    ring_prefill,
    ring_terms,
    out,
) -> int:
    n_elig = int(np.count_nonzero(eligible))
    thr, frac = float(params[15]), float(params[16])
    if (thr >= 0.0 or frac >= 0.0) and n_elig > 0:
        n_busy = t.count_busy(w_active_prefill, w_max_batched, eligible, int(thr) if thr >= 0.0 else -1, frac)
        if n_busy >= float(params[17]) * n_elig - 1e-9:
            return BUSY
    if not depth_given:
        t.overlap_depth(ov_keys, ov_used, ov_perm, ov_ttlm, ov_ttl_exp, hashes, now_us, ov_scratch, depth)
    rows = np.flatnonzero(placeable)
    snap = 0
    if hashes.shape[0] > 0 and rows.size:
        snap = min(int(depth[rows].max()) * int(block_size), int(isl_tokens))
    out[OUT_SNAPSHOT] = max(1, int(isl_tokens) - max(0, snap))
    blocks, prefill, terms, total = ring_blocks[ring_i], ring_prefill[ring_i], ring_terms[ring_i], scratch[2]
    t.project_and_cost(
        w_active_blocks,
        w_active_prefill,
        eligible,
        ref_keys,
        ref_counts,
        hashes,
        isl_tokens,
        block_size,
        depth,
        params[0],
        params[1],
        blocks,
        prefill,
        scratch[3],
    )
    p = [float(x) for x in params[2:15]]
    i = t.kv_cost_terms(
        prefill,
        blocks,
        w_active_prefill,
        w_max_batched,
        eligible,
        depth,
        recent,
        decay,
        w_active_requests,
        isl_tokens,
        *p,
        scratch,
        terms,
        total,
        out[0:2],
    )
    ring_elig[ring_i] = eligible
    ring_depth[ring_i] = depth
    if i < 0 or out[OUT_TIES] != 1 or not eligible[i] or not np.isfinite(total[i]):
        return UNDECIDED
    row = int(i)
    ob = int(depth[row])
    cached = min(int(isl_tokens), ob * int(block_size))
    gen = _reserve_slot(
        t,
        slot,
        row,
        isl_tokens,
        hashes,
        cached,
        expected_osl,
        class_idx,
        enqueue_us,
        now_us,
        owner_pid,
        block_size,
        stride,
        w_generation,
        w_active_blocks,
        w_active_prefill,
        w_active_requests,
        ref_keys,
        ref_counts,
        arena,
        s_state,
        s_generation,
        s_worker_row,
        s_worker_generation,
        s_isl,
        s_cached,
        s_prefill,
        s_expected_osl,
        s_output_tokens,
        s_extra_blocks,
        s_class,
        s_enqueue_us,
        s_admit_us,
        s_arena_off,
        s_arena_len,
        s_owner_pid,
    )
    evicted = 0
    if hashes.shape[0] > 0:
        evicted = overlap_insert(ov_keys, ov_used, ov_perm, ov_ttlm, ov_ttl_exp, hashes, row, now_us, expiry_us)
    if params[5] > 0.0:
        if decay_recent:
            recent *= decay
        recent[row] += max(0, int(isl_tokens) - cached)
    out[OUT_ROW], out[OUT_GENERATION], out[OUT_EVICTED] = row, gen, evicted
    out[OUT_OVERLAP], out[OUT_CACHED] = ob, cached
    return row


def _credited_depth(
    t,
    hashes,
    now_us,
    has_offload,
    offload_credit,
    stale_flag,
    a_keys,
    a_used,
    a_perm,
    a_ttlm,
    a_ttl_exp,
    d_keys,
    d_used,
    d_perm,
    d_ttlm,
    d_ttl_exp,
    o_keys,
    o_used,
    o_perm,
    o_ttlm,
    o_ttl_exp,
    s_keys,
    s_used,
    s_perm,
    s_ttlm,
    s_ttl_exp,
    scratch,
    approx_depth,
    dev_depth,
    off_depth,
    spec_depth,
    event_fed,
    w_flags,
    spec_raw,
    out,
) -> None:
    t.overlap_depth(a_keys, a_used, a_perm, a_ttlm, a_ttl_exp, hashes, now_us, scratch, approx_depth)
    t.overlap_depth(d_keys, d_used, d_perm, d_ttlm, d_ttl_exp, hashes, now_us, scratch, dev_depth)
    if has_offload:
        t.overlap_depth(o_keys, o_used, o_perm, o_ttlm, o_ttl_exp, hashes, now_us, scratch, off_depth)
    t.overlap_depth(s_keys, s_used, s_perm, s_ttlm, s_ttl_exp, hashes, now_us, scratch, spec_depth)
    t.credit_rows(
        approx_depth,
        dev_depth,
        off_depth,
        spec_depth,
        event_fed,
        w_flags,
        stale_flag,
        offload_credit,
        bool(has_offload),
        spec_raw,
        out,
    )


def _flavour(name: str):
    """The twins of one flavour ("python" or "numpy"), bound to that flavour's component twins."""

    def twins():
        from . import reference

        return reference.python_twin if name == "python" else reference.numpy_twin

    def reserve_slot(*args) -> int:
        return _reserve_slot(twins(), *args)

    def admit_kv(*args) -> int:
        return _admit_kv(twins(), *args)

    def credited_depth(*args) -> None:
        _credited_depth(twins(), *args)

    return reserve_slot, admit_kv, credited_depth


_py_reserve_slot, _py_admit_kv, _py_credited_depth = _flavour("python")
_np_reserve_slot, _np_admit_kv, _np_credited_depth = _flavour("numpy")
