"""`booking_kernels.release_booking` (13 ledger arrays) and `kernels.fold_words` (15 arrays) with their
arrays given as one int64 table (`shm/argtable.py`): `release_booking_packed`, `fold_words_packed`,
and the functions that build their tables.

A Release frame costs one `release_booking` call and a wake that finds a router's word changed one
`fold_words` call; even through their compiled entry points (`shm/bind.py`) numba unboxes each array
on every call (~0.15-0.2 µs apiece on this project's VM) before the body runs. The ledger
(`Ledger._k_release`) and the word fold (`WordFold._bind`) build each table once, keep the arrays
referenced beside it and call these kernels with the per-call scalars and the table.

Results and writes are the unpacked kernels' (these call them): tests/shm/test_booking_kernels.py
and tests/core/test_words_fold.py run the packed forms. Cache key: `shm.kernel_cache`.
"""

from __future__ import annotations

import numpy as np

from .argtable import pack_table, view1, view2
from .booking_kernels import release_booking
from .kernel_cache import njit
from .kernels import fold_words
from .layout import LedgerArrays

# `release_booking`'s arguments after (slot, generation), as (name, dtype, ndim) (`shm.layout` dtypes)
RELEASE_ARRAYS = (
    ("s_state", np.uint8, 1),
    ("s_generation", np.uint32, 1),
    ("s_worker_row", np.int32, 1),
    ("s_arena_off", np.int64, 1),
    ("s_arena_len", np.int32, 1),
    ("s_extra_blocks", np.int64, 1),
    ("s_prefill", np.int64, 1),
    ("arena", np.uint64, 1),
    ("ref_keys", np.uint64, 2),
    ("ref_counts", np.int32, 2),
    ("w_active_blocks", np.int64, 1),
    ("w_active_prefill", np.int64, 1),
    ("w_active_requests", np.int64, 1),
)


def pack_release_arrays(a) -> np.ndarray:
    """int64 table of `release_booking`'s 13 arrays of ledger `a` (`RELEASE_ARRAYS` order). The caller
    keeps `a` alive while it uses the table (`shm.argtable`). Raises ValueError for an array of another
    dtype, ndim or layout."""
    return pack_table(tuple(getattr(a, name) for name, _, _ in RELEASE_ARRAYS), RELEASE_ARRAYS)


@njit(cache=True, nogil=True)
def release_booking_packed(slot, generation, table):
    """`release_booking(slot, generation, *arrays)` with the 13 arrays as one table
    (`pack_release_arrays`). Returns what `release_booking` returns (the row, or -1)."""
    t = table
    return release_booking(
        slot,
        generation,
        view1(t, 0, np.uint8),
        view1(t, 1, np.uint32),
        view1(t, 2, np.int32),
        view1(t, 3, np.int64),
        view1(t, 4, np.int32),
        view1(t, 5, np.int64),
        view1(t, 6, np.int64),
        view1(t, 7, np.uint64),
        view2(t, 8, np.uint64),
        view2(t, 9, np.int32),
        view1(t, 10, np.int64),
        view1(t, 11, np.int64),
        view1(t, 12, np.int64),
    )


# `fold_words`'s arrays (every argument but `n_slots` and `block_size`), as (name, dtype, ndim)
FOLD_ARRAYS = (
    ("progress", np.uint64, 1),
    ("state", np.uint64, 1),
    ("seen_state", np.uint64, 1),
    ("s_state", np.uint8, 1),
    ("s_generation", np.uint32, 1),
    ("s_worker_row", np.int32, 1),
    ("s_isl", np.int64, 1),
    ("s_prefill", np.int64, 1),
    ("s_output_tokens", np.int64, 1),
    ("s_extra_blocks", np.int64, 1),
    ("w_active_blocks", np.int64, 1),
    ("w_active_prefill", np.int64, 1),
    ("out_dispatched", np.int64, 1),
    ("out_counts", np.int64, 1),
    ("out_rows", np.int64, 1),
)


def pack_fold_arrays(arrays: tuple) -> np.ndarray:
    """int64 table of `fold_words`'s 15 arrays (`FOLD_ARRAYS` order); the caller keeps them alive while
    it uses the table. Raises ValueError for an array of another dtype, ndim or layout."""
    return pack_table(arrays, FOLD_ARRAYS)


@njit(cache=True, nogil=True)
def fold_words_packed(n_slots, block_size, table):
    """`fold_words` over slots [0, n_slots) with its 15 arrays as one table (`pack_fold_arrays`).
    Returns what `fold_words` returns (the slots whose load changed)."""
    t = table
    u64, i64 = np.uint64, np.int64
    return fold_words(
        n_slots,
        view1(t, 0, u64),
        view1(t, 1, u64),
        view1(t, 2, u64),
        view1(t, 3, np.uint8),
        view1(t, 4, np.uint32),
        view1(t, 5, np.int32),
        view1(t, 6, i64),
        view1(t, 7, i64),
        view1(t, 8, i64),
        view1(t, 9, i64),
        view1(t, 10, i64),
        view1(t, 11, i64),
        block_size,
        view1(t, 12, i64),
        view1(t, 13, i64),
        view1(t, 14, i64),
    )


def warm_booking_packed() -> None:
    """Compile (or load from NUMBA_CACHE_DIR) both packed kernels (called by `shm.warm.warm_kernels`)."""
    a = LedgerArrays.private(2, 2, 4, 16, 4)
    release_booking_packed(0, 1, pack_release_arrays(a))
    words = [np.zeros(2, np.uint64) for _ in range(3)]
    fold_words_packed(
        2,
        4,
        pack_fold_arrays((*words, *a.load, np.zeros(2, np.int64), np.zeros(3, np.int64), np.zeros(2, np.int64))),
    )
