"""Admission kernels == the plain-Python reference (tests/shm/reference.py): same return value, same `out`,
and every array they write equal afterwards (ledger, overlap index, recent work, explain ring rows)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.shm.admit_kernels import ADMIT_PARAMS, BUSY, OUT_LEN, UNDECIDED, P, admit_kv, reserve_slot
from kvsched.shm.admit_packed import ADMIT_ARRAYS, admit_kv_packed, pack_admit_arrays
from kvsched.shm.layout import LedgerArrays
from kvsched.shm.overlap import OverlapIndex
from tests.shm import reference

W, SLOTS, STRIDE, BS = 6, 16, 8, 16
LEDGER_FIELDS = (
    "w_generation",
    "w_active_blocks",
    "w_active_prefill",
    "w_active_requests",
    "ref_keys",
    "ref_counts",
    "arena",
    "s_state",
    "s_generation",
    "s_worker_row",
    "s_worker_generation",
    "s_isl",
    "s_cached",
    "s_prefill",
    "s_expected_osl",
    "s_output_tokens",
    "s_extra_blocks",
    "s_class",
    "s_enqueue_us",
    "s_admit_us",
    "s_arena_off",
    "s_arena_len",
    "s_owner_pid",
)


def _hashes(rng, n: int) -> np.ndarray:
    """Chained-looking hashes from a small alphabet: prefixes shared between requests, sometimes 0."""
    base = int(rng.integers(0, 4))
    return (
        np.array([base * 100 + k for k in range(n)], dtype=np.uint64)
        if rng.random() < 0.7
        else rng.integers(0, 50, n).astype(np.uint64)
    )


def _world(seed: int):
    """A ledger with a few bookings, an approximate index holding some prefixes, free slots."""
    rng = np.random.default_rng(seed)
    a = LedgerArrays.private(W, SLOTS, STRIDE, 64, BS)
    a.w_present[:] = 1
    a.w_generation[:] = rng.integers(1, 5, W)
    a.w_max_batched_tokens[:] = rng.choice([256, 2048, 8192], W)
    ix = OverlapIndex(W, 64)
    for slot in range(int(rng.integers(0, 6))):
        row = int(rng.integers(0, W))
        h = _hashes(rng, int(rng.integers(0, STRIDE + 3)))
        isl = max(1, len(h) * BS - int(rng.integers(0, BS)))
        reserve_slot(
            slot,
            row,
            isl,
            h,
            int(rng.integers(0, isl + 1)),
            -1,
            0,
            0,
            1,
            1,
            BS,
            STRIDE,
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
        if len(h) and rng.random() < 0.8:
            ix.insert(
                h[: int(rng.integers(1, len(h) + 1))], row, int(rng.integers(0, 1000)), int(rng.integers(1, 10**6))
            )
    a.s_generation[SLOTS - 1] = 0xFFFF_FFFF  # the wrap of the generation
    return rng, a, ix


def _ledger_args(a: LedgerArrays) -> list:
    return [getattr(a, f) for f in LEDGER_FIELDS]


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_reserve_slot_equals_the_reference(seed):
    rng, a0, _ = _world(seed)
    slot = int(rng.choice([SLOTS - 1, SLOTS - 2]))
    row = int(rng.integers(0, W))
    h = _hashes(rng, int(rng.integers(0, STRIDE + 4)))
    isl = max(1, len(h) * BS - int(rng.integers(0, BS)) + int(rng.integers(0, 3)) * BS)
    head = (slot, row, isl, h, int(rng.integers(-5, isl + 20)), int(rng.integers(-1, 100)), 2, 7, 9, 3, BS, STRIDE)
    results = []
    for fn in (reserve_slot, reference.reserve_slot):
        a = copy.deepcopy(a0)
        results.append((fn(*head, *_ledger_args(a)), a))
    for gen, a in results[1:]:
        assert gen == results[0][0]
        for f in LEDGER_FIELDS:
            np.testing.assert_array_equal(getattr(a, f), getattr(results[0][1], f), err_msg=f)
    assert results[0][0] == 1  # 0xFFFF_FFFF wraps to 1; a fresh slot starts at 1


KNOBS = dict(
    lead_release_requests_ratio=st.sampled_from([0.0, 2.0]),
    interference_weight=st.sampled_from([0.0, 1.0]),
    recent_weight=st.sampled_from([0.0, 1.0]),
    lead_max_wait_steps=st.sampled_from([0.0, 10.0]),
    busy=st.sampled_from([(-1.0, -1.0, 1.0), (-1.0, 1.0, 1.0), (300.0, -1.0, 0.5), (0.0, 0.2, 1.0)]),
)


def _packed(*args):
    """`admit_kv_packed` called with `admit_kv`'s arguments: its 41 arrays packed into one table."""
    return admit_kv_packed(*args[:16], pack_admit_arrays(args[16:]))


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31), depth_given=st.booleans(), decay_recent=st.booleans(), **KNOBS)
def test_admit_kv_equals_the_reference(
    seed,
    depth_given,
    decay_recent,
    lead_release_requests_ratio,
    interference_weight,
    recent_weight,
    lead_max_wait_steps,
    busy,
):
    """Every outcome: admitted (the row booked, the hashes recorded, recent work added), BUSY (nothing
    written) and UNDECIDED (ties at an idle fleet are frequent here: nothing booked)."""
    rng, a0, ix0 = _world(seed)
    params = np.zeros(len(ADMIT_PARAMS))
    values = dict(
        prefill_load_scale=1.0,
        overlap_credit=1.0,
        inv_bs=1.0 / BS,
        prefill_weight=16.0,
        active_blocks_weight=0.1,
        recent_weight=recent_weight,
        lead_bonus=400.0,
        lead_cap_blocks=64.0,
        lead_release_steps=16.0,
        lead_release_recent_ratio=2.0,
        lead_release_requests_ratio=lead_release_requests_ratio,
        lead_max_wait_steps=lead_max_wait_steps,
        lead_max_wait_per_lead=3.0,
        interference_weight=interference_weight,
        interference_cap_prompts=0.1,
        busy_threshold=busy[0],
        busy_threshold_frac=busy[1],
        busy_worker_ratio=busy[2],
    )
    for k, v in values.items():
        params[P[k]] = v
    elig = (rng.random(W) < 0.8).astype(np.uint8)
    elig[int(rng.integers(0, W))] = 1
    placeable = (elig | (rng.random(W) < 0.3)).astype(np.bool_)
    h = _hashes(rng, int(rng.integers(0, STRIDE + 2)))
    isl = max(1, len(h) * BS - int(rng.integers(0, BS)))
    recent0 = rng.random(W) * rng.choice([0.0, 500.0])
    depth0 = rng.integers(0, 4, W).astype(np.int32)
    now = int(rng.integers(1000, 2000))
    results = []
    for fn in (admit_kv, _packed, reference.admit_kv):
        a, ix = copy.deepcopy(a0), copy.deepcopy(ix0)
        recent, depth, out = recent0.copy(), depth0.copy(), np.zeros(OUT_LEN, np.int64)
        ring = [
            np.zeros((3, W), np.uint8),
            np.zeros((3, W), np.int32),
            np.zeros((3, W), np.int64),
            np.zeros((3, W), np.int64),
            np.zeros((3, 5, W)),
        ]
        r = fn(
            h,
            isl,
            now,
            SLOTS - 2,
            40,
            1,
            now - 5,
            3,
            now + 10**6,
            0.75,
            int(decay_recent),
            1 if depth_given else 0,
            1,
            params,
            BS,
            STRIDE,
            elig,
            placeable,
            ix.keys,
            ix.used,
            ix.perm,
            ix.ttlm,
            ix.ttl_exp,
            ix.scratch,
            depth,
            a.w_generation,
            a.w_active_blocks,
            a.w_active_prefill,
            a.w_active_requests,
            a.w_max_batched_tokens,
            a.ref_keys,
            a.ref_counts,
            a.arena,
            *_ledger_args(a)[7:],
            recent,
            np.zeros((4, W)),
            *ring,
            out,
        )
        results.append((r, a, ix, recent, depth, out, ring))
    r0, a0_, ix0_, recent0_, depth0_, out0, ring0 = results[0]
    assert r0 >= 0 or r0 in (BUSY, UNDECIDED)
    for r, a, ix, recent, depth, out, ring in results[1:]:
        assert r == r0
        for f in LEDGER_FIELDS:
            np.testing.assert_array_equal(getattr(a, f), getattr(a0_, f), err_msg=f)
        for f in ("keys", "used", "perm", "ttlm", "ttl_exp"):
            np.testing.assert_array_equal(getattr(ix, f), getattr(ix0_, f), err_msg=f)
        np.testing.assert_array_equal(recent, recent0_)
        np.testing.assert_array_equal(depth, depth0_)
        if r0 != BUSY:
            np.testing.assert_array_equal(out, out0)
            for got, want in zip(ring, ring0, strict=True):
                np.testing.assert_array_equal(got[1], want[1])
    if r0 < 0:  # nothing booked, nothing recorded, no recent work
        for f in LEDGER_FIELDS:
            np.testing.assert_array_equal(getattr(a0_, f), getattr(a0, f), err_msg=f)
        np.testing.assert_array_equal(ix0_.keys, ix0.keys)
        np.testing.assert_array_equal(recent0_, recent0)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31), has_offload=st.booleans(), credit=st.sampled_from([0.0, 0.5, 1.0]))
def test_credited_depth_equals_the_reference(seed, has_offload, credit):
    """Four indexes holding overlapping prefixes (permanent and TTL holders), stale and unfed rows."""
    from kvsched.shm.admit_kernels import credited_depth
    from kvsched.shm.admit_packed import credited_depth_packed, pack_credited_arrays

    def packed(*args):  # `credited_depth_packed` called with `credited_depth`'s arguments
        credited_depth_packed(*args[:5], pack_credited_arrays(args[5:]))

    rng = np.random.default_rng(seed)
    ixs = [OverlapIndex(W, 64) for _ in range(4)]
    for ix in ixs:
        for _ in range(int(rng.integers(0, 8))):
            h = _hashes(rng, int(rng.integers(1, STRIDE + 1)))
            ttl = None if rng.random() < 0.4 else int(rng.integers(1, 3000))
            ix.insert(h[: int(rng.integers(1, len(h) + 1))], int(rng.integers(0, W)), int(rng.integers(0, 1000)), ttl)
    fed = (rng.random(W) < 0.7).astype(np.uint8)
    flags = np.where(rng.random(W) < 0.3, 4, 0).astype(np.uint8)
    h = _hashes(rng, int(rng.integers(0, STRIDE + 1)))
    now = int(rng.integers(0, 4000))
    outs = []
    for fn in (credited_depth, packed, reference.credited_depth):
        arrays = [np.zeros(W, np.int32) for _ in range(6)]
        idx_args = [x for ix in ixs for x in (ix.keys, ix.used, ix.perm, ix.ttlm, ix.ttl_exp)]
        fn(h, now, int(has_offload), credit, 4, *idx_args, ixs[0].scratch, *arrays[:4], fed, flags, *arrays[4:])
        outs.append(arrays)
    for got in outs[1:]:
        for k, (g, w) in enumerate(zip(got, outs[0], strict=True)):
            if k == 2 and not has_offload:
                continue  # the offload depth is not computed without an offload index
            np.testing.assert_array_equal(g, w, err_msg=str(k))


def test_pack_admit_arrays_rejects_what_the_kernel_would_misread():
    """A table describes only arrays of the kernel's dtype, ndim and C layout (`shm.argtable`)."""
    good = [np.zeros((2,) * ndim, dtype) for _, dtype, ndim in ADMIT_ARRAYS]
    assert pack_admit_arrays(tuple(good)).shape == (4 * len(ADMIT_ARRAYS),)
    for k, bad in (
        (8, np.zeros(2, np.int64)),  # depth: int32 expected
        (4, np.zeros(2, np.uint64)),  # ov_perm: 2-D expected
        (10, np.zeros(4, np.int64)[::2]),  # not contiguous
        (10, np.frombuffer(bytes(16), np.int64)),
    ):  # read-only
        args = list(good)
        args[k] = bad
        with pytest.raises(ValueError, match=ADMIT_ARRAYS[k][0]):
            pack_admit_arrays(tuple(args))
    with pytest.raises(ValueError):
        pack_admit_arrays(tuple(good[:-1]))
