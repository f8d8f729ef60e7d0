"""Where the fused admission kernel's time goes, on `bench_core.py`'s realistic state.

Builds the scheduler `bench_core.py` measures (8 workers, 64 hashes per request, `approx` overlap,
window 8), warms it with 2,000 lifecycles, then runs `--n` more lifecycles while timing (thread CPU
is too coarse per call: `perf_counter_ns` around each call, median and mean over the calls):

* `admit_kv`: the whole kernel call as the admitter makes it;
* `dispatch`: the same call with a busy rule that returns at once (`BUSY`): the cost of calling a
  numba function with this many array arguments, against a 1-argument kernel (`noop1`);
* the composed pieces, each replayed right after the real call on shadow copies of the state that
  evolve exactly like the real ones: `overlap_depth` (approximate index lookup), `overlap_insert`
  (with evictions), `project_and_cost` (refcount probes), `ref_add` + `ref_remove` (a booking's
  refcounts in and out again).

Usage: python bench/bench_admit_kernel.py [--n 3000]   ->  table on stdout
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_core as bc
from numba import njit

import kvsched.core.admitter as admitter_mod
from kvsched.shm import admit_kernels as ak
from kvsched.shm.kernels import project_and_cost, ref_add, ref_remove
from kvsched.shm.overlap import overlap_depth, overlap_insert


@njit(cache=True, nogil=True)
def noop1(a):
    return a.shape[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3000, help="timed lifecycles (default 3,000)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    hashes = bc.make_hashes(rng)
    sched = bc.build("approx")
    clock = [1_000_000]
    bc.run_lifecycles(sched, hashes, 2000, 8, 0, clock)
    adm = sched.admitter if hasattr(sched, "admitter") else sched._admitter  # noqa: SLF001
    ix = adm.view.approx
    a = adm.ledger.arrays
    shadow = {k: getattr(ix, k).copy() for k in ("keys", "used", "perm", "ttlm", "ttl_exp")}
    ref_keys, ref_counts = a.ref_keys.copy(), a.ref_counts.copy()
    w = a.max_workers
    depth = np.zeros(w, np.int32)
    scratch = np.zeros(ix.words, np.uint64)
    blocks, prefill, cost = np.zeros(w, np.int64), np.zeros(w, np.int64), np.zeros(w)
    times: dict[str, list[int]] = {
        k: []
        for k in (
            "admit_kv",
            "dispatch",
            "noop1",
            "overlap_depth",
            "overlap_insert",
            "project_and_cost",
            "ref_add+ref_remove",
        )
    }
    name = "admit_kv_packed"
    real = admitter_mod._admit_entry()  # noqa: SLF001 - the compiled entry point the admitter calls
    busy = np.zeros(len(ak.ADMIT_PARAMS))
    busy[ak.P["busy_threshold"]] = -1.0
    busy[ak.P["busy_threshold_frac"]] = 0.0  # every row busy at frac 0 ... ratio 0: BUSY at once
    busy[ak.P["busy_worker_ratio"]] = 0.0
    pc = time.perf_counter_ns

    def timed(h, isl, now, slot, osl, cls, enq, owner, expiry, *rest):
        t0 = pc()
        row = real(h, isl, now, slot, osl, cls, enq, owner, expiry, *rest)
        times["admit_kv"].append(pc() - t0)
        t0 = pc()
        real(h, isl, now, slot, osl, cls, enq, owner, expiry, *rest[:4], busy, *rest[5:])
        times["dispatch"].append(pc() - t0)
        t0 = pc()
        noop1(h)
        times["noop1"].append(pc() - t0)
        s = shadow
        t0 = pc()
        overlap_depth(s["keys"], s["used"], s["perm"], s["ttlm"], s["ttl_exp"], h, now, scratch, depth)
        times["overlap_depth"].append(pc() - t0)
        t0 = pc()
        project_and_cost(
            a.w_active_blocks,
            a.w_active_prefill,
            adm.elig,
            ref_keys,
            ref_counts,
            h,
            isl,
            16,
            depth,
            1.0,
            1.0,
            blocks,
            prefill,
            cost,
        )
        times["project_and_cost"].append(pc() - t0)
        if row >= 0:
            t0 = pc()
            overlap_insert(s["keys"], s["used"], s["perm"], s["ttlm"], s["ttl_exp"], h, row, now, expiry)
            times["overlap_insert"].append(pc() - t0)
            t0 = pc()
            ref_add(ref_keys[row], ref_counts[row], h)
            ref_remove(ref_keys[row], ref_counts[row], h)
            times["ref_add+ref_remove"].append(pc() - t0)
        return row

    fused = adm
    fused._kernel = timed  # noqa: SLF001 - every fused admission goes through `timed`
    try:
        bc.run_lifecycles(sched, hashes, args.n, 8, 2000, clock)
    finally:
        fused._kernel = real  # noqa: SLF001
    print(
        f"{name} and its pieces, bench_core state (8 workers, 64 hashes, approx, window 8), {args.n} calls; "
        f"wall ns per call (perf_counter_ns around the call)"
    )
    print(f"{'piece':<22} {'median':>8} {'mean':>8} {'p90':>8}")
    for k, v in times.items():
        x = np.array(v, np.float64)
        print(f"{k:<22} {np.median(x):>8.0f} {x.mean():>8.0f} {np.percentile(x, 90):>8.0f}")
    print(f"approx index: {ix.capacity} entries, {len(ix)} used, evictions {ix.evictions}")


if __name__ == "__main__":
    main()
