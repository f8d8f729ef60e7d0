"""In-process core cost per request lifecycle: the scheduler alone, no sockets, no frames.

One lifecycle = `enqueue` (immediate admission: project → select → reserve), `update(dispatched)`,
`update(prefill_done)`, `release(completed)` and one `drain_cleanup`, the same calls the daemon's
actor makes for a remote router's request. Fleet and requests as in `bench_transport.py`: 8 workers,
prompts of 1024 tokens = 64 block hashes (a 16-block prefix shared by one of 32 "system prompts" +
48 unique blocks), 4096 distinct requests cycled, the default `kv` selector, `window` leases in
flight (the release of request i - window follows the admission of request i).

Figures: CPU µs per lifecycle (thread CPU time, best of `--repeats` runs; the machine is shared, so
the best run is the least disturbed one) and wall µs. With `--baseline REV` the same script also
runs against the `kvsched/` package of git revision REV (exported to a temporary directory, run in
a subprocess) and prints both figures and their ratio from the same run. `--profile` prints the
top functions of a cProfile run (own time).

Usage: python bench/bench_core.py [--baseline main] [--profile] [--quick]  ->  out/bench/core.json
(`bench/run_all.py` runs it as its `core` step; docs/BENCHMARKS.md §4b shows the figures.)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if os.environ.get("KVSCHED_BENCH_CORE_SRC") is None:
    sys.path.insert(0, str(ROOT))

import numpy as np

WORKERS = 8
N_HASHES = 64
BLOCK = 16
ISL = N_HASHES * BLOCK
PREFIX_BLOCKS = 16
N_PREFIXES = 32
N_SEQUENCES = 4096
GOAL_US = 15.0  # docs/BENCHMARKS.md: in-process core <= 15 µs per lifecycle at 8 workers, 64 hashes


def make_config(overlap_events: bool = False):
    """The daemon's default profile with 8 workers (as `bench_transport.py` configures them)."""
    from kvsched.config import config_from_dict

    raw = {
        "daemon": {"block_size": BLOCK, "max_workers": WORKERS, "max_slots": 16384, "max_blocks_per_request": N_HASHES},
        "selector": {"seed": 0},
        "workers": [
            {"worker_id": w, "total_kv_blocks": 1_000_000, "max_num_batched_tokens": 100_000_000}
            for w in range(WORKERS)
        ],
    }
    return config_from_dict(raw)


def make_hashes(rng: np.random.Generator) -> list[np.ndarray]:
    """`N_SEQUENCES` read-only uint64[64] arrays, decoded from bytes as the actor decodes a frame's."""
    out = []
    for i in range(N_SEQUENCES):
        g = int(rng.integers(N_PREFIXES))
        prefix = np.arange(g * 1000 + 1, g * 1000 + 1 + PREFIX_BLOCKS, dtype="<u8")
        suffix = np.arange(10**9 + i * N_HASHES, 10**9 + i * N_HASHES + N_HASHES - PREFIX_BLOCKS, dtype="<u8")
        out.append(np.frombuffer(np.concatenate([prefix, suffix]).tobytes(), dtype="<u8"))
    return out


def build(overlap_mode: str):
    """The scheduler under test, built the way the simulator builds it."""
    from kvsched.sim.virtual import make_inprocess_scheduler

    return make_inprocess_scheduler(make_config(), overlap_mode=overlap_mode)


def run_lifecycles(sched, hashes: list[np.ndarray], n: int, window: int, start: int, clock: list[int]) -> int:
    """`n` lifecycles; returns how many were admitted at once (all of them, on this fleet)."""
    from kvsched.core.types import Admit, RequestSpec

    held: list = []
    admitted = 0
    t = clock[0]
    for i in range(start, start + n):
        t += 50
        spec = RequestSpec(request_id=f"r{i}", isl_tokens=ISL, block_hashes=hashes[i % N_SEQUENCES], owner=1)
        out = sched.enqueue(spec, t)
        a = out[0]
        assert type(a) is Admit, a
        admitted += 1
        sched.update(a.request_id, a.slot, a.generation, "dispatched", None, t)
        sched.update(a.request_id, a.slot, a.generation, "prefill_done", None, t)
        held.append(a)
        if len(held) > window - 1:
            old = held.pop(0)
            sched.release(old.request_id, old.slot, old.generation, "completed", ISL + 1, t)
        sched.drain_cleanup(t)
    for old in held:
        sched.release(old.request_id, old.slot, old.generation, "completed", ISL + 1, t)
    sched.drain_cleanup(t)
    clock[0] = t
    return admitted


def measure(overlap_mode: str, window: int, n: int, repeats: int, warm: int = 2000) -> dict:
    """Best-of-`repeats` CPU and wall µs per lifecycle for one configuration (after `warm` lifecycles)."""
    rng = np.random.default_rng(0)
    hashes = make_hashes(rng)
    sched = build(overlap_mode)
    clock = [1_000_000]
    run_lifecycles(sched, hashes, warm, window, 0, clock)  # warm: kernels loaded, index populated
    cpu, wall = [], []
    start = warm
    for _ in range(repeats):
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        run_lifecycles(sched, hashes, n, window, start, clock)
        cpu.append((time.thread_time_ns() - c0) / n / 1000)
        wall.append((time.perf_counter_ns() - w0) / n / 1000)
        start += n
    assert sched.active_leases == 0
    return {
        "overlap_mode": overlap_mode,
        "window": window,
        "lifecycles": n,
        "repeats": repeats,
        "cpu_us_per_lifecycle": round(min(cpu), 2),
        "cpu_us_median": round(sorted(cpu)[len(cpu) // 2], 2),
        "wall_us_per_lifecycle": round(min(wall), 2),
    }


def profile(overlap_mode: str, window: int, n: int, top: int = 25, warm: int = 2000) -> str:
    """cProfile of `n` lifecycles (after `warm`): the top functions by own time."""
    rng = np.random.default_rng(0)
    hashes = make_hashes(rng)
    sched = build(overlap_mode)
    clock = [1_000_000]
    run_lifecycles(sched, hashes, warm, window, 0, clock)
    prof = cProfile.Profile()
    prof.enable()
    run_lifecycles(sched, hashes, n, window, warm, clock)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


CELLS = [("approx", 8), ("approx", 1), ("events", 8)]


def calibrate() -> float:
    """CPU ms of a 1e6-iteration pure-Python loop (best of 3): how fast this machine runs Python now."""
    best = float("inf")
    for _ in range(3):
        t0, s = time.thread_time_ns(), 0
        for i in range(1_000_000):
            s += i
        best = min(best, (time.thread_time_ns() - t0) / 1e6)
    return best


def _best(a: dict, b: dict) -> dict:
    return a if a["cpu_us_per_lifecycle"] <= b["cpu_us_per_lifecycle"] else b


def run_all(n: int, repeats: int, warm: int = 2000) -> list[dict]:
    return [measure(mode, window, n, repeats, warm) for mode, window in CELLS]


def export_revision(rev: str, into: str) -> str:
    """Export the `kvsched/` package of git revision `rev` into directory `into`; returns its short hash."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True, text=True
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "kvsched"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return commit


def run_baseline(src: str, n: int, repeats: int, warm: int = 2000) -> list[dict]:
    """This script's figures for the `kvsched/` package exported into `src` (a subprocess; the
    exported tree's numba cache lives beside it, so only the first round of a run compiles)."""
    env = dict(os.environ, PYTHONPATH=src, KVSCHED_BENCH_CORE_SRC=src, NUMBA_CACHE_DIR=str(Path(src) / ".numba-cache"))
    out = subprocess.run(
        [sys.executable, __file__, "--inner", "--n", str(n), "--repeats", str(repeats), "--warm", str(warm)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=src,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", metavar="REV", help="also measure the kvsched package of this git revision")
    ap.add_argument("--profile", action="store_true", help="print the top functions of a cProfile run")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1,000 lifecycles x 2 repeats x 1 round after 500 warm-up (figures not comparable)",
    )
    ap.add_argument("--n", type=int, default=None, help="lifecycles per repeat (default 10,000; --quick 1,000)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats per round, best kept (default 5; --quick 2)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="alternating baseline / this-tree rounds, best kept (default 2; --quick 1)",
    )
    ap.add_argument("--warm", type=int, default=None, help="warm-up lifecycles per cell (default 2,000; --quick 500)")
    ap.add_argument("--out", type=Path, default=None, help="JSON output (default out/bench/[quick/]core.json)")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    n = args.n or (1000 if args.quick else 10000)
    repeats = args.repeats or (2 if args.quick else 5)
    rounds = args.rounds or (1 if args.quick else 2)
    warm = args.warm if args.warm is not None else (500 if args.quick else 2000)
    if args.inner:  # the baseline subprocess: one JSON line on stdout
        print(json.dumps(run_all(n, repeats, warm)))
        return
    base, base_rev, rows = None, None, None
    with tempfile.TemporaryDirectory(prefix="kvsched-core-base-") as src:
        if args.baseline:
            base_rev = export_revision(args.baseline, src)
        for _ in range(rounds):  # alternate baseline and this tree: load changes hit both alike
            if args.baseline:
                got = run_baseline(src, n, repeats, warm)
                base = got if base is None else [_best(a, b) for a, b in zip(base, got, strict=True)]
            got = run_all(n, repeats, warm)
            rows = got if rows is None else [_best(a, b) for a, b in zip(rows, got, strict=True)]
    calib = calibrate()
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"in-process core, {WORKERS} workers, {N_HASHES} hashes/request, kv selector; CPU µs per lifecycle "
        f"(best of {rounds} x {repeats} x {n}); goal <= {GOAL_US:g} µs"
    )
    print(
        f"machine speed: a 1e6-iteration Python `s += i` loop takes {calib:.0f} ms of CPU here (~30-40 ms on an "
        f"unloaded current x86 core); figures scale with it"
    )
    print(
        f"{'overlap':<8} {'window':>6} | {'this tree':>10} {'wall':>8}"
        + (f" | {base_rev:>10} {'ratio':>6}" if base else "")
    )
    for i, r in enumerate(rows):
        line = (
            f"{r['overlap_mode']:<8} {r['window']:>6} | "
            f"{r['cpu_us_per_lifecycle']:>10.2f} {r['wall_us_per_lifecycle']:>8.2f}"
        )
        if base:
            b = base[i]
            line += (
                f" | {b['cpu_us_per_lifecycle']:>10.2f} {b['cpu_us_per_lifecycle'] / r['cpu_us_per_lifecycle']:>5.2f}x"
            )
        print(line)
    result = {
        "workers": WORKERS,
        "hashes": N_HASHES,
        "selector": "kv",
        "goal_us": GOAL_US,
        "revision": head,
        "mode": "quick" if args.quick else "full",
        "lifecycles": n,
        "repeats": repeats,
        "rounds": rounds,
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "python_loop_ms_per_1e6": round(calib, 1),
        "rows": rows,
        "baseline_revision": base_rev,
        "baseline_rows": base,
        "meets_goal": rows[0]["cpu_us_per_lifecycle"] <= GOAL_US,
    }
    if args.profile:
        text = profile("approx", 8, n, warm=warm)
        print(text)
        result["profile_top"] = text
    out = args.out or ROOT / "out" / "bench" / ("quick" if args.quick else "") / "core.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
