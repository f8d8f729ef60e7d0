"""A numba kernel's compiled function for fixed argument types, called without the dispatcher.

Calling an `@njit` dispatcher resolves the argument types on every call (a type fingerprint per
argument, then a lookup of the compiled overload) before the compiled function unboxes the
arguments: ~0.5 µs plus ~0.1 µs per argument here, i.e. a third of what a one-event kernel such as
`booking_kernels.slot_dispatched` costs in all. A caller whose arguments always have the same types
(the ledger's arrays, ints) resolves them once with `entry_point` and calls the compiled function
directly. The compiled function still checks each array's type while unboxing it (a wrong dtype or
dimension raises `TypeError`); it converts a float passed for an int, so callers pass ints.

Source: numba `Dispatcher.compile(sig)`, which returns the overload's entry point (loaded from the
on-disk cache when `cache=True`, compiled otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba


def entry_point(kernel: Any, example_args: tuple) -> Callable:
    """The compiled function of `kernel` (an `@njit` dispatcher) for the types of `example_args`.

    Args:
        kernel: the dispatcher (or a plain function when numba's JIT is disabled: returned as is).
        example_args: one call's arguments; every later call must pass the same types (arrays of
            the same dtype, dimension, layout and writability; ints where ints are given).
    Returns:
        Callable: the overload's entry point, called with the same positional arguments.
    Raises:
        numba's typing or lowering error when the kernel does not compile for these types.
    """
    compile_ = getattr(kernel, "compile", None)
    if compile_ is None:
        return kernel
    return compile_(tuple(numba.typeof(x) for x in example_args))
