"""The refcount index keeps probe chains short for structured keys (sequential suffixes, shared
prefixes, multiples of the table size): the lookups of `project_and_cost` stay O(1) per hash as
the number of active sequences grows. Counts entries, never times anything."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.shm import kernels
from kvsched.shm.layout import default_ref_capacity


def _displacements(keys_row: np.ndarray, counts_row: np.ndarray) -> np.ndarray:
    """Distance (entries) of every stored key from its home entry (`kernels._home`): the probes
    a lookup of that key costs, minus one."""
    mask = keys_row.shape[0] - 1
    idx = np.nonzero(counts_row)[0]
    return np.array([(int(i) - int(kernels._home(keys_row[i], mask))) & mask for i in idx], np.int64)


def _bench_like_row(n_bookings: int, rng: np.random.Generator) -> list[np.ndarray]:
    """One worker row's bookings as `bench/bench_kernels.py` makes them: a 16-block prefix from
    one of 50 pools (keys g*1000 + 0..15) and 8..47 sequential suffix keys."""
    out, nxt = [], 10**9
    for _ in range(n_bookings):
        g, n = int(rng.integers(50)), int(rng.integers(8, 48))
        out.append(
            np.concatenate(
                [np.arange(g * 1000, g * 1000 + 16, dtype=np.uint64), np.arange(nxt, nxt + n, dtype=np.uint64)]
            )
        )
        nxt += n
    return out


@pytest.mark.parametrize("n_workers,n_active", [(64, 10_000), (64, 100_000), (512, 100_000)])
def test_probe_chains_stay_short_when_bench_like_fill(n_workers, n_active):
    cap = default_ref_capacity(n_workers, n_active, 64)
    keys, counts = np.zeros(cap, np.uint64), np.zeros(cap, np.int32)
    for h in _bench_like_row(n_active // n_workers, np.random.default_rng(n_active)):
        kernels.ref_add(keys, counts, h)
    d = _displacements(keys, counts)
    assert (counts > 0).sum() <= cap // 2  # the capacity rule's load factor
    assert d.mean() < 1.0 and d.max() < 32, (d.mean(), d.max())


@pytest.mark.parametrize("stride_log", [0, 10, 15, 20])
def test_probe_chains_stay_short_when_keys_are_multiples_of_a_power_of_two(stride_log):
    cap = 1 << 15
    keys, counts = np.zeros(cap, np.uint64), np.zeros(cap, np.int32)
    kernels.ref_add(keys, counts, np.arange(1, cap // 4 + 1, dtype=np.uint64) << np.uint64(stride_log))
    d = _displacements(keys, counts)
    assert (counts > 0).sum() == cap // 4  # every key stored (none dropped at MAX_PROBE)
    assert d.mean() < 1.0 and d.max() < 32, (d.mean(), d.max())
