"""The numpy competitor of `bench/bench_kernels.py`: the decision kernels it times, written as array
code (what the selector ran before the kernels existed), with the kernels' names and signatures.

`project_and_cost` (kvsched.shm.kernels) and `overlap_depth` (kvsched.shm.overlap) vectorise over
workers and hashes: every (row, hash) pair probes its window at once. The bench checks their answers
against the kernels' in the same run; the rules themselves are stated by the kernels and checked
against tests/shm/reference.py.
"""

from __future__ import annotations

import numpy as np

from kvsched.shm.kernels import MAX_PROBE
from kvsched.shm.mix import mix64_array
from kvsched.shm.overlap import WINDOW

_U = np.uint64


def _homes(hashes: np.ndarray, mask: int) -> np.ndarray:
    """int64[n]: each hash's home slot in a table of mask + 1 slots."""
    return (mix64_array(hashes) & _U(mask)).astype(np.int64)


def _live_prefix(ref_keys, ref_counts, rows, hashes) -> np.ndarray:
    """int64[len(rows)]: leading hashes live in each of `rows`' refcount tables (all rows x hashes x
    probe steps as array operations)."""
    mask = ref_keys.shape[1] - 1
    h = np.asarray(hashes, np.uint64)
    live = np.zeros((len(rows), h.size), bool)
    if h.size and len(rows):
        homes = _homes(h, mask)
        pending = np.ones((len(rows), h.size), bool)
        r = rows[:, None]
        for p in range(min(ref_keys.shape[1], MAX_PROBE)):
            pos = (homes + p) & mask
            c = ref_counts[r, pos[None, :]]
            hit = pending & (c != 0) & (ref_keys[r, pos[None, :]] == h[None, :])
            live |= hit
            pending &= (c != 0) & ~hit
            if not pending.any():
                break
    return np.cumprod(live, axis=1).sum(axis=1).astype(np.int64)


def project_and_cost(
    w_active_blocks,
    w_active_prefill,
    eligible,
    ref_keys,
    ref_counts,
    hashes,
    isl_tokens,
    block_size,
    overlap_blocks,
    prefill_load_scale,
    overlap_credit,
    out_blocks,
    out_prefill,
    out_cost,
) -> None:
    """`kvsched.shm.kernels.project_and_cost` as numpy array code."""
    rows = np.flatnonzero(eligible)
    live = _live_prefix(ref_keys, ref_counts, rows, hashes)
    request_blocks = (isl_tokens + block_size - 1) // block_size
    out_blocks[:] = -1
    out_prefill[:] = -1
    out_cost[:] = np.inf
    blocks = w_active_blocks[rows] + request_blocks - live
    ob = overlap_blocks[rows].astype(np.int64)
    prefill = w_active_prefill[rows]
    out_blocks[rows] = blocks
    out_prefill[rows] = prefill + isl_tokens - np.minimum(isl_tokens, ob * block_size)
    pre = np.maximum(0.0, (prefill + isl_tokens) / block_size - overlap_credit * ob)
    out_cost[rows] = prefill_load_scale * pre + blocks


def overlap_depth(keys, used, perm, ttlm, ttl_exp, hashes, now_us, scratch, out) -> None:
    """`kvsched.shm.overlap.overlap_depth` as numpy array code (`scratch` unused)."""
    h = np.asarray(hashes, np.uint64)
    if h.size == 0:
        out[:] = 0
        return
    mask = keys.shape[0] - 1
    win = (_homes(h, mask)[:, None] + np.arange(min(keys.shape[0], WINDOW))) & mask
    match = (used[win] != 0) & (keys[win] == h[:, None])
    e = np.where(match.any(axis=1), win[np.arange(h.size), match.argmax(axis=1)], -1)
    present = np.zeros((h.size, perm.shape[1]), np.uint64)
    ok = e >= 0
    ent = e[ok]
    present[ok] = perm[ent] | np.where((ttl_exp[ent] > now_us)[:, None], ttlm[ent], _U(0))
    bits = np.unpackbits(present.view(np.uint8), axis=1, bitorder="little")[:, : out.shape[0]]
    out[:] = np.cumprod(bits, axis=0, dtype=np.int64).sum(axis=0)
