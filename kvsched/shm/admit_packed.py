"""`admit_kv` and `credited_depth` (`shm/admit_kernels.py`) with their fixed arrays given as ONE int64
table: `admit_kv_packed`, `credited_depth_packed`, and the functions that build their tables.

Numba unboxes every argument of every call before the body runs (~0.2 µs per array argument on this
project's VM, `shm/argtable.py`); `admit_kv` takes 41 arrays and `credited_depth` 29 that are the
same objects call after call (the ledger's, the overlap indexes', scratch space, the explain ring).
The core builds each table once (`core.admitter.Admitter.kernel_arrays`, `OverlapView.depth`), keeps the arrays
referenced beside it, and rebuilds it when one of them is replaced. Measured with
`bench/bench_admit_kernel.py` (bench_core's state): the admission call ~10.7 -> ~4.5 µs before the
kernel's work, the whole `admit_kv` call ~37 -> ~31 µs (medians, noisy shared machine).

Results and writes are those of the unpacked kernels (they call them): tests/shm/test_admit_kernels.py
runs both forms against the plain-Python reference (tests/shm/reference.py). Cache key: `shm.kernel_cache`.
"""

from __future__ import annotations

import numpy as np

from .admit_kernels import admit_kv, credited_depth
from .argtable import pack_table, view1, view2, view3
from .kernel_cache import njit

# `admit_kv`'s arguments from `eligible` to `out` (they follow `block_size, stride`), as
# (name, dtype, ndim): the table `admit_kv_packed` takes instead of them (`pack_admit_arrays`).
ADMIT_ARRAYS = (
    ("eligible", np.uint8, 1),
    ("placeable", np.bool_, 1),
    ("ov_keys", np.uint64, 1),
    ("ov_used", np.uint8, 1),
    ("ov_perm", np.uint64, 2),
    ("ov_ttlm", np.uint64, 2),
    ("ov_ttl_exp", np.int64, 1),
    ("ov_scratch", np.uint64, 1),
    ("depth", np.int32, 1),
    ("w_generation", np.uint32, 1),
    ("w_active_blocks", np.int64, 1),
    ("w_active_prefill", np.int64, 1),
    ("w_active_requests", np.int64, 1),
    ("w_max_batched", np.int64, 1),
    ("ref_keys", np.uint64, 2),
    ("ref_counts", np.int32, 2),
    ("arena", np.uint64, 1),
    ("s_state", np.uint8, 1),
    ("s_generation", np.uint32, 1),
    ("s_worker_row", np.int32, 1),
    ("s_worker_generation", np.uint32, 1),
    ("s_isl", np.int64, 1),
    ("s_cached", np.int64, 1),
    ("s_prefill", np.int64, 1),
    ("s_expected_osl", np.int64, 1),
    ("s_output_tokens", np.int64, 1),
    ("s_extra_blocks", np.int64, 1),
    ("s_class", np.int32, 1),
    ("s_enqueue_us", np.int64, 1),
    ("s_admit_us", np.int64, 1),
    ("s_arena_off", np.int64, 1),
    ("s_arena_len", np.int32, 1),
    ("s_owner_pid", np.int64, 1),
    ("recent", np.float64, 1),
    ("scratch", np.float64, 2),
    ("ring_elig", np.uint8, 2),
    ("ring_depth", np.int32, 2),
    ("ring_blocks", np.int64, 2),
    ("ring_prefill", np.int64, 2),
    ("ring_terms", np.float64, 3),
    ("out", np.int64, 1),
)


def pack_admit_arrays(arrays: tuple) -> np.ndarray:
    """int64 table of `admit_kv`'s 41 array arguments (`ADMIT_ARRAYS` order) for `admit_kv_packed`.
    The caller keeps `arrays` alive while it uses the table (`shm.argtable`). Raises ValueError
    for an array of another dtype, ndim or layout."""
    return pack_table(arrays, ADMIT_ARRAYS)


@njit(cache=True, nogil=True)
def admit_kv_packed(
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
    table,
):
    """`admit_kv` with its 41 fixed arrays given as one table (`pack_admit_arrays`): the same
    arguments up to `stride`, then `table` int64[4 * 41]. Same result, same writes; the call
    itself costs ~2.5 µs instead of ~13 µs (`shm.argtable`). Returns what `admit_kv` returns."""
    t = table
    return admit_kv(
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
        view1(t, 0, np.uint8),
        view1(t, 1, np.bool_),
        view1(t, 2, np.uint64),
        view1(t, 3, np.uint8),
        view2(t, 4, np.uint64),
        view2(t, 5, np.uint64),
        view1(t, 6, np.int64),
        view1(t, 7, np.uint64),
        view1(t, 8, np.int32),
        view1(t, 9, np.uint32),
        view1(t, 10, np.int64),
        view1(t, 11, np.int64),
        view1(t, 12, np.int64),
        view1(t, 13, np.int64),
        view2(t, 14, np.uint64),
        view2(t, 15, np.int32),
        view1(t, 16, np.uint64),
        view1(t, 17, np.uint8),
        view1(t, 18, np.uint32),
        view1(t, 19, np.int32),
        view1(t, 20, np.uint32),
        view1(t, 21, np.int64),
        view1(t, 22, np.int64),
        view1(t, 23, np.int64),
        view1(t, 24, np.int64),
        view1(t, 25, np.int64),
        view1(t, 26, np.int64),
        view1(t, 27, np.int32),
        view1(t, 28, np.int64),
        view1(t, 29, np.int64),
        view1(t, 30, np.int64),
        view1(t, 31, np.int32),
        view1(t, 32, np.int64),
        view1(t, 33, np.float64),
        view2(t, 34, np.float64),
        view2(t, 35, np.uint8),
        view2(t, 36, np.int32),
        view2(t, 37, np.int64),
        view2(t, 38, np.int64),
        view3(t, 39, np.float64),
        view1(t, 40, np.int64),
    )


_INDEX_ARRAYS = (
    ("keys", np.uint64, 1),
    ("used", np.uint8, 1),
    ("perm", np.uint64, 2),
    ("ttlm", np.uint64, 2),
    ("ttl_exp", np.int64, 1),
)
# `credited_depth`'s arguments from `a_keys` to `out`, as (name, dtype, ndim): the table
# `credited_depth_packed` takes instead of them (`pack_credited_arrays`).
CREDITED_ARRAYS = (
    *((f"{tier}_{name}", dt, nd) for tier in "ados" for name, dt, nd in _INDEX_ARRAYS),
    ("scratch", np.uint64, 1),
    ("approx_depth", np.int32, 1),
    ("dev_depth", np.int32, 1),
    ("off_depth", np.int32, 1),
    ("spec_depth", np.int32, 1),
    ("event_fed", np.uint8, 1),
    ("w_flags", np.uint8, 1),
    ("spec_raw", np.int32, 1),
    ("out", np.int32, 1),
)


def pack_credited_arrays(arrays: tuple) -> np.ndarray:
    """int64 table of `credited_depth`'s 29 array arguments (`CREDITED_ARRAYS` order) for
    `credited_depth_packed`; the caller keeps `arrays` alive while it uses the table. Raises
    ValueError for an array of another dtype, ndim or layout."""
    return pack_table(arrays, CREDITED_ARRAYS)


@njit(cache=True, nogil=True)
def credited_depth_packed(hashes, now_us, has_offload, offload_credit, stale_flag, table):
    """`credited_depth` with its 29 arrays given as one table (`pack_credited_arrays`): the same
    arguments up to `stale_flag`, then `table` int64[4 * 29]. Same writes (`shm.argtable`)."""
    t = table
    u8, u64, i32, i64 = np.uint8, np.uint64, np.int32, np.int64
    credited_depth(
        hashes,
        now_us,
        has_offload,
        offload_credit,
        stale_flag,
        view1(t, 0, u64),
        view1(t, 1, u8),
        view2(t, 2, u64),
        view2(t, 3, u64),
        view1(t, 4, i64),
        view1(t, 5, u64),
        view1(t, 6, u8),
        view2(t, 7, u64),
        view2(t, 8, u64),
        view1(t, 9, i64),
        view1(t, 10, u64),
        view1(t, 11, u8),
        view2(t, 12, u64),
        view2(t, 13, u64),
        view1(t, 14, i64),
        view1(t, 15, u64),
        view1(t, 16, u8),
        view2(t, 17, u64),
        view2(t, 18, u64),
        view1(t, 19, i64),
        view1(t, 20, u64),
        view1(t, 21, i32),
        view1(t, 22, i32),
        view1(t, 23, i32),
        view1(t, 24, i32),
        view1(t, 25, u8),
        view1(t, 26, u8),
        view1(t, 27, i32),
        view1(t, 28, i32),
    )


def warm_admit_packed(hashes: np.ndarray, params: np.ndarray, arrays: tuple, credited: tuple) -> None:
    """Compile (or load from the cache) both packed kernels for the types of `warm_admit_kernels`'s
    inputs, which it returns (called by `shm.warm.warm_kernels`)."""
    admit_kv_packed(hashes, 8, 2, 1, -1, 0, 1, 0, 10, 1.0, 1, 0, 0, params, 4, 4, pack_admit_arrays(arrays))
    credited_depth_packed(hashes, 1, 1, 0.5, 4, pack_credited_arrays(credited))
