"""Run every benchmark in order, collect the JSON, draw the plots, regenerate docs/BENCHMARKS.md tables.

Order: kernels (`bench_kernels.py`), queue core (`bench_queue.py`), the scheduler core in process
(`bench_core.py`), the daemon vs echo, Redis and Dynamo (`bench_transport.py`), routing quality
(`bench_routing.py`). Each step's output goes to
`<out>/<name>.log` and `<out>/<name>.json`; then `plots.py` draws the PNGs and the blocks between
`<!-- generated:NAME -->` and `<!-- /generated:NAME -->` in `docs/BENCHMARKS.md` are rewritten from
the JSON (the prose around them is left alone).

    python bench/run_all.py            # full: out/bench/, docs/bench/*.png, docs/BENCHMARKS.md (~1 h on 2 cores)
    python bench/run_all.py --quick    # smoke: out/bench/quick/ only, docs untouched (~5 min idle, ~12 loaded)
    python bench/run_all.py --docs-only  # re-render plots + tables from existing JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DOC = ROOT / "docs" / "BENCHMARKS.md"
STEPS = ("kernels", "queue", "core", "transport", "routing")
SCRIPTS = {
    "kernels": "bench_kernels.py",
    "queue": "bench_queue.py",
    "core": "bench_core.py",
    "transport": "bench_transport.py",
    "routing": "bench_routing.py",
}


# ---------------------------------------------------------------------------- running
def ensure_redis() -> str | None:
    """Install Debian's redis-server when missing and we are root; returns a note when it stays missing."""
    if shutil.which("redis-server"):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "redis-server missing and not root: Redis rows will be skipped (apt-get install redis-server)"
    print("redis-server missing: apt-get install redis-server", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "install", "-y", "-q", "redis-server"],
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "redis-server"],
    ):
        subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
        if shutil.which("redis-server"):
            return None
    return "apt-get install redis-server failed: Redis rows will be skipped"


def run_step(name: str, out_dir: Path, quick: bool) -> dict:
    argv = [sys.executable, str(ROOT / "bench" / SCRIPTS[name]), "--out", str(out_dir / f"{name}.json")]
    if quick:
        argv.append("--quick")
    log = out_dir / f"{name}.log"
    print(f"== {name}: {' '.join(argv[1:])}", flush=True)
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            fh.write(line)
        rc = proc.wait()
    dt = time.perf_counter() - t0
    print(f"== {name}: exit {rc} in {dt:.0f} s (log {log.relative_to(ROOT)})", flush=True)
    return {"step": name, "rc": rc, "seconds": round(dt, 1), "loadavg_after": os.getloadavg()}


def machine() -> dict:
    cpu = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kib = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kib = int(line.split()[1])
    import msgspec
    import numba
    import numpy
    import zmq

    redis_v = None
    if shutil.which("redis-server"):
        redis_v = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip()
    try:
        import redis as redis_py

        redis_py_v = redis_py.__version__
    except ImportError:
        redis_py_v = None
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "ram_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "numba": numba.__version__,
        "numpy": numpy.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "msgspec": msgspec.__version__,
        "redis_server": redis_v,
        "redis_py": redis_py_v,
    }


# ---------------------------------------------------------------------------- tables
def _f(v, fmt: str = ",.0f") -> str:
    return "–" if v is None else format(v, fmt)


def table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def md_machine(m: dict, run: dict) -> str:
    rows = [
        ["CPU", f"{m['cpu_model']} — `nproc` = {m['nproc']}"],
        ["RAM", f"{m['ram_gib']} GiB"],
        ["kernel", m["kernel"]],
        ["Python / numba / numpy", f"{m['python']} / {m['numba']} / {m['numpy']}"],
        ["pyzmq / libzmq / msgspec", f"{m['pyzmq']} / {m['libzmq']} / {m['msgspec']}"],
        ["Redis", f"{m['redis_server'] or 'not installed'}; redis-py {m['redis_py'] or '–'} (hiredis parser)"],
        [
            "run",
            f"{run['started']} — {run['mode']}, {run['minutes']} min; 1-min load average at start "
            f"{run['loadavg_start'][0]:.2f} (the 2 cores are shared: absolute figures move between runs)",
        ],
    ]
    return table(["", ""], rows)


def md_transport(t: dict) -> str:
    rows = [
        [
            r["backend"],
            r["routers"],
            r["window"],
            _f(r["lifecycles_per_s"]),
            _f(r["select_us_p50"]),
            _f(r["select_us_p99"]),
            _f(r["server_cpu_us_per_lifecycle"], ",.1f"),
            _f(r.get("router_cpu_us_per_lifecycle"), ",.1f"),
            f"{r['loadavg_1m']:.1f}",
        ]
        for r in t["rows"]
    ]
    return table(
        [
            "backend",
            "routers",
            "window",
            "lifecycles/s",
            "select p50 µs",
            "select p99 µs",
            "server CPU µs / lifecycle",
            "router CPU µs / lifecycle",
            "load",
        ],
        rows,
    )


def _yn(v) -> str:
    return "–" if v is None else ("met" if v else "**missed**")


def md_ratios(t: dict) -> str:
    """The daemon's ratios and goal verdicts per cell (`bench_transport.verdicts`), then per goal."""
    ver = t.get("verdicts") or []
    rows = [
        [
            v["routers"],
            v["window"],
            _f(v["over_dynamo"], ".2f"),
            _f(v["over_redis"], ".2f"),
            _f(v["over_echo"], ".2f"),
            f"{_f(v['daemon_p99_us'])} / {_f(v['echo_p99_us'])} / {_f(v['redis_p99_us'])} / {_f(v['dynamo_p99_us'])}",
            _f(v["p99_over_echo"], ".2f"),
            _f(v["cpu_over_echo"], ".2f"),
            _yn(v["dynamo_3x"]),
            _yn(v["redis"]),
            _yn(v["p99_1_3x_echo"]),
            _yn(v["cpu_2x_echo"]),
        ]
        for v in ver
    ]
    parts = [
        table(
            [
                "routers",
                "window",
                "/ Dynamo",
                "/ Redis",
                "/ echo",
                "p99 µs daemon / echo / Redis / Dynamo",
                "p99 / echo",
                "CPU / echo",
                "≥ 3× Dynamo",
                "Redis goal",
                "p99 ≤ 1.3× echo",
                "CPU ≤ 2× echo",
            ],
            rows,
        )
    ]
    summary = t.get("goal_summary") or []
    if summary:
        parts.append(
            table(
                ["goal", "cells met", "verdict"],
                [[g["label"], f"{g['met']} of {g['cells']}", g["verdict"]] for g in summary],
            )
        )
    c, lp = t.get("core"), t.get("long_prompt")
    if c:
        parts.append(
            f"In-process core ({c['source']}): **{c['cpu_us_per_lifecycle']:.1f} µs CPU per lifecycle** "
            f"(8 workers, 64 hashes, kv selector; goal ≤ {c['goal_us']:g} µs)."
        )
    if lp:
        parts.append(
            f"Long prompts, no target: {lp['prompt_tokens']:,}-token prompts ({lp['blocks']:,} blocks of 16) at "
            f"{lp['workers']} workers, in process: **{lp['decisions_per_s']:,.0f} decisions/s**, decision p50 "
            f"{lp['decision_us_p50']:,.0f} µs, p99 {lp['decision_us_p99']:,.0f} µs."
        )
    return "\n\n".join(parts)


def _peak(rows: list[dict], backend: str, routers: int) -> dict | None:
    cand = [r for r in rows if r["backend"] == backend and r["routers"] == routers]
    return max(cand, key=lambda r: r["lifecycles_per_s"]) if cand else None


def md_alternatives(t: dict) -> str:
    counts = sorted({r["routers"] for r in t["rows"]})
    n = 8 if 8 in counts else counts[-1]
    rows = []
    for b, label in (
        ("echo", "ZeroMQ echo (same frames, no scheduling)"),
        ("daemon", "kvsched daemon"),
        ("redis", "Redis + Lua"),
        ("dynamo", "NVIDIA Dynamo select_service"),
    ):
        r = _peak(t["rows"], b, n)
        if r is None:
            note = next((x for x in t["meta"]["notes"] if b in x.lower()), "not measured")
            rows.append([label, "–", "–", "–", "–", "–", note])
        else:
            rows.append(
                [
                    label,
                    r["window"],
                    _f(r["lifecycles_per_s"]),
                    _f(r["select_us_p50"]),
                    _f(r["select_us_p99"]),
                    _f(r["server_cpu_us_per_lifecycle"], ",.1f"),
                    "",
                ]
            )
    return f"{n} router processes; each backend at its best window (highest lifecycles/s).\n\n" + table(
        ["backend", "window", "lifecycles/s", "select p50 µs", "select p99 µs", "server CPU µs / lifecycle", "note"],
        rows,
    )


CORE_CELLS = {
    ("approx", 8): "approximate overlap index, 8 leases in flight",
    ("approx", 1): "approximate overlap index, 1 lease in flight",
    ("events", 8): "KV-event overlap index, 8 leases in flight",
}


def md_core(c: dict) -> str:
    """The in-process core cost per lifecycle (`bench_core.py` JSON): one row per cell, with the
    baseline revision's figure and the ratio when the run had `--baseline`."""
    base = c.get("baseline_rows") or [None] * len(c["rows"])
    rev = c.get("baseline_revision")
    rows = []
    for r, b in zip(c["rows"], base, strict=False):
        row = [
            CORE_CELLS.get((r["overlap_mode"], r["window"]), f"{r['overlap_mode']}, window {r['window']}"),
            _f(r["cpu_us_per_lifecycle"], ",.1f"),
            _f(r.get("wall_us_per_lifecycle"), ",.1f"),
        ]
        if rev:
            row += [
                _f(b["cpu_us_per_lifecycle"] if b else None, ",.1f"),
                f"{b['cpu_us_per_lifecycle'] / r['cpu_us_per_lifecycle']:.2f}×" if b else "–",
            ]
        rows.append(row)
    header = ["cell", f"CPU µs / lifecycle ({c.get('revision') or 'this tree'})", "wall µs / lifecycle"]
    if rev:
        header += [f"CPU µs / lifecycle ({rev})", "speed-up"]
    first = c["rows"][0]["cpu_us_per_lifecycle"]
    verdict = "met" if first <= c["goal_us"] else "**missed**"
    load = f", 1-min load average {c['loadavg_1m']:.1f}" if c.get("loadavg_1m") is not None else ""
    calib = (
        f"; a 1e6-iteration Python loop took {c['python_loop_ms_per_1e6']:g} ms of CPU"
        if c.get("python_loop_ms_per_1e6")
        else ""
    )
    return (
        table(header, rows) + "\n\n" + f"Goal ≤ {c['goal_us']:g} µs CPU per lifecycle ({c['workers']} workers, "
        f"{c['hashes']} hashes, {c['selector']} selector, first cell): {first:.1f} µs — {verdict}. "
        f"Best of {c.get('rounds', '?')} × {c.get('repeats', '?')} × {c.get('lifecycles', '?'):,} lifecycles"
        f" ({c.get('mode', 'full')} run{load}{calib})."
    )


def md_kernels(k: dict) -> str:
    rows = []
    for c in k["cases"]:
        nb = c["project_numba_us"] + c["depth_numba_us"]
        npy = c["project_numpy_us"] + c["depth_numpy_us"]
        py = c["project_python_us"] + c["depth_python_us"]
        rows.append(
            [
                c["workers"],
                f"{c['active']:,}",
                f"{nb:.2f}",
                f"{npy:,.0f}",
                f"{py:,.0f}",
                f"{npy / nb:,.0f}×",
                f"{py / nb:,.0f}×",
                f"{c['ledger_project_us']:.2f}",
            ]
        )
    return table(
        [
            "workers",
            "active sequences",
            "numba µs",
            "numpy µs",
            "Python µs",
            "numpy / numba",
            "Python / numba",
            "Ledger.project µs (with Python glue)",
        ],
        rows,
    )


def md_startup(k: dict | None, t: dict | None) -> str:
    rows = []
    if k:
        rows += [
            ["import numba + warm_kernels(), empty cache (cold compile)", f"{k['compile']['cold_compile_s']} s"],
            ["import numba + warm_kernels(), warm NUMBA_CACHE_DIR", f"{k['compile']['cached_load_s']} s"],
        ]
    if t:
        rows += [
            [
                "`kvsched-daemon` spawn → ready line, empty numba cache",
                f"{t['meta']['daemon_start_to_ready_cold_s']} s",
            ],
            ["`kvsched-daemon` spawn → ready line, warm cache", f"{t['meta']['daemon_start_to_ready_warm_s']} s"],
        ]
    return table(["figure", "value"], rows)


def md_queue(q: dict) -> str:
    rows = [
        [
            f"enqueue + pop at {r['queued']:,} queued",
            f"{r['policy_queue_ops_s']:,.0f} /s",
            f"{r['naive_ops_s']:,.0f} /s",
            f"{r['policy_queue_ops_s'] / r['naive_ops_s']:,.0f}×",
        ]
        for r in q["depth"]
    ]
    rows += [
        [f"enqueue + pop, {r['lanes']} pinned lanes", f"{r['policy_queue_ops_s']:,.0f} /s", "", ""] for r in q["lanes"]
    ]
    rows += [
        [f"enqueue + pop, {r['classes']} classes (DRR)", f"{r['policy_queue_ops_s']:,.0f} /s", "", ""]
        for r in q["classes"]
    ]
    c = q["cancel"]
    rows.append(
        [
            f"cancel at {c['queued']:,} queued",
            f"{c['policy_queue_us_per_cancel']:.2f} µs",
            f"{c['naive_us_per_cancel']:,.0f} µs",
            f"{c['naive_us_per_cancel'] / c['policy_queue_us_per_cancel']:,.0f}×",
        ]
    )
    return table(["figure", "PolicyQueue", "naive list", "ratio"], rows)


def _spread(x: dict, m: str, fmt: str) -> str:
    """Mean, with the seeds' min–max when they differ."""
    v, lo, hi = x.get(m), x.get(m + "_min"), x.get(m + "_max")
    if v is None:
        return "–"
    if lo is None or hi is None or lo == hi or len(x.get("seeds", [0])) < 2:
        return format(v, fmt)
    return f"{format(v, fmt)} ({format(lo, fmt)}–{format(hi, fmt)})"


WORKLOAD_TITLES = {
    "conversation": "Mooncake conversation trace (a seeded 90 % of its conversations per seed)",
    "synthetic": "Synthetic sessions (`bench/workloads.py`: shared system prompts, chat, agent tool loops)",
    "azure": "Azure conversation trace arrivals and lengths, synthesised shared prefixes",
}


def md_routing(r: dict) -> str:
    rows_all = r["rows"]
    runs_s = (
        f"merged from {len(r['meta']['merged_from'])} outputs, {r['meta']['virtual_runs_s']:,.0f} s of run time"
        if r["meta"].get("merged_from")
        else f"in {r['meta']['virtual_runs_s']:,.0f} s ({r['meta'].get('jobs', 2)} processes)"
    )
    parts = [
        f"{r['meta'].get('virtual_runs', len(rows_all))} virtual runs "
        f"{runs_s}; load scale = level × workers / 4; times in simulated ms; "
        "spread = min–max over seeds; hit = cached / prompt tokens; fleet LRU = one LRU cache of the fleet's "
        "blocks seeing every request (achievable reference); bound = infinite cache; TPOT = mean inter-token "
        "latency; lost = share of requests not completed (rejected or shed); gave up = share of the deepest "
        "available overlap not used."
    ]
    for wl in dict.fromkeys(x.get("workload", "conversation") for x in rows_all):
        for w in sorted({x["workers"] for x in rows_all if x.get("workload", "conversation") == wl}):
            rows = []
            for x in (x for x in rows_all if x.get("workload", "conversation") == wl and x["workers"] == w):
                rows.append(
                    [
                        x["level"],
                        ("**kv**" if x["policy"] == "kv" else x["policy"]),
                        _spread(x, "prefix_hit_ratio", ".3f"),
                        f"{x['fleet_lru_hit_ratio']:.3f}",
                        f"{x['infinite_cache_hit_ratio']:.3f}",
                        _spread(x, "ttft_ms_p50", ",.0f"),
                        _spread(x, "ttft_ms_p99", ",.0f"),
                        _spread(x, "tpot_ms_mean", ".1f"),
                        _spread(x, "queue_wait_ms_p99", ",.0f"),
                        f"{x['not_completed_share']:.3f}",
                        f"{x['imbalance_max_over_mean']:.2f}",
                        f"{x['overlap_given_up_share']:.2f}",
                    ]
                )
            parts.append(
                f"**{WORKLOAD_TITLES.get(wl, wl)}, {w} workers** ({x['requests']:,.0f} requests)\n\n"
                + table(
                    [
                        "level",
                        "policy",
                        "hit",
                        "fleet LRU",
                        "bound",
                        "TTFT p50",
                        "TTFT p99",
                        "TPOT",
                        "wait p99",
                        "lost",
                        "imbalance",
                        "gave up",
                    ],
                    rows,
                )
            )
    ver = r.get("verdicts") or []
    if ver:
        parts.append(
            "**Verdicts** (kv best on hit, TTFT p50 and p99 — a tie within the seed spread, or 1 % with one "
            "seed, counts — TPOT ≤ 1.1 × the best baseline's, lost ≤ best + 0.5 %)\n\n"
            + table(
                ["workload", "workers", "level", "verdict", "missed on"],
                [[v["workload"], v["workers"], v["level"], v["verdict"], "; ".join(v["missed"]) or "–"] for v in ver],
            )
        )
    return "\n\n".join(parts)


def _ranged(f: dict, m: str, fmt: str) -> str:
    """`f[m]` formatted, with its min–max when the policy ran more than once."""
    v = format(f[m], fmt)
    if f.get("repeats", 1) > 1 and f.get(m + "_min") is not None:
        v += f" ({format(f[m + '_min'], fmt)}–{format(f[m + '_max'], fmt)})"
    return v


def _ratio_vs_dynamo(rt: dict, label: str, metric: str) -> str:
    """ " (1.23×)": `label`'s ratio to `dynamo` on `metric`; "" for dynamo itself or without a ratio."""
    return f" ({rt[metric]:.2f}×)" if rt.get(metric) is not None and label != "dynamo" else ""


def md_crosscheck(cs) -> str:
    """The wall-clock cross-check (`bench_routing.wall_crosscheck` results, one per fleet size): per
    policy the mean over its runs with the min–max, the ratio to `dynamo`, and the cell's verdict."""
    if not cs:
        return "_not run_"
    cs = cs if isinstance(cs, list) else [cs]
    out = []
    for c in cs:
        runs = c.get("runs") or {"kv": c["wall"]}
        rows = []
        for label, f in runs.items():
            rt = (c.get("ratios_vs_dynamo") or {}).get(label, {})
            rows.append(
                [
                    ("**kv**" if label == "kv" else label),
                    f.get("repeats", 1),
                    _ranged(f, "prefix_hit_ratio", ".3f") + _ratio_vs_dynamo(rt, label, "prefix_hit_ratio"),
                    f"{f['overlap_given_up_share']:.3f}",
                    _ranged(f, "ttft_adj_ms_p50", ",.0f") + _ratio_vs_dynamo(rt, label, "ttft_adj_ms_p50")
                    if "ttft_adj_ms_p50" in f
                    else "–",
                    _ranged(f, "ttft_adj_ms_p99", ",.0f") + _ratio_vs_dynamo(rt, label, "ttft_adj_ms_p99")
                    if "ttft_adj_ms_p99" in f
                    else "–",
                    _f(f["ttft_ms_p50"]),
                    f"{f.get('admission_ms_p50', 0):.1f} / {f.get('admission_ms_p99', 0):.1f}",
                    f"{f['tpot_ms_mean'] or 0:.1f}",
                    f"{f['not_completed']:g}",
                    f"{f['imbalance_max_over_mean'] or 0:.2f}",
                ]
            )
        v = c["virtual"]
        rows.append(
            [
                "kv, virtual time",
                1,
                f"{v['prefix_hit_ratio']:.3f}",
                f"{v['overlap_given_up_share']:.3f}",
                _f(v["ttft_ms_p50"]),
                _f(v["ttft_ms_p99"]),
                _f(v["ttft_ms_p50"]),
                "0",
                f"{v['tpot_ms_mean'] or 0:.1f}",
                v["not_completed"],
                f"{v['imbalance_max_over_mean'] or 0:.2f}",
            ]
        )
        chk = (runs.get("kv") or {}).get("overlap_check")
        check = (
            f" Overlap check (kv run, every 10th request, Dynamo's `/overlap_scores` vs the daemon's per-worker "
            f"overlap for the same decision): {chk['samples']} requests, (request, worker) pairs equal "
            f"{chk['pair_agreement']:.1%}, requests equal on every worker {chk['request_agreement']:.1%}, same "
            f"deepest worker(s) {chk['deepest_agreement']:.1%}; daemon higher in {chk['daemon_higher_share']:.1%} "
            "of pairs."
            if chk
            else ""
        )
        skipped = f" `dynamo` skipped: {c['dynamo_skipped']}." if c.get("dynamo_skipped") else ""
        load = c.get("loadavg")
        ver = c.get("verdict")
        verdict = ""
        if ver:
            verdict = (
                f"\n\nVerdict (`kv` best on hit ratio and TTFT − admission p50 / p99, a tie within the spread of "
                f"the runs counting; TPOT within 10 % of the best; not completed ≤ best + 0.5 %): "
                f"**{ver['verdict']}**" + (f" — {'; '.join(ver['missed'])}" if ver["missed"] else "") + "."
            )
        out.append(
            f"**{c['workers']} workers**: first {c['requests']:,} requests of the conversation trace, load scale "
            f"{c['load_scale']:g}, {c['routers']} router processes, speedup {c['speedup']:g}×"
            + (f", load average {load[0]:.1f} at the end" if load else "")
            + "; mean over runs (min–max)."
            + skipped
            + check
            + "\n\n"
            + table(
                [
                    "policy",
                    "runs",
                    "hit (/ dynamo)",
                    "gave up",
                    "TTFT − admission p50 (/ dynamo)",
                    "TTFT − admission p99 (/ dynamo)",
                    "raw TTFT p50",
                    "admission p50 / p99 (wall ms)",
                    "TPOT",
                    "not completed",
                    "imbalance",
                ],
                rows,
            )
            + verdict
        )
    return "\n\n".join(out)


def targets(
    t: dict | None, k: dict | None, r: dict | None, core: dict | None = None, wall: list[dict] | None = None
) -> list[list[str]]:
    """[target, measured, verdict] rows computed from the JSON. The in-process core row comes from
    `bench_core.py`'s JSON when there is one, else from the transport run's inline figure."""
    out = []
    if core:
        v = core["rows"][0]["cpu_us_per_lifecycle"]
        out.append(
            [
                f"in-process core ≤ {core['goal_us']:g} µs per lifecycle ({core['workers']} workers, "
                f"{core['hashes']} hashes; `bench_core.py`)",
                f"{v:.1f} µs",
                "met" if v <= core["goal_us"] else "missed",
            ]
        )
    if t:
        for g in t.get("goal_summary") or []:
            out.append(
                [f"{g['label']}, every cell of the grid (same run)", f"{g['met']} of {g['cells']} cells", g["verdict"]]
            )
        c = t.get("core")
        if c and not core:
            out.append(
                [
                    f"in-process core ≤ {c['goal_us']:g} µs per lifecycle (8 workers, 64 hashes)",
                    f"{c['cpu_us_per_lifecycle']:.1f} µs",
                    "met" if c["cpu_us_per_lifecycle"] <= c["goal_us"] else "missed",
                ]
            )
    if k:
        c64 = [c for c in k["cases"] if c["workers"] == 64]
        if c64:
            worst = max(c["project_numba_us"] + c["depth_numba_us"] for c in c64)
            ratio = min(
                (c["project_numpy_us"] + c["depth_numpy_us"]) / (c["project_numba_us"] + c["depth_numba_us"])
                for c in c64
            )
            out.append(
                [
                    "projection + overlap + cost ≤ 5 µs per decision at 64 workers",
                    f"{worst:.2f} µs (worst of {len(c64)} sizes)",
                    "met" if worst <= 5 else "missed",
                ]
            )
            out.append(
                [
                    "≥ 10× the numpy version at 64 workers",
                    f"{ratio:,.0f}× (smallest)",
                    "met" if ratio >= 10 else "missed",
                ]
            )
    if r:
        ver = [v for v in r.get("verdicts") or [] if v["workload"] == "conversation"]
        if ver:
            met = sum(v["verdict"] == "met" for v in ver)
            out.append(
                [
                    "kv best on hit ratio and TTFT p50 / p99 in every conversation-grid cell",
                    f"{met} of {len(ver)} cells",
                    "met" if met == len(ver) else "missed",
                ]
            )
        syn = [v for v in r.get("verdicts") or [] if v["workload"] == "synthetic"]
        if syn:
            met = sum(v["verdict"] == "met" for v in syn)
            out.append(
                [
                    "the same on the synthetic workload",
                    f"{met} of {len(syn)} fleet sizes",
                    "met" if met == len(syn) else "missed",
                ]
            )
    wv = [c["verdict"] for c in wall or [] if c.get("verdict")]
    if wv:
        met = sum(v["verdict"] == "met" for v in wv)
        out.append(
            [
                "the same in the wall-clock runs against Dynamo's selection service (4 and 16 workers)",
                f"{met} of {len(wv)} fleet sizes",
                "met" if met == len(wv) else "missed",
            ]
        )
    return out


def render_doc(bench_dir: Path, run: dict | None) -> None:
    """Rewrite the generated blocks of docs/BENCHMARKS.md from the JSON in `bench_dir`."""

    def load(n: str) -> dict | None:
        path = bench_dir / f"{n}.json"
        return json.loads(path.read_text()) if path.exists() else None

    t, k, q, r, core = load("transport"), load("kernels"), load("queue"), load("routing"), load("core")
    run = run or load("run")
    blocks = {}
    if run:
        blocks["machine"] = md_machine(run["machine"], run)
    if t:
        blocks["transport"] = md_transport(t)
        blocks["ratios"] = md_ratios(t)
        blocks["alternatives"] = md_alternatives(t)
    if k:
        blocks["kernels"] = md_kernels(k)
    if k or t:
        blocks["startup"] = md_startup(k, t)
    if q:
        blocks["queue"] = md_queue(q)
    if core:
        blocks["core"] = md_core(core)
    if r:
        blocks["routing"] = md_routing(r)
        blocks["crosscheck"] = md_crosscheck(r.get("wall_crosscheck"))
    # bench_routing.py writes routing_wall.json in every run that includes the wall-clock part (the
    # same data as routing.json's wall_crosscheck), and alone in a `--wall-only` re-run: the file,
    # when present, is the cross-check's source.
    wall = load("routing_wall")
    crosscheck = (r or {}).get("wall_crosscheck")
    if wall and wall.get("crosscheck"):
        crosscheck = wall["crosscheck"]
        blocks["crosscheck"] = md_crosscheck(crosscheck)
    blocks["targets"] = table(["target", "measured", "verdict"], targets(t, k, r, core, crosscheck))
    text = DOC.read_text()
    for name, body in blocks.items():
        pat = re.compile(rf"(<!-- generated:{name} -->\n)(?:.*?\n)?(<!-- /generated:{name} -->)", re.S)
        if not pat.search(text):
            print(f"docs/BENCHMARKS.md has no generated:{name} block; skipped")
            continue
        text = pat.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text)
    DOC.write_text(text)
    print(f"rewrote {DOC}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="Smoke run into out/bench/quick/; docs untouched unless --docs."
    )
    ap.add_argument("--docs", action="store_true", help="With --quick: still write docs/bench and docs/BENCHMARKS.md.")
    ap.add_argument("--docs-only", action="store_true", help="Only re-render plots and tables from existing JSON.")
    ap.add_argument("--only", default=None, help="Comma-separated steps to run (default: all).")
    args = ap.parse_args()
    os.environ.setdefault("NUMBA_CACHE_DIR", str(ROOT / ".numba-cache"))
    bench_dir = ROOT / "out" / "bench" / ("quick" if args.quick else "")
    bench_dir.mkdir(parents=True, exist_ok=True)
    write_docs = not args.quick or args.docs
    plot_dir = ROOT / "docs" / "bench" if write_docs else bench_dir / "plots"
    from plots import make_plots

    if args.docs_only:
        for p in make_plots(bench_dir, plot_dir):
            print(f"wrote {p.relative_to(ROOT)}")
        render_doc(bench_dir, None)
        return
    t0 = time.perf_counter()
    mode = "quick" if args.quick else "full" if not args.only else f"steps {args.only} only"
    run = {
        "started": time.strftime("%Y-%m-%d %H:%M %Z"),
        "mode": mode,
        "loadavg_start": os.getloadavg(),
        "machine": machine(),
        "steps": [],
    }
    note = ensure_redis()
    if note:
        print(note)
        run["notes"] = [note]
    run["machine"] = machine()
    steps = args.only.split(",") if args.only else STEPS
    for name in steps:
        run["steps"].append(run_step(name, bench_dir, args.quick))
    run["minutes"] = round((time.perf_counter() - t0) / 60, 1)
    (bench_dir / "run.json").write_text(json.dumps(run, indent=1))
    for p in make_plots(bench_dir, plot_dir):
        print(f"wrote {p.relative_to(ROOT)}")
    if write_docs:
        render_doc(bench_dir, run)
    failed = [s["step"] for s in run["steps"] if s["rc"] != 0]
    print(f"all benches: {run['minutes']} min" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
