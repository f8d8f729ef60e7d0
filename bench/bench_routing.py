"""Routing quality: kvsched's KV-aware selection vs the baselines users would pick, in virtual time.

Every policy runs through the same virtual-time driver (`kvsched.sim.virtual.run_virtual`): same
engine model, same scheduler core and kernels, same arrivals, same seed; only `selector.type` (and,
where stated, the overlap source) changes. Policies:

* `kv` — kvsched's defaults: SPEC §4 cost, overlap from the engines' KV events (+ speculative entries);
* `kv (approx)` — the same selector with the approximate index only (no KV events), an ablation;
* `round_robin`, `random`, `least_loaded` (fewest active requests), `power_of_two`;
* `cache_aware` — SGLang-router style (`CacheAwareSelector`, its published defaults) over the
  approximate index learnt from routing decisions, which is what that router has (its own tree of
  routed prefixes); `cache_aware (events)` gives it kvsched's KV-event overlap instead.

Figures per (workers, load level, policy): prefix-hit ratio (cached prompt tokens / prompt tokens,
what the engines actually served from cache), TTFT p50/p99 (simulated ms), throughput (completed
requests and output tokens per simulated second), worker imbalance (max / mean requests per worker),
plus the infinite-cache hit ratio (tokens) of the same requests as the bound. Load levels multiply
the trace's arrival rate (`--load-scale`) by level × workers / 4, so each fleet size sees the same
per-worker load. One wall-clock run through the real daemon, simulated fleet and router processes
(`kvsched replay`'s machinery) cross-checks the virtual-time figures of the default policy.

Usage: python bench/bench_routing.py [--quick] [--trace PATH]  ->  table, out/bench/routing.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATA = ROOT / "bench" / "data"  # bundled traces, attribution in bench/data/SOURCES.md
FULL_TRACE = DATA / "conversation_trace.jsonl"
SLICE = ROOT / "kvsched" / "data" / "mooncake_slice.jsonl"
# (label, selector type, overlap mode of the virtual driver)
POLICIES = [
    ("kv", "kv", "events"),
    ("kv (approx)", "kv", "approx"),
    ("round_robin", "round_robin", "events"),
    ("random", "random", "events"),
    ("least_loaded", "least_loaded", "events"),
    ("power_of_two", "power_of_two", "events"),
    ("cache_aware", "cache_aware", "approx"),
    ("cache_aware (events)", "cache_aware", "events"),
]
LEVELS = (0.5, 1.0, 1.25)  # arrival-rate multiplier per 4 workers
WORKERS = (4, 16)
SEED = 0


def figures(results, trace, workers: int, wall_s: float) -> dict:
    """The per-run figures from `RequestResult`s (module docstring)."""
    import numpy as np

    from kvsched.sim.summary import COMPLETED

    done = [r for r in results if r.outcome == COMPLETED]
    isl_done = sum(r.isl for r in done) or 1
    ttft = np.array([r.ttft_us / 1000.0 for r in done if r.ttft_us >= 0]) if done else np.zeros(1)
    ends = [r.arrival_us + r.e2e_us for r in done]
    sim_s = (max(ends) - min(r.arrival_us for r in results)) / 1e6 if ends else 0.0
    per_worker = np.zeros(workers)
    for r in done:
        per_worker[int(r.worker.split(":")[0])] += 1
    return {
        "requests": len(results),
        "completed": len(done),
        "not_completed": len(results) - len(done),
        "prefix_hit_ratio": round(sum(r.cached_tokens for r in done) / isl_done, 4),
        "predicted_hit_ratio": round(sum(r.predicted_cached_tokens for r in done) / isl_done, 4),
        "infinite_cache_hit_ratio": round(trace.infinite_cache_hit_tokens() / int(trace.isl.sum()), 4),
        "ttft_ms_p50": round(float(np.percentile(ttft, 50)), 1),
        "ttft_ms_p99": round(float(np.percentile(ttft, 99)), 1),
        "simulated_s": round(sim_s, 1),
        "throughput_req_s": round(len(done) / sim_s, 3) if sim_s else 0.0,
        "throughput_out_tok_s": round(sum(r.output_tokens for r in done) / sim_s, 1) if sim_s else 0.0,
        "imbalance_max_over_mean": round(float(per_worker.max() / per_worker.mean()), 3) if per_worker.mean() else None,
        "wall_s": round(wall_s, 2),
    }


def one_virtual(job: tuple) -> dict:
    """One (trace, workers, level, policy) virtual-time run; executed in a pool worker."""
    trace_path, workers, level, label, selector, overlap_mode = job
    from kvsched.sim.fleet_spec import build_config
    from kvsched.sim.replay import ReplayOptions, fleet_spec_for
    from kvsched.sim.trace import load_trace
    from kvsched.sim.virtual import run_virtual

    trace = load_trace(trace_path)
    spec = fleet_spec_for(ReplayOptions(trace=Path(trace_path), workers=workers), trace)
    load_scale = level * workers / 4
    run = run_virtual(trace, spec, config=build_config(spec, selector, SEED), load_scale=load_scale, seed=SEED,
                      overlap_mode=overlap_mode)
    return {"workers": workers, "level": level, "load_scale": load_scale, "policy": label, "selector": selector,
            "overlap_mode": overlap_mode, **figures(run.results, trace, workers, run.wall_time_s)}


def wall_crosscheck(trace_path: str, workers: int, speedup: float, routers: int, limit: int | None) -> dict:
    """The default policy through the real daemon (wall clock) and in virtual time, same requests."""
    from kvsched.sim.replay import ReplayOptions, run_replay
    from kvsched.sim.summary import read_results
    from kvsched.sim.trace import load_trace

    out = ROOT / "out" / "bench" / "routing-wall"
    opts = ReplayOptions(trace=Path(trace_path), routers=routers, workers=workers, speedup=speedup, limit=limit,
                         out=out, selector="kv", seed=SEED)
    t0 = time.perf_counter()
    summary = run_replay(opts)
    wall_s = time.perf_counter() - t0
    trace = load_trace(trace_path, limit)
    wall = figures(read_results(out / "results.jsonl"), trace, workers, wall_s)
    wall.update(admission_latency_us_p50=summary.admission_latency_us_p50,
                admission_latency_us_p99=summary.admission_latency_us_p99, ledger_zero=summary.ledger_zero,
                rejected=summary.rejected, aborted=summary.aborted)
    vopts = ReplayOptions(trace=Path(trace_path), workers=workers, limit=limit, virtual=True,
                          out=ROOT / "out" / "bench" / "routing-virtual", selector="kv", seed=SEED)
    vs = run_replay(vopts)
    virt = figures(read_results(vopts.out / "results.jsonl"), trace, workers, vs.wall_time_s)
    return {"workers": workers, "routers": routers, "speedup": speedup, "requests": len(trace), "wall": wall,
            "virtual": virt}


def print_table(rows: list[dict]) -> None:
    hdr = (f"{'W':>3} {'level':>5} {'policy':<22} {'hit':>6} {'bound':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
           f"{'req/s':>7} {'tok/s':>8} {'imbal':>6}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['workers']:>3} {r['level']:>5} {r['policy']:<22} {r['prefix_hit_ratio']:>6.3f} "
              f"{r['infinite_cache_hit_ratio']:>6.3f} {r['ttft_ms_p50']:>9,.0f} {r['ttft_ms_p99']:>9,.0f} "
              f"{r['throughput_req_s']:>7.2f} {r['throughput_out_tok_s']:>8,.0f} {r['imbalance_max_over_mean']:>6.2f}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="The bundled 1,500-request slice and a short wall run.")
    ap.add_argument("--trace", default=None, help="Mooncake trace (default: the full conversation trace if "
                    "present, else the bundled slice; --quick: the slice).")
    ap.add_argument("--jobs", type=int, default=2, help="Virtual runs in parallel (processes).")
    ap.add_argument("--no-wall", action="store_true", help="Skip the wall-clock cross-check.")
    ap.add_argument("--out", default=str(ROOT / "out" / "bench" / "routing.json"))
    args = ap.parse_args()
    trace_path = args.trace or str(SLICE if args.quick or not FULL_TRACE.exists() else FULL_TRACE)
    jobs = [(trace_path, w, lv, label, sel, mode) for w in WORKERS for lv in LEVELS for label, sel, mode in POLICIES]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(max(1, args.jobs)) as pool:
        rows = pool.map(one_virtual, jobs, chunksize=1)
    virtual_s = time.perf_counter() - t0
    print_table(rows)
    print(f"{len(rows)} virtual runs in {virtual_s:.0f} s")
    wall = None
    if not args.no_wall:
        if args.quick:
            wall = wall_crosscheck(str(SLICE), 4, 20.0, 4, None)
        else:
            wall = wall_crosscheck(trace_path, 4, 100.0, 4, None)
        w, v = wall["wall"], wall["virtual"]
        print(f"cross-check (kv, 4 workers, {wall['requests']} requests, {wall['speedup']:g}x): "
              f"hit {w['prefix_hit_ratio']:.3f} wall vs {v['prefix_hit_ratio']:.3f} virtual; "
              f"TTFT p50 {w['ttft_ms_p50']:,.0f} vs {v['ttft_ms_p50']:,.0f} ms; "
              f"p99 {w['ttft_ms_p99']:,.0f} vs {v['ttft_ms_p99']:,.0f} ms; "
              f"imbalance {w['imbalance_max_over_mean']} vs {v['imbalance_max_over_mean']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"trace": trace_path, "levels": LEVELS, "workers": WORKERS, "seed": SEED, "quick": args.quick,
            "load_scale_rule": "level * workers / 4", "virtual_runs_s": round(virtual_s, 1),
            "loadavg": os.getloadavg()}
    out.write_text(json.dumps({"meta": meta, "rows": rows, "wall_crosscheck": wall}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
