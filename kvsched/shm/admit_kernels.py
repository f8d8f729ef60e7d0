"""Admission kernels: one booking (`reserve_slot`), one whole immediate admission with the `kv`
selector (`admit_kv`) and the credited overlap of event-fed rows (`credited_depth`), each a single
call (docs/ARCHITECTURE.md "The core", the immediate path).

`admit_kv` composes the existing kernels — it calls them, it does not restate their formulas:
`overlap_depth` (approximate index) → the class's busy count (`count_busy`) → the cost snapshot
(deepest overlap on a placeable row) → `project_and_cost` → `kv_cost_terms` (terms, total, argmin)
→ `reserve_slot` (slot fields, arena, `ref_add`, per-worker aggregates) → `overlap_insert` → the kv
selector's recent-work update (`KvSelector.admitted`). It mutates nothing until the decision is
known to be the one the Python path would take (a unique finite minimum on an eligible row); in
every other case it returns a negative status and the caller runs the Python path, which decides
from the same (unchanged) state.

`shm/admit_packed.py` has `admit_kv_packed` / `credited_depth_packed`: the same kernels with their
fixed arrays given as one int64 table (`shm/argtable.py`); the core calls those.

The plain-Python reference with the same names and signatures is tests/shm/reference.py (composing
the component kernels' references); property tests
in tests/shm/test_admit_kernels.py.

Cache key: `shm.kernel_cache` (a digest of the whole package: editing a composed kernel recompiles these).
"""

from __future__ import annotations

import numpy as np

from .kernel_cache import njit
from .kernels import project_and_cost, ref_add
from .layout import SLOT_ADMITTED, LedgerArrays
from .overlap import OverlapIndex, overlap_depth, overlap_insert
from .select_kernels import ADMIT_PARAMS, P, count_busy, credit_rows, kv_cost_terms, pack_selector_params

_U32_MAX = 0xFFFF_FFFF

# `admit_kv`'s float parameters: the `params` array of `kv_cost_terms` (`ADMIT_PARAMS`, `P`), filled
# by `pack_kv_params`.

# `admit_kv`'s int64 `out` array: what the caller reads back.
OUT_PICK0, OUT_TIES, OUT_ROW, OUT_GENERATION, OUT_EVICTED, OUT_OVERLAP, OUT_CACHED, OUT_SNAPSHOT = range(8)
OUT_LEN = 8

# `admit_kv`'s return value when it did not admit (the caller runs the Python path).
BUSY = -3  # the class is busy: the request waits (nothing computed past the busy count)
UNDECIDED = -4  # a tie, a NaN or an ineligible minimum: no booking made


@njit(cache=True, nogil=True)
def reserve_slot(
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
):
    """Book one request in free `slot` on worker `row`: the array half of `Ledger.reserve`.

    Stores the first min(len(hashes), stride, ceil(isl/B)) hashes in the slot's arena range, adds
    them to the row's refcount index (`ref_add`), writes the slot's fields and adds the booking to
    the row's aggregates (blocks: hashes that became live + the prompt blocks without a stored
    hash; prefill: isl - cached; requests: 1). The slot's state is written last (ADMITTED).

    Args:
        slot: a free slot; row: a registered worker row.
        isl_tokens: prompt tokens (>= 1); hashes: uint64[n] chained block hashes.
        cached_tokens: prompt tokens cached on `row` (clamped to [0, isl]).
        expected_osl: expected output tokens, -1 = unknown; class_idx: policy class index.
        enqueue_us / now_us: enqueue and admission times (µs); owner_pid: the owner id.
        block_size: tokens per block (B); stride: arena entries per slot (max_blocks_per_request).
        w_* / ref_* / arena / s_*: the ledger arrays (`shm.layout` dtypes), written in place.
    Returns:
        int: the booking's generation (the slot's previous generation + 1, wrapping 2**32-1 -> 1).
    Source: docs/DESIGN.md §3.1 (bookings, live-prefix dedup), §4.2 (aggregates).
    """
    gen = np.int64(s_generation[slot]) % _U32_MAX + 1
    request_blocks = (isl_tokens + block_size - 1) // block_size
    nh = min(hashes.shape[0], stride, request_blocks)
    off = slot * stride
    for k in range(nh):
        arena[off + k] = hashes[k]
    became = ref_add(ref_keys[row], ref_counts[row], arena[off : off + nh])
    cached = max(0, min(cached_tokens, isl_tokens))
    extra = request_blocks - nh
    s_worker_row[slot] = row
    s_worker_generation[slot] = w_generation[row]
    s_isl[slot] = isl_tokens
    s_cached[slot] = cached
    s_prefill[slot] = isl_tokens - cached
    s_expected_osl[slot] = expected_osl
    s_output_tokens[slot] = 0
    s_extra_blocks[slot] = extra
    s_class[slot] = class_idx
    s_enqueue_us[slot] = enqueue_us
    s_admit_us[slot] = now_us
    s_owner_pid[slot] = owner_pid
    s_arena_off[slot] = off
    s_arena_len[slot] = nh
    w_active_blocks[row] += became + extra
    w_active_prefill[row] += isl_tokens - cached
    w_active_requests[row] += 1
    s_generation[slot] = gen
    s_state[slot] = SLOT_ADMITTED
    return gen


@njit(cache=True, nogil=True)
def credited_depth(
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
):
    """`OverlapView.depth` with event-fed rows in one call: the prefix depth in the approximate,
    device, offload (if `has_offload`) and speculative indexes (`overlap_depth` each), then the
    credited overlap per row (`credit_rows`).

    Args:
        hashes: uint64[n]; now_us: µs; has_offload: 1 when an offload index is given (else its
            arrays are any index's, unread); offload_credit: credit of an offload-only block (0..1);
            stale_flag: the FLAG_STALE bit of `w_flags`.
        a_* / d_* / o_* / s_*: the approximate, device, offload and speculative `OverlapIndex`
            arrays (keys, used, perm, ttlm, ttl_exp); scratch: uint64[words].
        approx_depth / dev_depth / off_depth / spec_depth: int32[W], written: the raw depths
            (off_depth only with `has_offload`).
        event_fed: uint8[W]; w_flags: uint8[W]; spec_raw: int32[W], written (a copy of spec_depth).
        out: int32[W], written: the credited overlap (`credit_rows`).
    Source: docs/DESIGN.md §6.4; the credit rule is `select_kernels.credit_rows`.
    """
    overlap_depth(a_keys, a_used, a_perm, a_ttlm, a_ttl_exp, hashes, now_us, scratch, approx_depth)
    overlap_depth(d_keys, d_used, d_perm, d_ttlm, d_ttl_exp, hashes, now_us, scratch, dev_depth)
    if has_offload != 0:
        overlap_depth(o_keys, o_used, o_perm, o_ttlm, o_ttl_exp, hashes, now_us, scratch, off_depth)
    overlap_depth(s_keys, s_used, s_perm, s_ttlm, s_ttl_exp, hashes, now_us, scratch, spec_depth)
    credit_rows(
        approx_depth,
        dev_depth,
        off_depth,
        spec_depth,
        event_fed,
        w_flags,
        stale_flag,
        offload_credit,
        has_offload != 0,
        spec_raw,
        out,
    )


@njit(cache=True, nogil=True)
def admit_kv(
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
):
    """One immediate admission with the `kv` selector (module docstring), or a negative status.

    Args:
        hashes: uint64[n], the request's chained block hashes; isl_tokens: prompt tokens (>= 1).
        now_us: decision time (µs); slot: the free slot to book (taken by the caller).
        expected_osl (-1 = unknown), class_idx, enqueue_us (µs), owner_pid: the booking's fields.
        expiry_us: the approximate index entries' expiry (now + approx TTL, µs).
        decay: 2^(-(now - recent_at) / half-life), the kv selector's recent-work decay to now;
            decay_recent: 1 when `recent` is brought to now (now > its time), else 0.
        depth_given: 1 = `depth` already holds the credited overlap (event-fed rows: the caller's
            `OverlapView.depth`); 0 = computed here from the approximate index.
        ring_i: the explain ring's row to write (see ring_* below).
        params: float64[len(ADMIT_PARAMS)], the projection's weights, 1/B, the kv selector's
            parameters and the class's busy rule (threshold -1 / frac -1.0 = unset).
        block_size: tokens per block; stride: arena entries per slot. The arguments from here
            on are the same objects for every call (the caller keeps them in one tuple).
        eligible: uint8[W], rows the request may run on now; placeable: bool[W], rows it may run
            on, overload ignored (the cost snapshot's rows).
        ov_*: the approximate `OverlapIndex`'s arrays and scratch (uint64[words]).
        depth: int32[W], the credited overlap (written unless `depth_given`).
        w_* / ref_* / arena / s_*: the ledger arrays (`shm.layout` dtypes).
        recent: float64[W], the kv selector's recent work per row (tokens), updated on admission.
        scratch: float64[4, W]: rows 0-1 the kv kernel's work space, 2 the total, 3 the cost.
        ring_elig uint8[R, W], ring_depth int32[R, W], ring_blocks / ring_prefill int64[R, W],
            ring_terms float64[R, 5, W]: the explain ring, written at row `ring_i` (eligible,
            overlap, projected blocks, projected prefill, terms) once the busy rule passed.
        out: int64[OUT_LEN], written: [argmin, rows tied at the minimum, row, generation,
            approximate-index evictions, overlap blocks on the row, cached tokens, snapshot cost].
    Returns:
        int: the chosen row (booked in `slot`, its hashes recorded, recent work added); `BUSY`
        (the class's busy rule holds: nothing else computed) or `UNDECIDED` (nothing booked).
        `out[OUT_SNAPSHOT]` is the cost snapshot (tokens, >= 1) in every case but `BUSY`.
    """
    n_elig = 0
    for w in range(eligible.shape[0]):
        if eligible[w] != 0:
            n_elig += 1
    thr = params[15]
    frac = params[16]
    if (thr >= 0.0 or frac >= 0.0) and n_elig > 0:
        n_busy = count_busy(w_active_prefill, w_max_batched, eligible, np.int64(thr) if thr >= 0.0 else -1, frac)
        if n_busy >= params[17] * n_elig - 1e-9:
            return BUSY
    if depth_given == 0:
        overlap_depth(ov_keys, ov_used, ov_perm, ov_ttlm, ov_ttl_exp, hashes, now_us, ov_scratch, depth)
    best = 0
    any_place = False
    for w in range(placeable.shape[0]):
        if placeable[w] != 0:
            if not any_place or depth[w] > best:
                best = depth[w]
            any_place = True
    snap = 0
    if hashes.shape[0] > 0 and any_place:
        snap = min(np.int64(best) * block_size, isl_tokens)
    out[OUT_SNAPSHOT] = max(1, isl_tokens - max(0, snap))
    blocks = ring_blocks[ring_i]
    prefill = ring_prefill[ring_i]
    terms = ring_terms[ring_i]
    total = scratch[2]
    project_and_cost(
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
    i = kv_cost_terms(
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
        params,
        scratch,  # `extra`: not read (five terms, predicted-seconds keys off: `KvSelector.decides_by_kernel`)
        scratch,
        terms,
        total,
        out[0:2],
    )
    for w in range(eligible.shape[0]):
        ring_elig[ring_i, w] = eligible[w]
        ring_depth[ring_i, w] = depth[w]
    if i < 0 or out[OUT_TIES] != 1 or eligible[i] == 0 or not (-np.inf < total[i] < np.inf):
        return UNDECIDED
    row = i
    ob = np.int64(depth[row])
    cached = min(isl_tokens, ob * block_size)
    gen = reserve_slot(
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
    if params[5] > 0.0:  # KvSelector.admitted: decay every row to now, then add the uncached tokens
        if decay_recent != 0:
            for w in range(recent.shape[0]):
                recent[w] *= decay
        recent[row] += max(0, isl_tokens - cached)
    out[OUT_ROW] = row
    out[OUT_GENERATION] = gen
    out[OUT_EVICTED] = evicted
    out[OUT_OVERLAP] = ob
    out[OUT_CACHED] = cached
    return row


def pack_kv_params(selector, selector_cfg, cls) -> np.ndarray:
    """float64[len(ADMIT_PARAMS)]: `admit_kv`'s `params` for a `KvSelector`, the `[selector]` table
    (prefill_load_scale, overlap_credit, block size via `inv_bs` set by the caller) and a class
    config (busy rule). `inv_bs` is left 0: the caller sets `params[P["inv_bs"]]`."""
    p = np.zeros(len(ADMIT_PARAMS), np.float64)
    p[P["prefill_load_scale"]] = float(selector_cfg.prefill_load_scale)
    p[P["overlap_credit"]] = float(selector_cfg.overlap_credit)
    pack_selector_params(selector, p)
    thr, frac = cls.prefill_busy_threshold, cls.prefill_busy_threshold_frac
    p[P["busy_threshold"]] = -1.0 if thr is None else float(thr)
    p[P["busy_threshold_frac"]] = -1.0 if frac is None else float(frac)
    p[P["busy_worker_ratio"]] = float(cls.busy_worker_ratio)
    return p


def warm_admit_kernels() -> tuple:
    """Compile (or load from the cache) the three unpacked kernels for the dtypes the daemon uses: block
    hashes read-only, as decoded from a frame (callers with writable hashes compile that variant on first
    use; the daemon never has them). Called by `shm.warm.warm_kernels`.

    Returns:
        (hashes, params, arrays, credited): the warm-up inputs, which `admit_packed.warm_admit_packed`
        packs to compile the packed forms for the same types.
    """
    a = LedgerArrays.private(2, 2, 4, 16, 4)
    ixs = [OverlapIndex(2, 16) for _ in range(4)]
    w = 2
    hashes = np.frombuffer(np.arange(1, 3, dtype=np.uint64).tobytes(), dtype="<u8")
    ledger = (
        a.w_generation,
        a.w_active_blocks,
        a.w_active_prefill,
        a.w_active_requests,
        a.ref_keys,
        a.ref_counts,
        a.arena,
        a.s_state,
        a.s_generation,
        a.s_worker_row,
        a.s_worker_generation,
        a.s_isl,
        a.s_cached,
        a.s_prefill,
        a.s_expected_osl,
        a.s_output_tokens,
        a.s_extra_blocks,
        a.s_class,
        a.s_enqueue_us,
        a.s_admit_us,
        a.s_arena_off,
        a.s_arena_len,
        a.s_owner_pid,
    )
    ix = ixs[0]
    params = np.zeros(len(ADMIT_PARAMS))
    params[P["busy_threshold"]] = params[P["busy_threshold_frac"]] = -1.0
    args = (
        ix.keys,
        ix.used,
        ix.perm,
        ix.ttlm,
        ix.ttl_exp,
        ix.scratch,
        np.zeros(w, np.int32),
        *ledger[:4],
        a.w_max_batched_tokens,
        *ledger[4:],
        np.zeros(w),
        np.zeros((4, w)),
        np.zeros((1, w), np.uint8),
        np.zeros((1, w), np.int32),
        np.zeros((1, w), np.int64),
        np.zeros((1, w), np.int64),
        np.zeros((1, 5, w)),
        np.zeros(OUT_LEN, np.int64),
    )
    admit_kv(
        hashes,
        8,
        1,
        0,
        -1,
        0,
        1,
        0,
        10,
        1.0,
        1,
        0,
        0,
        params,
        4,
        4,
        np.zeros(w, np.uint8),
        np.zeros(w, np.bool_),
        *args,
    )
    arrays = (np.zeros(w, np.uint8), np.zeros(w, np.bool_), *args)
    reserve_slot(1, 0, 8, hashes, 0, -1, 0, 1, 1, 0, 4, 4, *ledger)
    idx = [x for i in ixs for x in (i.keys, i.used, i.perm, i.ttlm, i.ttl_exp)]
    depths = [np.zeros(w, np.int32) for _ in range(6)]
    credited = (*idx, ixs[0].scratch, *depths[:4], np.ones(w, np.uint8), np.zeros(w, np.uint8), *depths[4:])
    credited_depth(hashes, 1, 1, 0.5, 4, *credited)
    return hashes, params, arrays, credited
