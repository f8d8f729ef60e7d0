"""Argument tables: many fixed arrays passed to a numba kernel as ONE int64 array.

Calling a numba function costs time per argument before its body runs: the dispatcher types each
argument and unboxes each array into a native struct. Measured on this project's VM (2 vCPUs,
`bench/bench_admit_kernel.py`): a call with 43 array and 14 scalar arguments took 13.6 µs, the same
call with 2 arrays (one of them a table like this one) and the 14 scalars 2.5 µs, a 1-array call
1.7 µs. A kernel called for every request with dozens of arrays that never change (the ledger's,
the overlap index's, scratch space) therefore takes them as a table made once:

    table = int64[4 * K]: for array k, table[4k] = its data address, table[4k + 1 .. 4k + 3] = its
    shape (up to 3 dimensions; unused ones 1).

and rebuilds each array inside the kernel with `view1` / `view2` / `view3` (`numba.carray` over the
address: no copy, C order, the table's shape, the dtype the kernel names). `pack_table` checks every
array against the kernel's (name, dtype, ndim) list (C-contiguous, writeable), so a table never
describes an array of another type or layout.

Lifetime: the table holds addresses, not references. The caller keeps the arrays (e.g. in the same
tuple as the table) for as long as it uses the table, and builds a new table when any of the arrays
is replaced (a segment re-attached after a restart maps new memory). A table is this process's
cache: an owner that is copied or pickled drops it (`__getstate__` of `Admitter` and `OverlapView`),
or the copy's kernels would write the original's arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import types
from numba.extending import intrinsic
from numba.np.numpy_support import carray

from .kernel_cache import njit

ENTRY = 4  # table words per array: address, shape[0], shape[1], shape[2]


def _pointer_typing(typingctx, addr, dtype):
    """An int64 address as a typed data pointer (`dtype` a numba number class such as np.int64)."""
    ty = dtype.instance_type if isinstance(dtype, types.NumberClass) else dtype.dtype
    sig = types.CPointer(ty)(types.int64, dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(ty)))

    return sig, codegen


# Called from kernels as `_pointer(addr, dtype)`: numba's stubs give an intrinsic the parameters of its
# typing function, the typing context included, so the call is declared here without them.
_pointer: Callable[..., Any] = intrinsic(_pointer_typing)


@njit(cache=True, nogil=True, inline="always")
def view1(table, k, dtype):
    """Array `k` of `table` as a 1-D C array of `dtype` (no copy)."""
    o = ENTRY * k
    return carray(_pointer(table[o], dtype), (table[o + 1],))


@njit(cache=True, nogil=True, inline="always")
def view2(table, k, dtype):
    """Array `k` of `table` as a 2-D C array of `dtype` (no copy)."""
    o = ENTRY * k
    return carray(_pointer(table[o], dtype), (table[o + 1], table[o + 2]))


@njit(cache=True, nogil=True, inline="always")
def view3(table, k, dtype):
    """Array `k` of `table` as a 3-D C array of `dtype` (no copy)."""
    o = ENTRY * k
    return carray(_pointer(table[o], dtype), (table[o + 1], table[o + 2], table[o + 3]))


def pack_table(arrays: tuple, spec: tuple) -> np.ndarray:
    """int64[ENTRY * len(spec)]: the table of `arrays` (module docstring).

    Args:
        arrays: numpy arrays, in the kernel's order.
        spec: ((name, dtype, ndim), ...), one per array: what the kernel's `view*` calls expect.
    Raises:
        ValueError: a count, dtype, ndim, a non C-contiguous or a read-only array that does not match.
    """
    if len(arrays) != len(spec):
        raise ValueError(f"{len(arrays)} arrays for a table of {len(spec)}")
    table = np.ones(ENTRY * len(spec), np.int64)
    for k, (arr, (name, dtype, ndim)) in enumerate(zip(arrays, spec, strict=True)):
        if not isinstance(arr, np.ndarray) or arr.dtype != np.dtype(dtype) or arr.ndim != ndim:
            got = f"{arr.dtype}, {arr.ndim}-D" if isinstance(arr, np.ndarray) else type(arr).__name__
            raise ValueError(f"{name}: {got}, expected {np.dtype(dtype)}, {ndim}-D")
        if not (arr.flags.c_contiguous and arr.flags.writeable):
            raise ValueError(f"{name}: must be C-contiguous and writeable")
        table[ENTRY * k] = arr.__array_interface__["data"][0]
        table[ENTRY * k + 1 : ENTRY * k + 1 + ndim] = arr.shape
    return table
