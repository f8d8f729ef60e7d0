"""Every kernel compiled (or loaded from NUMBA_CACHE_DIR) before the daemon says READY: one call over
each kernel module's own warm-up, on tiny arrays of the dtypes the ledger and the overlap index use."""

from __future__ import annotations

from .admit_kernels import warm_admit_kernels
from .admit_packed import warm_admit_packed
from .booking_kernels import warm_booking_kernels
from .booking_packed import warm_booking_packed
from .kernels import warm_ledger_kernels
from .overlap import warm_overlap_kernels
from .select_kernels import warm_select_kernels


def warm_kernels() -> None:
    """Compile every kernel of `kvsched.shm` for the daemon's argument types (a cold cache takes
    seconds to minutes: docs/BENCHMARKS.md; a warm one well under a second)."""
    warm_ledger_kernels()
    warm_overlap_kernels()
    warm_booking_kernels()
    warm_booking_packed()
    warm_select_kernels()
    warm_admit_packed(*warm_admit_kernels())
