"""The splitmix64 finalizer, defined once: u64 -> well-mixed u64, a bijection.

Used to place hashes in the open-addressing tables (`kernels.mix64`, compiled with numba from
these constants), to key KV-event blocks of a non-zero group
(`kvsched.kvevents.format.block_key`), and to derive trace block hashes and synthetic token ids in
the simulator. Constants from Vigna's public-domain `splitmix64.c` (the finalizer of Steele, Lea and
Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014).
"""

from __future__ import annotations

import numpy as np

GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: the generator's increment
MIX_M1 = 0xBF58476D1CE4E5B9
MIX_M2 = 0x94D049BB133111EB
MIX_S1, MIX_S2, MIX_S3 = 30, 27, 31  # shifts
U64_MASK = (1 << 64) - 1
_U = np.uint64


def mix64(z: int) -> int:
    """splitmix64 finalizer of one Python int (taken mod 2**64) -> int in [0, 2**64)."""
    z = int(z) & U64_MASK
    z = ((z ^ (z >> MIX_S1)) * MIX_M1) & U64_MASK
    z = ((z ^ (z >> MIX_S2)) * MIX_M2) & U64_MASK
    return z ^ (z >> MIX_S3)


def mix64_array(z: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer elementwise: any integer array -> uint64 array of the same shape
    (arithmetic mod 2**64)."""
    z = np.asarray(z).astype(_U)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> _U(MIX_S1))) * _U(MIX_M1)
        z = (z ^ (z >> _U(MIX_S2))) * _U(MIX_M2)
        return z ^ (z >> _U(MIX_S3))


def splitmix64_array(state: np.ndarray) -> np.ndarray:
    """One splitmix64 output per element: the finalizer of `state + GOLDEN` (uint64, mod 2**64)."""
    with np.errstate(over="ignore"):
        return mix64_array(np.asarray(state).astype(_U) + _U(GOLDEN))
