"""Decision kernels: numba vs their numpy twin (`bench/numpy_twin.py`) vs the plain-Python reference
(tests/shm/reference.py), measured in the same run (docs/DESIGN.md §3.5, §8).

For 8 / 64 / 512 workers and 10^3 / 10^4 / 10^5 active sequences, a ledger is populated with
bookings that share prefixes (a pool of "system prompt" prefixes + unique suffixes), the overlap
index with the same hashes (TTL entries), then one decision-sized query (64 hashes, 16 of them a
shared prefix) is timed through `project_and_cost` and `overlap_depth`. Also times a cold numba
compile vs a load from a warm NUMBA_CACHE_DIR (fresh subprocesses).

Usage: python bench/bench_kernels.py [--quick]   ->  table on stdout, out/bench/kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy_twin

from kvsched.core.ledger import Ledger
from kvsched.core.types import WorkerKey
from kvsched.shm import kernels
from kvsched.shm.layout import LedgerArrays
from kvsched.shm.overlap import OverlapIndex, overlap_depth
from kvsched.shm.warm import warm_kernels
from tests.shm import reference  # (the plain-Python reference: the "python" column)

BLOCK = 16
STRIDE = 64  # hashes kept per request
QUERY_HASHES = 64
PREFIX_BLOCKS = 16
N_PREFIXES = 50


def populate(n_workers: int, n_active: int, rng: np.random.Generator) -> tuple[Ledger, OverlapIndex]:
    """A ledger with `n_active` bookings spread over `n_workers` rows + the matching overlap index."""
    arrays = LedgerArrays.private(n_workers, n_active, STRIDE, None, BLOCK)
    ledger = Ledger(arrays)
    for w in range(n_workers):
        ledger.add_worker(WorkerKey(w, 0), 1 << 20, 8192)
    cap = 1 << int(np.ceil(np.log2(max(1024, 2 * (n_active * 32 + N_PREFIXES * PREFIX_BLOCKS)))))
    index = OverlapIndex(n_workers, cap)
    next_hash = 10**9
    for i in range(n_active):
        g = int(rng.integers(N_PREFIXES))
        suffix = int(rng.integers(8, 48))
        h = np.concatenate(
            [
                np.arange(g * 1000, g * 1000 + PREFIX_BLOCKS, dtype=np.uint64),
                np.arange(next_hash, next_hash + suffix, dtype=np.uint64),
            ]
        )
        next_hash += suffix
        row = int(rng.integers(n_workers))
        isl = len(h) * BLOCK
        ledger.reserve(f"r{i}", row, isl, h, 0, None, 0, 0, 0)
        index.insert(h, row, 0, 10**12)
    return ledger, index


def per_call_us(fn, reps: int) -> float:
    """Median over 50 short batches (about `reps` calls in all, at least 1 call per batch), in µs
    per call. Short batches (≲ 1 ms) keep a batch from spanning the scheduler's preemptions on a
    shared machine: a few long batches timed by the wall clock counted the time other processes
    ran, and more so the slower the call, which looked like a regression growing with the number
    of active sequences."""
    per_batch = max(1, reps // 50)
    fn()
    samples = []
    for _ in range(50 if reps > 1 else 3):
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn()
        samples.append((time.perf_counter() - t0) / per_batch * 1e6)
    return float(np.median(samples))


def bench_case(n_workers: int, n_active: int, quick: bool) -> dict:
    rng = np.random.default_rng(n_workers * 7919 + n_active)
    t0 = time.perf_counter()
    ledger, index = populate(n_workers, n_active, rng)
    populate_s = time.perf_counter() - t0
    a = ledger.arrays
    q = np.concatenate(
        [
            np.arange(3000, 3000 + PREFIX_BLOCKS, dtype=np.uint64),
            np.arange(5 * 10**9, 5 * 10**9 + QUERY_HASHES - PREFIX_BLOCKS, dtype=np.uint64),
        ]
    )
    isl = QUERY_HASHES * BLOCK
    eligible = np.ones(n_workers, np.uint8)
    overlap = np.zeros(n_workers, np.int32)
    outs = {
        name: (np.zeros(n_workers, np.int64), np.zeros(n_workers, np.int64), np.zeros(n_workers, np.float64))
        for name in ("numba", "numpy", "python")
    }
    impls = {
        "numba": kernels.project_and_cost,
        "numpy": numpy_twin.project_and_cost,
        "python": reference.project_and_cost,
    }
    scratch = np.zeros(index.words, np.uint64)
    depth_impls = {"numba": overlap_depth, "numpy": numpy_twin.overlap_depth, "python": reference.overlap_depth}
    depth_out = {name: np.zeros(n_workers, np.int32) for name in depth_impls}
    reps = {"numba": 2000, "numpy": 50, "python": max(1, 2000 // n_workers)}
    if quick:
        reps = {k: max(1, v // 10) for k, v in reps.items()}
    res: dict = {
        "workers": n_workers,
        "active": n_active,
        "populate_s": round(populate_s, 2),
        "ref_capacity": a.ref_capacity,
    }
    for name, fn in impls.items():
        ob, op, oc = outs[name]
        res[f"project_{name}_us"] = per_call_us(
            partial(
                fn,
                a.w_active_blocks,
                a.w_active_prefill,
                eligible,
                a.ref_keys,
                a.ref_counts,
                q,
                isl,
                BLOCK,
                overlap,
                1.0,
                1.0,
                ob,
                op,
                oc,
            ),
            reps[name],
        )
    for name, fn in depth_impls.items():
        res[f"depth_{name}_us"] = per_call_us(
            partial(fn, index.keys, index.used, index.perm, index.ttlm, index.ttl_exp, q, 1, scratch, depth_out[name]),
            reps[name],
        )
    for name in ("numpy", "python"):  # same answers, same run
        assert np.array_equal(outs[name][0], outs["numba"][0]) and np.array_equal(depth_out[name], depth_out["numba"])
    res["ledger_project_us"] = per_call_us(lambda: ledger.project(q, isl, overlap, eligible, 1.0, 1.0), reps["numba"])
    res["mean_depth_blocks"] = float(depth_out["numba"].mean())
    return res


_COMPILE_CHILD = (
    "import time; t=time.perf_counter(); from kvsched.shm.warm import warm_kernels; warm_kernels(); "
    "print(time.perf_counter()-t)"
)


def compile_times() -> dict:
    """Seconds for import + warm_kernels() with an empty cache dir, then with that cache warm."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}

        def run():
            return float(
                subprocess.run(
                    [sys.executable, "-c", _COMPILE_CHILD], env=env, capture_output=True, text=True, check=True
                ).stdout
            )

        cold = run()
        cached = run()
    return {"cold_compile_s": round(cold, 2), "cached_load_s": round(cached, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10x fewer repetitions and no 10^5 case")
    parser.add_argument("--out", default=str(ROOT / "out" / "bench" / "kernels.json"))
    args = parser.parse_args()
    warm_kernels()
    rows = []
    actives = (1000, 10_000) if args.quick else (1000, 10_000, 100_000)
    hdr = (
        f"{'workers':>7} {'active':>7} | {'project µs: numba':>17} "
        f"{'numpy':>9} {'python':>10} {'np/nb':>7} {'py/nb':>8} "
        f"| {'depth µs: numba':>15} {'numpy':>8} {'python':>9} {'np/nb':>6} {'py/nb':>7} | {'Ledger.project':>14}"
    )
    print(hdr)
    print("-" * len(hdr))
    for w in (8, 64, 512):
        for n in actives:
            r = bench_case(w, n, args.quick)
            r["project_numpy_ratio"] = r["project_numpy_us"] / r["project_numba_us"]
            r["project_python_ratio"] = r["project_python_us"] / r["project_numba_us"]
            r["depth_numpy_ratio"] = r["depth_numpy_us"] / r["depth_numba_us"]
            r["depth_python_ratio"] = r["depth_python_us"] / r["depth_numba_us"]
            rows.append(r)
            print(
                f"{w:>7} {n:>7} | {r['project_numba_us']:>17.2f} {r['project_numpy_us']:>9.1f} "
                f"{r['project_python_us']:>10.0f} {r['project_numpy_ratio']:>7.0f} "
                f"{r['project_python_ratio']:>8.0f} | "
                f"{r['depth_numba_us']:>15.2f} {r['depth_numpy_us']:>8.1f} {r['depth_python_us']:>9.0f} "
                f"{r['depth_numpy_ratio']:>6.0f} {r['depth_python_ratio']:>7.0f} "
                f"| {r['ledger_project_us']:>14.2f}",
                flush=True,
            )
    comp = compile_times()
    print(f"numba import + warm_kernels(): cold compile {comp['cold_compile_s']} s, cached {comp['cached_load_s']} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "block_size": BLOCK,
        "query_hashes": QUERY_HASHES,
        "stride": STRIDE,
        "python": sys.version.split()[0],
        "numpy": np.__version__,
    }
    out.write_text(json.dumps({"meta": meta, "cases": rows, "compile": comp}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
