"""`booking_kernels.release_booking` with its 13 ledger arrays given as one int64 table
(`shm/argtable.py`): `release_booking_packed`, and the function that builds its table.

A Release frame costs one `release_booking` call; even through its compiled entry point
(`shm/bind.py`) numba unboxes each of the 13 arrays on every call (~0.15-0.2 µs apiece on this
project's VM) before the body runs. The ledger builds the table once over its arrays
(`Ledger._k_release`), keeps the arrays referenced beside it and calls this kernel with the slot,
the generation and the table.

Results and writes are `release_booking`'s (this kernel calls it): tests/shm/test_booking_kernels.py
runs both forms against the twins. Cache key: as in `admit_kernels`, a digest of the composed
kernels' sources is a closure variable (numba's cache key covers only this file otherwise).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from numba import njit

from .argtable import pack_table, view1, view2
from .booking_kernels import release_booking

# `release_booking`'s arguments after (slot, generation), as (name, dtype, ndim) (`shm.layout` dtypes)
RELEASE_ARRAYS = (
    ("s_state", np.uint8, 1), ("s_generation", np.uint32, 1), ("s_worker_row", np.int32, 1),
    ("s_arena_off", np.int64, 1), ("s_arena_len", np.int32, 1), ("s_extra_blocks", np.int64, 1),
    ("s_prefill", np.int64, 1), ("arena", np.uint64, 1), ("ref_keys", np.uint64, 2), ("ref_counts", np.int32, 2),
    ("w_active_blocks", np.int64, 1), ("w_active_prefill", np.int64, 1), ("w_active_requests", np.int64, 1))


def _sources_digest() -> str:
    """sha256 of the source files `release_booking_packed` composes (module docstring: cache key)."""
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for name in ("booking_kernels.py", "kernels.py", "argtable.py", "layout.py", "mix.py", "words.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()


def pack_release_arrays(a) -> np.ndarray:  # noqa: ANN001 - a LedgerArrays
    """int64 table of `release_booking`'s 13 arrays of ledger `a` (`RELEASE_ARRAYS` order). The caller
    keeps `a` alive while it uses the table (`shm.argtable`). Raises ValueError for an array of another
    dtype, ndim or layout."""
    return pack_table(tuple(getattr(a, name) for name, _, _ in RELEASE_ARRAYS), RELEASE_ARRAYS)


def _make_release_booking_packed(digest: str):
    """Build `release_booking_packed` with `digest` as a closure variable (module docstring)."""

    @njit(cache=True, nogil=True)
    def release_booking_packed(slot, generation, table):
        """`release_booking(slot, generation, *arrays)` with the 13 arrays as one table
        (`pack_release_arrays`). Returns what `release_booking` returns (the row, or -1)."""
        if len(digest) == 0:  # never: `digest` is here for numba's cache key (module docstring)
            return -1
        t = table
        return release_booking(slot, generation, view1(t, 0, np.uint8), view1(t, 1, np.uint32), view1(t, 2, np.int32),
                               view1(t, 3, np.int64), view1(t, 4, np.int32), view1(t, 5, np.int64),
                               view1(t, 6, np.int64), view1(t, 7, np.uint64), view2(t, 8, np.uint64),
                               view2(t, 9, np.int32), view1(t, 10, np.int64), view1(t, 11, np.int64),
                               view1(t, 12, np.int64))

    return release_booking_packed


release_booking_packed = _make_release_booking_packed(_sources_digest())


def warm_booking_packed() -> None:
    """Compile (or load from NUMBA_CACHE_DIR) `release_booking_packed` (called by `kernels.warm_kernels`)."""
    from .layout import LedgerArrays

    a = LedgerArrays.private(2, 2, 4, 16, 4)
    release_booking_packed(0, 1, pack_release_arrays(a))
