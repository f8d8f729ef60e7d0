"""Routing quality: kvsched's default `kv` selector against the routers users would pick, in virtual time.

Every policy runs through the same virtual-time driver (`kvsched.sim.virtual.run_virtual`): same
engine model, scheduler core and kernels, same requests and arrivals; only `selector.type` (and,
where stated, the overlap source) changes. Policies (docs/ROUTING.md describes each):

* `kv` — kvsched's default cost; overlap from the engines' KV events (+ speculative entries);
* `dynamo_cost` — NVIDIA Dynamo's kv-router cost with its defaults (kvsched's former default);
* `cache_aware` — SGLang-router style over the approximate index learnt from its own decisions (what
  that router has); `cache_aware (events)` gives it kvsched's KV-event overlap instead;
* `lmetric`, `llmd` (prefix 3 / queue 2 / KV-utilisation 2), `llmd_sticky` (affinity until the
  worker's uncached in-flight prefill passes 35 x max_num_batched_tokens);
* `round_robin`, `random`, `least_loaded`, `power_of_two`.

Workloads: `conversation` = the Mooncake conversation trace (bench/data/), grid {4, 8, 16 workers} x
load levels {0.5, 1.0, 1.25}, one run per seed; a seed varies the selectors' tie-breaks and draws a
random 90 % of the conversations (whole conversations kept, `workloads.subsample_conversations`).
`synthetic` = `workloads.synthetic_trace` (shared system prompts, chat sessions, agent tool loops);
`azure` = the Azure conversation trace's arrivals and lengths with synthesised shared prefixes. Load
level L replays the arrivals `L x workers / 4` times faster, so each fleet size sees the same load per
worker.

Figures per run: prefix-hit ratio (tokens the engines served from cache / prompt tokens), the fleet-LRU
reference (one LRU cache of the fleet's total blocks seeing every request) and the infinite-cache
bound, TTFT p50/p99, mean inter-token latency (TPOT), queue-wait p99 (in the scheduler), requests not
completed (rejected or shed), imbalance (max / mean requests per worker), and overlap given up (the
deepest overlap available at each decision minus the chosen worker's, summed, over the available sum).
Rows aggregate the seeds: mean, and min–max as the spread.

Usage: python bench/bench_routing.py [--quick] [--seeds N] [--workloads conversation,synthetic,azure]
       -> tables, out/bench/routing.json
       python bench/bench_routing.py --policies kv --no-wall --out out/bench/routing-kv.json   # one policy changed
       python bench/bench_routing.py --merge earlier.json out/bench/routing-kv.json            # -> routing.json
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
sys.path.insert(0, str(ROOT / "bench"))

DATA = ROOT / "bench" / "data"  # bundled traces, attribution in bench/data/SOURCES.md
FULL_TRACE = DATA / "conversation_trace.jsonl"
AZURE_TRACE = DATA / "AzureLLMInferenceTrace_conv.csv"
SLICE = ROOT / "kvsched" / "data" / "mooncake_slice.jsonl"
# (label, selector type, overlap mode of the virtual driver)
POLICIES = [
    ("kv", "kv", "events"),
    ("dynamo_cost", "dynamo_cost", "events"),
    ("cache_aware", "cache_aware", "approx"),
    ("cache_aware (events)", "cache_aware", "events"),
    ("lmetric", "lmetric", "events"),
    ("llmd", "llmd", "events"),
    ("llmd_sticky", "llmd_sticky", "events"),
    ("round_robin", "round_robin", "events"),
    ("random", "random", "events"),
    ("least_loaded", "least_loaded", "events"),
    ("power_of_two", "power_of_two", "events"),
]
LEVELS = (0.5, 1.0, 1.25)  # arrival-rate multiplier per 4 workers
WORKERS = (4, 8, 16)
OTHER_WORKERS = (4, 16)  # synthetic and azure workloads: one level each (OTHER_LEVEL)
# The Azure conv trace (5.5 req/s, 1.2k-token prompts) barely loads 4 simulated H100s at its own rate;
# replayed 6x faster per 4 workers it queues. The synthetic workload is generated at its own rate (level 1).
OTHER_LEVEL = {"synthetic": 1.0, "azure": 6.0}
METRICS = (
    "prefix_hit_ratio",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_mean",
    "queue_wait_ms_p99",
    "not_completed_share",
    "imbalance_max_over_mean",
    "overlap_given_up_share",
    "throughput_req_s",
)


def load_workload(name: str, seed: int, quick: bool):
    """The `Trace` of workload `name` for `seed` (module docstring)."""
    from workloads import SyntheticParams, azure_with_prefixes, subsample_conversations, synthetic_trace

    from kvsched.sim.trace import load_trace

    if name == "conversation":
        return subsample_conversations(load_trace(SLICE if quick or not FULL_TRACE.exists() else FULL_TRACE), seed)
    if name == "synthetic":
        return synthetic_trace(SyntheticParams(sessions=150 if quick else 600), seed)
    if name == "azure":
        return azure_with_prefixes(load_trace(AZURE_TRACE, 2000 if quick else None), seed)
    raise ValueError(f"unknown workload {name!r}")


def figures(results, trace, workers: int, blocks_per_worker: int, wall_s: float) -> dict:
    """The per-run figures from `RequestResult`s (module docstring)."""
    import numpy as np

    from kvsched.sim.summary import COMPLETED

    done = [r for r in results if r.outcome == COMPLETED]
    isl_done = sum(r.isl for r in done) or 1
    isl_all = int(trace.isl.sum()) or 1
    ttft = np.array([r.ttft_us / 1000.0 for r in done if r.ttft_us >= 0]) if done else np.zeros(1)
    itl = [
        (r.e2e_us - r.ttft_us) / 1000.0 / (r.output_tokens - 1) for r in done if r.output_tokens > 1 and r.ttft_us >= 0
    ]
    wait = (
        np.array([max(0, r.queue_wait_us) / 1000.0 for r in results if r.queue_wait_us >= 0])
        if results
        else np.zeros(1)
    )
    ends = [r.arrival_us + r.e2e_us for r in done]
    sim_s = (max(ends) - min(r.arrival_us for r in results)) / 1e6 if ends else 0.0
    per_worker = np.zeros(workers)
    for r in done:
        per_worker[int(r.worker.split(":")[0])] += 1
    avail = sum(r.best_overlap_blocks for r in results if r.worker)
    given_up = sum(max(0, r.best_overlap_blocks - r.overlap_blocks) for r in results if r.worker)
    return {
        "requests": len(results),
        "completed": len(done),
        "not_completed": len(results) - len(done),
        "not_completed_share": round((len(results) - len(done)) / max(1, len(results)), 4),
        "prefix_hit_ratio": round(sum(r.cached_tokens for r in done) / isl_done, 4),
        "predicted_hit_ratio": round(sum(r.predicted_cached_tokens for r in done) / isl_done, 4),
        "infinite_cache_hit_ratio": round(trace.infinite_cache_hit_tokens() / isl_all, 4),
        "fleet_lru_hit_ratio": round(trace.fleet_lru_hit_tokens(workers * blocks_per_worker) / isl_all, 4),
        "ttft_ms_p50": round(float(np.percentile(ttft, 50)), 1),
        "ttft_ms_p99": round(float(np.percentile(ttft, 99)), 1),
        "tpot_ms_mean": round(float(np.mean(itl)), 2) if itl else None,
        "queue_wait_ms_p99": round(float(np.percentile(wait, 99)), 1) if wait.size else 0.0,
        "overlap_given_up_share": round(given_up / avail, 4) if avail else 0.0,
        "simulated_s": round(sim_s, 1),
        "throughput_req_s": round(len(done) / sim_s, 3) if sim_s else 0.0,
        "throughput_out_tok_s": round(sum(r.output_tokens for r in done) / sim_s, 1) if sim_s else 0.0,
        "imbalance_max_over_mean": round(float(per_worker.max() / per_worker.mean()), 3) if per_worker.mean() else None,
        "wall_s": round(wall_s, 2),
    }


def one_virtual(job: tuple) -> dict:
    """One (workload, workers, level, seed, policy) virtual-time run; executed in a pool worker."""
    workload, quick, workers, level, seed, label, selector, overlap_mode, *rest = job
    overrides = rest[0] if rest else {}
    import msgspec

    from kvsched.sim.fleet_spec import FleetSpec, build_config
    from kvsched.sim.virtual import run_virtual

    trace = load_workload(workload, seed, quick)
    longest = int((trace.hash_offsets[1:] - trace.hash_offsets[:-1]).max()) if len(trace) else 1
    spec = FleetSpec(workers=workers, block_size=trace.block_size, max_blocks_per_request=max(1024, longest))
    load_scale = level * workers / 4
    t0 = time.perf_counter()
    cfg = build_config(spec, selector, seed)
    if overrides:
        cfg = msgspec.structs.replace(cfg, selector=msgspec.structs.replace(cfg.selector, **overrides))
    run = run_virtual(trace, spec, config=cfg, load_scale=load_scale, seed=seed, overlap_mode=overlap_mode)
    return {
        "workload": workload,
        "workers": workers,
        "level": level,
        "seed": seed,
        "load_scale": load_scale,
        "policy": label,
        "selector": selector,
        "overlap_mode": overlap_mode,
        "selector_overrides": overrides,
        **figures(run.results, trace, workers, spec.blocks_per_engine, time.perf_counter() - t0),
    }


WALL_POLICIES = (
    ("kv", "kv", "daemon"),
    ("dynamo", "kv", "dynamo"),
    ("dynamo_cost", "dynamo_cost", "daemon"),
    ("cache_aware", "cache_aware", "daemon"),
)  # (label, daemon selector, who routes)
# Simulated seconds per wall second. At 10x on 2 loaded cores Dynamo's HTTP service fell behind at 16
# workers (p50 admission 19 s wall, half the requests timed out); at 2x it keeps up (docs/BENCHMARKS.md §5).
WALL_SPEEDUP = 2.0
WALL_LIMIT = {4: 450, 16: 2000}  # first N requests of the conversation trace (~2 wall minutes per run)
OVERLAP_SAMPLE_EVERY = 10  # kv run: the daemon's vs Dynamo's overlap on every 10th request


def wall_figures(results, trace, workers: int, blocks: int, wall_s: float, speedup: float) -> dict:
    """`figures` plus TTFT with the admission transport latency subtracted: a wall-clock replay
    multiplies each request's admission latency (HTTP for Dynamo, ZeroMQ for the daemon; both on
    shared cores) by the speedup into simulated time, which says nothing about routing. The time a
    request waited in the daemon's queue (`queued_us`, wall) is part of its admission latency but is
    scheduling, so it stays in the TTFT: subtracted = (admission latency - queued) x speedup."""
    import numpy as np

    from kvsched.sim.summary import COMPLETED

    f = figures(results, trace, workers, blocks, wall_s)
    done = [r for r in results if r.outcome == COMPLETED and r.ttft_us >= 0]
    adm = np.array([max(0.0, r.admission_latency_us - max(0, r.queued_us)) for r in done]) if done else np.zeros(1)
    adj = (
        np.array([max(0.0, r.ttft_us - a * speedup) / 1000.0 for r, a in zip(done, adm, strict=True)])
        if done
        else np.zeros(1)
    )
    f.update(
        queued_ms_p99=round(float(np.percentile([max(0, r.queued_us) for r in done] or [0], 99)) / 1000, 1),
        admission_ms_p50=round(float(np.percentile(adm, 50)) / 1000, 2),
        admission_ms_p99=round(float(np.percentile(adm, 99)) / 1000, 2),
        ttft_adj_ms_p50=round(float(np.percentile(adj, 50)), 1),
        ttft_adj_ms_p99=round(float(np.percentile(adj, 99)), 1),
    )
    return f


def overlap_agreement(path: Path) -> dict | None:
    """Agreement of the daemon's and Dynamo's per-worker overlap on the sampled requests of a kv run
    (`overlap_samples.jsonl`): share of (request, worker) pairs equal, of requests equal on every
    worker, and of requests whose deepest-overlap worker sets agree."""
    if not path.exists():
        return None
    pairs = equal = req_equal = deepest_equal = daemon_more = 0
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for s in rows:
        d, y = s["daemon"], s["dynamo"]
        keys = sorted(set(d) | set(y))
        eq = [d.get(k, 0) == y.get(k, 0) for k in keys]
        pairs += len(keys)
        equal += sum(eq)
        daemon_more += sum(d.get(k, 0) > y.get(k, 0) for k in keys)
        req_equal += all(eq)
        md, my = max(d.values(), default=0), max(y.values(), default=0)
        deepest_equal += {k for k in keys if d.get(k, 0) == md} == {k for k in keys if y.get(k, 0) == my} and md == my
    n = len(rows) or 1
    return {
        "samples": len(rows),
        "pair_agreement": round(equal / max(1, pairs), 4),
        "request_agreement": round(req_equal / n, 4),
        "deepest_agreement": round(deepest_equal / n, 4),
        "daemon_higher_share": round(daemon_more / max(1, pairs), 4),
        "nonzero_samples": sum(1 for s in rows if max(s["dynamo"].values(), default=0) > 0),
    }


WALL_REPEATED = ("kv", "dynamo")  # run `repeats` times each, alternating which goes first; the others once
WALL_METRICS = (
    "prefix_hit_ratio",
    "overlap_given_up_share",
    "ttft_adj_ms_p50",
    "ttft_adj_ms_p99",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "admission_ms_p50",
    "admission_ms_p99",
    "queued_ms_p99",
    "tpot_ms_mean",
    "not_completed",
    "not_completed_share",
    "imbalance_max_over_mean",
    "wall_s",
)


def combine_wall(fs: list[dict]) -> dict:
    """Repeated wall-clock runs of one policy -> one record: the mean of each of `WALL_METRICS`, its
    min and max (`<metric>_min` / `_max`, the spread the verdict uses), the per-run figures under
    `each`, and the first run's other fields (notes, overlap check)."""
    out = dict(fs[0])
    for m in WALL_METRICS:
        vals = [f[m] for f in fs if f.get(m) is not None]
        if not vals:
            continue
        out[m] = round(sum(vals) / len(vals), 4)
        out[m + "_min"], out[m + "_max"] = min(vals), max(vals)
    out["repeats"] = len(fs)
    out["each"] = [{m: f.get(m) for m in WALL_METRICS} for f in fs]
    return out


def wall_crosscheck(
    workers: int,
    quick: bool,
    limit: int | None = None,
    speedup: float = WALL_SPEEDUP,
    policies: tuple[str, ...] | None = None,
    repeats: int = 1,
) -> dict:
    """Wall-clock replays (real daemon, simulated fleet process, router processes) of the same slice of
    the conversation trace routed by kv, NVIDIA Dynamo's selection service (`dynamo`, when installed),
    dynamo_cost and cache_aware; kv's overlap checked against Dynamo's first; plus kv in virtual time.
    `kv` and `dynamo` run `repeats` times (even repeats kv first, odd ones dynamo first, so a drift in
    the machine's load hits both alike); the verdict compares means with the min-max spread as the tie
    band, the rule of the virtual grid (`verdicts`)."""
    from kvsched.sim.dynamo import dynamo_unavailable_reason
    from kvsched.sim.profile import kv_blocks_for
    from kvsched.sim.replay import ReplayOptions, run_replay
    from kvsched.sim.summary import read_results
    from kvsched.sim.trace import load_trace

    trace_path = SLICE if quick or not FULL_TRACE.exists() else FULL_TRACE
    limit = limit or (150 if quick else WALL_LIMIT.get(workers, 3000))
    policies = policies or (("kv", "dynamo") if quick else None)
    routers = 4
    trace = load_trace(trace_path, limit)
    per = kv_blocks_for(trace.block_size)
    reason = dynamo_unavailable_reason()
    if reason is not None:
        print(f"dynamo baseline skipped ({workers} workers): {reason}", flush=True)
    chosen = [
        p
        for p in WALL_POLICIES
        if not (p[2] == "dynamo" and reason is not None) and not (policies and p[0] not in policies)
    ]
    each: dict[str, list[dict]] = {}
    for rep in range(max(1, repeats)):
        order = chosen if rep % 2 == 0 else sorted(chosen, key=lambda p: p[0] != "dynamo")
        for label, selector, via in order:
            if rep and label not in WALL_REPEATED:
                continue
            out = ROOT / "out" / "bench" / (f"routing-wall-{workers}-{label}" + (f"-r{rep}" if rep else ""))
            sample = OVERLAP_SAMPLE_EVERY if label == "kv" and reason is None and rep == 0 else 0
            opts = ReplayOptions(
                trace=trace_path,
                routers=routers,
                workers=workers,
                speedup=speedup,
                load_scale=workers / 4,
                limit=limit,
                out=out,
                selector=selector,
                seed=0,
                router_via=via,
                overlap_sample_every=sample,
            )
            t0 = time.perf_counter()
            summary = run_replay(opts)
            f = wall_figures(
                read_results(out / "results.jsonl"), trace, workers, per, time.perf_counter() - t0, speedup
            )
            f.update(
                ledger_zero=summary.ledger_zero, rejected=summary.rejected, aborted=summary.aborted, notes=opts.notes
            )
            if sample:
                f["overlap_check"] = overlap_agreement(out / "overlap_samples.jsonl")
            each.setdefault(label, []).append(f)
            print(
                f"wall W={workers} {label} run {rep + 1}: hit {f['prefix_hit_ratio']:.3f} gave up "
                f"{f['overlap_given_up_share']:.3f} TTFT-adm p50 {f['ttft_adj_ms_p50']:,.0f} p99 "
                f"{f['ttft_adj_ms_p99']:,.0f} ms, admission p50 {f['admission_ms_p50']:.1f} ms, not completed "
                f"{f['not_completed']} ({f['wall_s']:.0f} s)",
                flush=True,
            )
            if sample:
                print(f"  overlap daemon vs dynamo: {f['overlap_check']}", flush=True)
    runs = {label: combine_wall(fs) for label, fs in each.items()}
    vopts = ReplayOptions(
        trace=trace_path,
        workers=workers,
        virtual=True,
        load_scale=workers / 4,
        limit=limit,
        out=ROOT / "out" / "bench" / f"routing-virtual-{workers}",
        selector="kv",
        seed=0,
    )
    vs = run_replay(vopts)
    virt = figures(read_results(vopts.out / "results.jsonl"), trace, workers, per, vs.wall_time_s)
    ratios = {}
    if "dynamo" in runs:
        d = runs["dynamo"]
        for label, f in runs.items():
            ratios[label] = {
                m: (round(f[m] / d[m], 3) if d[m] else None)
                for m in ("prefix_hit_ratio", "ttft_adj_ms_p50", "ttft_adj_ms_p99")
            }
            ratios[label]["overlap_given_up_share"] = f["overlap_given_up_share"]
    rows = [
        {"workload": "wall", "workers": workers, "level": workers / 4, "policy": label, **f}
        for label, f in runs.items()
    ]
    ver = verdicts(rows, ttft=("ttft_adj_ms_p50", "ttft_adj_ms_p99"))
    return {
        "workers": workers,
        "routers": routers,
        "speedup": speedup,
        "load_scale": workers / 4,
        "limit": limit,
        "requests": len(trace),
        "repeats": max(1, repeats),
        "runs": runs,
        "wall": runs.get("kv"),
        "virtual": virt,
        "ratios_vs_dynamo": ratios,
        "verdict": ver[0] if ver else None,
        "dynamo_skipped": reason,
        "loadavg": os.getloadavg(),
    }


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per (workload, workers, level, policy): mean over seeds, plus `<metric>_min/_max`."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["workload"], r["workers"], r["level"], r["policy"]), []).append(r)
    rows = []
    for rs in groups.values():
        row = {k: v for k, v in rs[0].items() if k not in METRICS and k != "seed"}
        row["seeds"] = sorted(r["seed"] for r in rs)
        for k in ("fleet_lru_hit_ratio", "infinite_cache_hit_ratio", "requests"):
            row[k] = round(sum(r[k] for r in rs) / len(rs), 4)
        for m in METRICS:
            vals = [r[m] for r in rs if r[m] is not None]
            row[m] = round(sum(vals) / len(vals), 4) if vals else None
            row[m + "_min"], row[m + "_max"] = (min(vals), max(vals)) if vals else (None, None)
        rows.append(row)
    return rows


TIE_REL = 0.01  # with one seed (no spread): within 1 % of the best counts as a tie


def verdicts(rows: list[dict], ttft: tuple[str, str] = ("ttft_ms_p50", "ttft_ms_p99")) -> list[dict]:
    """Per (workload, workers, level): is `kv` best on hit ratio and TTFT p50 / p99 (a tie within the
    seed spread, or within 1 % with one seed, counts), TPOT within 10 % of the best baseline's,
    not-completed <= best + 0.5 %? `ttft` names the two TTFT figures (the wall-clock cross-check
    judges TTFT with the admission transport subtracted)."""
    out = []
    cells = sorted({(r["workload"], r["workers"], r["level"]) for r in rows})
    for cell in cells:
        rs = [r for r in rows if (r["workload"], r["workers"], r["level"]) == cell]
        kv = next((r for r in rs if r["policy"] == "kv"), None)
        others = [r for r in rs if r["policy"] != "kv"]
        if kv is None or not others:
            continue
        checks, missed = {}, []
        best_hit = max(others, key=lambda r: r["prefix_hit_ratio"])
        hspread = max(
            kv["prefix_hit_ratio_max"] - kv["prefix_hit_ratio_min"],
            best_hit["prefix_hit_ratio_max"] - best_hit["prefix_hit_ratio_min"],
            TIE_REL * best_hit["prefix_hit_ratio"],
        )
        checks["hit"] = kv["prefix_hit_ratio"] >= best_hit["prefix_hit_ratio"] - hspread
        for m in ttft:
            best = min(others, key=lambda r: r[m])
            spread = max(kv[m + "_max"] - kv[m + "_min"], best[m + "_max"] - best[m + "_min"], TIE_REL * best[m])
            checks[m] = kv[m] <= best[m] + spread
            if not checks[m]:
                missed.append(f"{m} {kv[m]:,.0f} vs {best['policy']} {best[m]:,.0f}")
        if not checks["hit"]:
            missed.insert(
                0, f"hit {kv['prefix_hit_ratio']:.3f} vs {best_hit['policy']} {best_hit['prefix_hit_ratio']:.3f}"
            )
        tp = [r["tpot_ms_mean"] for r in others if r["tpot_ms_mean"] is not None]
        checks["tpot"] = kv["tpot_ms_mean"] is None or not tp or kv["tpot_ms_mean"] <= 1.1 * min(tp)
        if not checks["tpot"]:
            missed.append(f"TPOT {kv['tpot_ms_mean']:.1f} vs best {min(tp):.1f} ms")
        checks["not_completed"] = kv["not_completed_share"] <= min(r["not_completed_share"] for r in others) + 0.005
        if not checks["not_completed"]:
            missed.append(f"not completed {kv['not_completed_share']:.3f}")
        out.append(
            {
                "workload": cell[0],
                "workers": cell[1],
                "level": cell[2],
                "checks": checks,
                "verdict": "met" if all(checks.values()) else "missed",
                "missed": missed,
            }
        )
    return out


def print_table(rows: list[dict]) -> None:
    hdr = (
        f"{'workload':<12} {'W':>3} {'level':>5} {'policy':<21} {'hit':>6} {'lru':>6} {'inf':>6} {'p50':>8} "
        f"{'p99':>8} {'tpot':>6} {'wait99':>8} {'lost':>5} {'imbal':>5} {'gaveup':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['workload']:<12} {r['workers']:>3} {r['level']:>5} {r['policy']:<21} {r['prefix_hit_ratio']:>6.3f} "
            f"{r['fleet_lru_hit_ratio']:>6.3f} {r['infinite_cache_hit_ratio']:>6.3f} {r['ttft_ms_p50']:>8,.0f} "
            f"{r['ttft_ms_p99']:>8,.0f} {r['tpot_ms_mean'] or 0:>6.1f} {r['queue_wait_ms_p99']:>8,.0f} "
            f"{r['not_completed_share']:>5.3f} {r['imbalance_max_over_mean'] or 0:>5.2f} "
            f"{r['overlap_given_up_share']:>6.3f}",
            flush=True,
        )


def load_runs(path: Path) -> list[dict]:
    """The per-run records of a `bench_routing.py` output: `runs` of a routing.json, or one JSON object
    per line of a .partial.jsonl."""
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)["runs"]


def merge_outputs(paths: list[Path], out: Path) -> None:
    """Aggregate the runs of several outputs (e.g. a grid of one changed policy and the baselines run
    earlier on the same code) into one routing.json: tables, verdicts, meta listing the sources."""
    merged: dict[tuple, dict] = {}
    for path in paths:
        for run in load_runs(path):
            merged[(run["workload"], run["workers"], run["level"], run["seed"], run["policy"])] = run
    runs = list(merged.values())
    order = [p[0] for p in POLICIES]
    workloads = [w for w in ("conversation", "synthetic", "azure") if any(r["workload"] == w for r in runs)]
    rows = sorted(
        aggregate(runs),
        key=lambda r: (
            workloads.index(r["workload"]),
            r["workers"],
            r["level"],
            order.index(r["policy"]) if r["policy"] in order else len(order),
        ),
    )
    print_table(rows)
    ver = verdicts(rows)
    for v in ver:
        print(f"verdict {v['workload']} W={v['workers']} level={v['level']}: {v['verdict']} {'; '.join(v['missed'])}")
    seeds = sorted({r["seed"] for r in runs})
    meta = {
        "merged_from": [str(p) for p in paths],
        "seeds": seeds,
        "workloads": workloads,
        "quick": False,
        "load_scale_rule": "level * workers / 4",
        "virtual_runs": len(runs),
        "virtual_runs_s": round(sum(r.get("wall_s", 0.0) for r in runs), 1),
        "loadavg": os.getloadavg(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"meta": meta, "rows": rows, "runs": runs, "verdicts": ver, "wall_crosscheck": None}, indent=1)
    )
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="The bundled 1,500-request slice, 1 seed, small workloads.")
    ap.add_argument("--seeds", type=int, default=3, help="Seeds per conversation-grid cell (first..first+N-1).")
    ap.add_argument("--first-seed", type=int, default=0, help="The first seed (to add seeds to an earlier run).")
    ap.add_argument("--workloads", default="conversation,synthetic,azure", help="Comma-separated subset.")
    ap.add_argument("--workers", default=",".join(map(str, WORKERS)), help="Conversation-grid fleet sizes.")
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)), help="Conversation-grid load levels.")
    ap.add_argument("--policies", default=",".join(p[0] for p in POLICIES), help="Comma-separated policy labels.")
    ap.add_argument("--jobs", type=int, default=2, help="Virtual runs in parallel (processes).")
    ap.add_argument("--no-wall", action="store_true", help="Skip the wall-clock cross-check against `dynamo`.")
    ap.add_argument("--wall-workers", default="4,16", help="Fleet sizes of the wall-clock cross-check.")
    ap.add_argument(
        "--wall-limit", type=int, default=None, help="Requests per wall-clock run (default per fleet size)."
    )
    ap.add_argument("--wall-speedup", type=float, default=WALL_SPEEDUP, help="Wall-clock replay speedup.")
    ap.add_argument("--wall-policies", default=None, help="Subset of kv,dynamo,dynamo_cost,cache_aware (default all).")
    ap.add_argument("--wall-only", action="store_true", help="Only the wall-clock cross-check (no virtual grid).")
    ap.add_argument(
        "--wall-repeats",
        type=int,
        default=None,
        help="Runs of kv and of dynamo per fleet size in the wall-clock cross-check (default 3, 1 with "
        "--quick); dynamo_cost and cache_aware run once.",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override a [selector] key for every policy run (repeatable; e.g. --set interference_weight=1).",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="FILE",
        help="Run nothing: aggregate the runs of earlier outputs (routing.json or .partial.jsonl files; a "
        "later file's run of the same workload/workers/level/seed/policy replaces an earlier one) "
        "into the tables, verdicts and --out.",
    )
    ap.add_argument("--out", default=str(ROOT / "out" / "bench" / "routing.json"))
    args = ap.parse_args()
    if args.merge:
        merge_outputs([Path(p) for p in args.merge], Path(args.out))
        return
    seeds = range(args.first_seed, args.first_seed + (1 if args.quick else args.seeds))
    names = set(args.policies.split(","))
    policies = [p for p in POLICIES if p[0] in names]
    overrides = {k: float(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    if overrides:
        policies = [(*p, overrides) for p in policies]
    workloads = args.workloads.split(",")
    jobs = []
    if args.wall_only:
        workloads = []
    if "conversation" in workloads:
        jobs += [
            ("conversation", args.quick, w, lv, s, *p)
            for w in map(int, args.workers.split(","))
            for lv in map(float, args.levels.split(","))
            for s in seeds
            for p in policies
        ]
    for wl in ("synthetic", "azure"):
        if wl in workloads:
            jobs += [(wl, args.quick, w, OTHER_LEVEL[wl], 0, *p) for w in OTHER_WORKERS for p in policies]
    # whole cells first, level 1.0 first (a cut-short grid still has complete cells); big fleets first in a cell
    rank = {1.0: 0, 1.25: 1, 0.5: 2}
    jobs.sort(key=lambda j: (j[4], rank.get(j[3], 0) if j[0] == "conversation" else 0.5, -j[2]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # The wall-clock cross-check first: it is the part a busy machine disturbs; the virtual grid is
    # deterministic and only takes longer.
    wall = None
    if not args.no_wall:
        repeats = args.wall_repeats or (1 if args.quick else 3)
        sizes = (4,) if args.quick else tuple(map(int, args.wall_workers.split(",")))
        wall_policies = tuple(args.wall_policies.split(",")) if args.wall_policies else None
        wall = [
            wall_crosscheck(w, args.quick, args.wall_limit, args.wall_speedup, wall_policies, repeats) for w in sizes
        ]
        for c in wall:
            w, v = c["wall"], c["virtual"]
            print(
                f"cross-check (kv, {c['workers']} workers, {c['requests']} requests, {c['speedup']:g}x): "
                f"hit {w['prefix_hit_ratio']:.3f} wall vs {v['prefix_hit_ratio']:.3f} virtual; "
                f"TTFT p50 {w['ttft_ms_p50']:,.0f} vs {v['ttft_ms_p50']:,.0f} ms; "
                f"p99 {w['ttft_ms_p99']:,.0f} vs {v['ttft_ms_p99']:,.0f} ms",
                flush=True,
            )
            if c["verdict"]:
                v = c["verdict"]
                print(
                    f"  verdict W={c['workers']} (kv vs {', '.join(label for label in c['runs'] if label != 'kv')}, "
                    f"{c['repeats']} runs of kv and dynamo): {v['verdict']} {'; '.join(v['missed'])}",
                    flush=True,
                )
            for label, rt in c["ratios_vs_dynamo"].items():
                print(
                    f"  W={c['workers']} {label} / dynamo: hit x{rt['prefix_hit_ratio']}, TTFT-adm p50 "
                    f"x{rt['ttft_adj_ms_p50']}, p99 x{rt['ttft_adj_ms_p99']}; overlap given up "
                    f"{rt['overlap_given_up_share']:.3f}",
                    flush=True,
                )
        wall_out = out.with_name(out.stem + "_wall.json")
        wall_out.write_text(json.dumps({"loadavg": os.getloadavg(), "crosscheck": wall}, indent=1))
        print(f"wrote {wall_out}")
    if args.wall_only:
        return
    t0 = time.perf_counter()
    partial = out.with_suffix(".partial.jsonl")  # one line per finished run, for long grids
    runs = []
    with mp.get_context("spawn").Pool(max(1, args.jobs)) as pool, open(partial, "w") as fh:
        for run in pool.imap_unordered(one_virtual, jobs, chunksize=1):
            runs.append(run)
            fh.write(json.dumps(run) + "\n")
            fh.flush()
            print(
                f"[{len(runs)}/{len(jobs)}] {run['workload']} W={run['workers']} level={run['level']} "
                f"seed={run['seed']} {run['policy']}: hit {run['prefix_hit_ratio']:.3f} p50 {run['ttft_ms_p50']:,.0f} "
                f"p99 {run['ttft_ms_p99']:,.0f} ({run['wall_s']:.0f} s)",
                flush=True,
            )
    virtual_s = time.perf_counter() - t0
    rows = sorted(
        aggregate(runs),
        key=lambda r: (
            workloads.index(r["workload"]),
            r["workers"],
            r["level"],
            [p[0] for p in policies].index(r["policy"]),
        ),
    )
    print_table(rows)
    print(f"{len(runs)} virtual runs in {virtual_s:.0f} s")
    if args.quick:
        print(
            "--quick: the bundled 1,500-request slice and one seed; these verdicts are a smoke test, not "
            "comparable with the published grid (the full trace, 3 seeds: docs/BENCHMARKS.md section 5)"
        )
    ver = verdicts(rows)
    for v in ver:
        print(f"verdict {v['workload']} W={v['workers']} level={v['level']}: {v['verdict']} {'; '.join(v['missed'])}")
    meta = {
        "levels": args.levels,
        "workers": args.workers,
        "seeds": list(seeds),
        "quick": args.quick,
        "workloads": workloads,
        "load_scale_rule": "level * workers / 4",
        "virtual_runs": len(runs),
        "virtual_runs_s": round(virtual_s, 1),
        "jobs": args.jobs,
        "loadavg": os.getloadavg(),
    }
    out.write_text(
        json.dumps({"meta": meta, "rows": rows, "runs": runs, "verdicts": ver, "wall_crosscheck": wall}, indent=1)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
