"""The daemon against an echo of its frames, Redis-Lua and NVIDIA Dynamo's selection service, in one run.

One lifecycle = Enqueue → reply, dispatched, prefill_done, Release(completed). On the daemon's wire
(protocol version 2, local routers) that is 2 frames in (Enqueue, Release) and 1 out: dispatched and
prefill_done are stores into the slot's shared-memory state word, and the frames a router's coroutines
send within one event-loop turn travel as one `Batch` message (replies of one wake as one `Replies`).
Backends (`transport_backends.py`), all driven by the same long-lived router processes in the same run:
`echo` (the daemon's I/O pattern and decoders, no scheduling), `daemon` (`kvsched-daemon`, 8 workers,
real `SchedulerClient`), `redis` (Lua scripts; the reserve awaited, the other three commands as one
pipeline), `dynamo` (Dynamo's `select_service` over HTTP; skipped with the reason when
`ai-dynamo-runtime` is not installed).

Grid: {1, 4, 8, 16} router processes × {1, 8, 32} lifecycles in flight per router. Per cell:
lifecycles/s, admission (select) latency p50 / p99 at the router (µs), server CPU per lifecycle
(µs, from /proc; the router processes' CPU per lifecycle beside it), the daemon's ratios to each
other backend and the goal verdicts (`verdicts`):
lifecycles/s ≥ 3× Dynamo in every cell, ≥ 2.5× Redis at window ≥ 8 and ≥ 1.5× at window 1,
admission p99 ≤ 1.3× the echo's, server CPU per lifecycle ≤ 2× the echo's. Also printed: the core's
in-process cost per lifecycle (goal ≤ 15 µs), the long-prompt cell (100k-token prompts at 64 workers,
no target; `transport_core.py`) and the daemon's start-to-ready time.

Usage: python bench/bench_transport.py [--quick]  ->  tables, out/bench/transport.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from transport_backends import (
    BLOCK,
    N_HASHES,
    WORKERS,
    echo_server,
    make_backend,
    request_hashes,
    start_dynamo,
    start_redis,
)

ISL = BLOCK * N_HASHES
N_SEQUENCES = 4096  # distinct requests cycled through by each router
FRAMES_PER_LIFECYCLE = 3  # Enqueue + Release in, Admitted out (dispatched / prefill_done: shared-memory stores)
CDF_POINTS = 200
BACKENDS = ("echo", "daemon", "redis", "dynamo")
GOALS = {
    "over_dynamo": 3.0,
    "over_redis_window1": 1.5,
    "over_redis_window8": 2.5,
    "p99_over_echo": 1.3,
    "cpu_over_echo": 2.0,
}
DAEMON_TOML = f"""
[daemon]
block_size = {BLOCK}
max_workers = {WORKERS}
max_slots = 16384
max_blocks_per_request = {N_HASHES}
liveness_timeout_ms = 5000

[selector]
seed = 0
""" + "".join(
    f"""
[[workers]]
worker_id = {w}
total_kv_blocks = 1000000
max_num_batched_tokens = 100000000
"""
    for w in range(WORKERS)
)


# ---------------------------------------------------------------------------- router side
async def session(cmd: dict, idx: int, hashes: list[bytes], tokens: list, conn) -> dict:
    """One measured run of one router process: `window` coroutines doing lifecycles back to back.
    After opening its backend the router says "open" and waits for the parent's clock times, so a
    slow start of any router (a loaded machine) never eats into the measured interval."""
    backend = make_backend(cmd["backend"], cmd["endpoint"], cmd["window"])
    await backend.open()
    conn.send("open")
    times = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    cmd = {**cmd, **times}
    await asyncio.sleep(max(0.0, cmd["start_at"] - time.monotonic()))
    measure_from, end_at = cmd["measure_from"], cmd["end_at"]
    lats: list[float] = []
    errors = [0]
    first_error: list[str] = []
    dynamo = cmd["backend"] == "dynamo"

    async def worker(k: int) -> None:
        i = k
        while True:
            t = time.monotonic()
            if t >= end_at:
                return
            rid = f"{cmd['tag']}-{idx}-{k}-{i}"
            j = i % len(hashes)
            try:
                lat = await backend.lifecycle(rid, hashes[j], tokens[j] if dynamo else None)
            except Exception as exc:  # counted; a bench must report failures, not hide them
                errors[0] += 1
                if not first_error:
                    first_error.append(repr(exc)[:300])
                await asyncio.sleep(0.001)
                continue
            finally:
                i += cmd["window"]
            if t >= measure_from:
                lats.append(lat)

    await asyncio.gather(*(worker(k) for k in range(cmd["window"])))
    await backend.close()
    out = {"count": len(lats), "lats": lats, "errors": errors[0]}
    if first_error:
        out["exception"] = first_error[0]
    return out


def preload_clients() -> None:
    """Import every backend's client library now: a first import inside a timed cell (aiohttp takes
    seconds on a loaded machine) would start that cell's lifecycles late, or after it ended."""
    import importlib

    for name in ("zmq", "kvsched.client", "redis.asyncio", "aiohttp", "dynamo_driver"):
        with contextlib.suppress(ImportError):  # that backend is skipped anyway
            importlib.import_module(name)


def router_main(conn, idx: int) -> None:
    """A long-lived router process: runs one session per command until it receives None."""
    import uvloop

    hashes = [request_hashes(idx * N_SEQUENCES + i) for i in range(N_SEQUENCES)]
    tokens: list = [None] * N_SEQUENCES
    preload_clients()
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd is None:
            return
        if cmd == "tokens":  # Dynamo's API takes token ids: build them before its cells are timed
            from dynamo_driver import request_token_ids

            tokens[:] = [request_token_ids(memoryview(h).cast("Q"), BLOCK) for h in hashes]
            conn.send("tokens")
            continue
        try:
            conn.send(uvloop.run(session(cmd, idx, hashes, tokens, conn)))
        except Exception as exc:  # report to the parent instead of dying silently
            conn.send({"count": 0, "lats": [], "errors": 1, "exception": repr(exc)})


# ---------------------------------------------------------------------------- parent
def cpu_s(pid: int) -> float:
    """utime + stime of `pid` (s), all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Routers:
    """`n` spawned router processes (`router_main`) that run one backend's session per `run`."""

    def __init__(self, n: int) -> None:
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            pr = ctx.Process(target=router_main, args=(child, i), daemon=True)
            pr.start()
            self.pipes.append(parent)
            self.procs.append(pr)
        for pipe in self.pipes:
            assert pipe.recv() == "ready"

    def build_tokens(self) -> None:
        """Have every router build its sequences' token ids (the `dynamo` backend sends them)."""
        for pipe in self.pipes:
            pipe.send("tokens")
        for pipe in self.pipes:
            assert pipe.recv() == "tokens"

    def run(
        self, backend: str, endpoint: str, window: int, server_pid: int, warm_s: float, measure_s: float, tag: str
    ) -> dict:
        """One cell: every router runs `window` lifecycles in flight against `backend`; the row of figures."""
        import numpy as np

        cmd = {"backend": backend, "endpoint": endpoint, "window": window, "tag": tag}
        for pipe in self.pipes:
            pipe.send(cmd)
        early: dict[int, dict] = {}  # routers whose backend failed to open: their result came instead
        for i, pipe in enumerate(self.pipes):
            if not pipe.poll(120):
                raise RuntimeError(f"a router did not open backend {backend} within 120 s")
            msg = pipe.recv()
            if msg != "open":
                early[i] = msg
        start = time.monotonic() + 0.2 + 0.02 * len(self.pipes)
        times = {"start_at": start, "measure_from": start + warm_s, "end_at": start + warm_s + measure_s}
        cmd.update(times)
        for i, pipe in enumerate(self.pipes):
            if i not in early:
                pipe.send(times)
        while time.monotonic() < cmd["measure_from"]:
            time.sleep(0.005)
        cpu0, load0 = cpu_s(server_pid), os.getloadavg()[0]
        rcpu0 = sum(cpu_s(pr.pid) for pr in self.procs)
        time.sleep(max(0.0, cmd["end_at"] - time.monotonic()))
        cpu1 = cpu_s(server_pid)
        rcpu1 = sum(cpu_s(pr.pid) for pr in self.procs)
        outs = [early[i] if i in early else pipe.recv() for i, pipe in enumerate(self.pipes)]
        lats = np.concatenate([np.asarray(o["lats"], dtype=np.float64) for o in outs]) if outs else np.zeros(0)
        count = sum(o["count"] for o in outs)
        errors = sum(o["errors"] for o in outs)
        exc = [o["exception"] for o in outs if "exception" in o]
        lc_s = count / measure_s
        row = {
            "backend": backend,
            "routers": len(self.pipes),
            "window": window,
            "lifecycles": count,
            "lifecycles_per_s": round(lc_s, 1),
            "select_us_p50": round(float(np.percentile(lats, 50)), 1) if lats.size else None,
            "select_us_p99": round(float(np.percentile(lats, 99)), 1) if lats.size else None,
            "server_cpu_us_per_lifecycle": round((cpu1 - cpu0) / count * 1e6, 1) if count else None,
            "router_cpu_us_per_lifecycle": round((rcpu1 - rcpu0) / count * 1e6, 1) if count else None,
            "server_cpu_share": round((cpu1 - cpu0) / measure_s, 3),
            "errors": errors,
            "loadavg_1m": load0,
        }
        if exc:
            row["exception"] = exc[0]
        if lats.size:
            row["cdf_us"] = [round(float(x), 1) for x in np.percentile(lats, np.linspace(0, 100, CDF_POINTS + 1))]
        return row

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for pr in self.procs:
            pr.join(5)
            if pr.is_alive():
                pr.kill()


def start_to_ready(tmp: Path, cache_dir: str | None) -> float:
    """Seconds from spawning `kvsched-daemon` to its ready line (cache_dir None = the shared cache)."""
    from kvsched.daemon.process import DaemonProcess
    from kvsched.shm.segments import unlink_segments

    env = dict(os.environ)
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    instance = f"bench-ready-{os.getpid()}-{int(time.monotonic() * 1000) % 100000}"
    t0 = time.perf_counter()
    d = DaemonProcess.start(
        tmp / "daemon.toml", instance=instance, runtime_dir=tmp / "ready", env=env, ready_timeout_s=120
    )
    dt = time.perf_counter() - t0
    d.stop()
    unlink_segments(instance)
    return dt


def baseline_env(src: Path) -> dict[str, str]:
    """The environment that makes `python -m kvsched.daemon.app` import the `kvsched/` package under
    `src`, checked.

    `python -m` puts the working directory first on `sys.path`, so run from this repository it would
    import the repository's own `kvsched/` ahead of `PYTHONPATH` (until 2026-12-02 every `daemon@REV`
    row was this tree's daemon for that reason). `PYTHONSAFEPATH=1` (Python >= 3.11) leaves the working
    directory out.

    Raises:
        RuntimeError: a Python started with this environment here imports `kvsched` from elsewhere.
    """
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(src), PYTHONSAFEPATH="1", NUMBA_CACHE_DIR=str(src / ".numba-cache"))
    got = subprocess.run(
        [sys.executable, "-c", "import kvsched; print(kvsched.__file__)"], env=env, capture_output=True, text=True
    ).stdout.strip()
    if not got or not Path(got).resolve().is_relative_to(Path(src).resolve()):
        raise RuntimeError(f"the baseline tree {src} is not what a child imports (it imports {got or 'nothing'})")
    return env


def start_baseline_daemon(rev: str, tmp: Path):
    """`kvsched-daemon` from the `kvsched/` package of git revision `rev` (exported to `tmp`, run with
    PYTHONPATH pointing there), same config: the before/after comparison of one run. Returns
    (DaemonProcess, instance, short commit)."""
    import io
    import subprocess
    import tarfile

    from kvsched.daemon.process import DaemonProcess

    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True, text=True
    ).stdout.strip()
    src = tmp / f"base-{commit}"
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "kvsched"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(src, filter="data")
    env = baseline_env(src)
    instance = f"bench-transport-base-{os.getpid()}"
    d = DaemonProcess.start(
        tmp / "daemon.toml", instance=instance, runtime_dir=tmp / "base", env=env, ready_timeout_s=120
    )
    return d, instance, commit


# ---------------------------------------------------------------------------- figures
def _ratio(a, b, digits: int | None = 2):
    """a / b (rounded to `digits`, None = unrounded), or None when either is missing."""
    if a is None or not b:
        return None
    return a / b if digits is None else round(a / b, digits)


def verdicts(rows: list[dict]) -> list[dict]:
    """Per (routers, window) cell with a daemon row: its ratios to the other backends and the goals.

    Ratios: `over_<backend>` = daemon lifecycles/s / theirs; `p99_over_echo` and `cpu_over_echo` =
    daemon admission p99 / CPU µs per lifecycle over the echo's. Verdicts (True / False, None when the
    other backend was not measured): `dynamo_3x`, `redis` (≥ 2.5× at window ≥ 8, ≥ 1.5× below),
    `p99_1_3x_echo`, `cpu_2x_echo`. Goals: docs/BENCHMARKS.md, "Transport".
    """
    by = {(r["backend"], r["routers"], r["window"]): r for r in rows}
    out = []
    for n, w in sorted({(r["routers"], r["window"]) for r in rows if r["backend"] == "daemon"}):
        d = by[("daemon", n, w)]
        e, rd, dy = by.get(("echo", n, w)), by.get(("redis", n, w)), by.get(("dynamo", n, w))
        lc = d["lifecycles_per_s"]
        v = {
            "routers": n,
            "window": w,
            "daemon_lifecycles_per_s": lc,
            "over_echo": _ratio(lc, e and e["lifecycles_per_s"]),
            "over_redis": _ratio(lc, rd and rd["lifecycles_per_s"]),
            "over_dynamo": _ratio(lc, dy and dy["lifecycles_per_s"]),
            "p99_over_echo": _ratio(d["select_us_p99"], e and e["select_us_p99"]),
            "cpu_over_echo": _ratio(d["server_cpu_us_per_lifecycle"], e and e["server_cpu_us_per_lifecycle"]),
            "daemon_p99_us": d["select_us_p99"],
            "echo_p99_us": e and e["select_us_p99"],
            "redis_p99_us": rd and rd["select_us_p99"],
            "dynamo_p99_us": dy and dy["select_us_p99"],
            "daemon_cpu_us": d["server_cpu_us_per_lifecycle"],
            "echo_cpu_us": e and e["server_cpu_us_per_lifecycle"],
        }
        raw = {
            k: _ratio(*pair, digits=None)
            for k, pair in (
                ("over_dynamo", (lc, dy and dy["lifecycles_per_s"])),
                ("over_redis", (lc, rd and rd["lifecycles_per_s"])),
                ("p99_over_echo", (d["select_us_p99"], e and e["select_us_p99"])),
                ("cpu_over_echo", (d["server_cpu_us_per_lifecycle"], e and e["server_cpu_us_per_lifecycle"])),
            )
        }
        b = next(
            (r for r in rows if r["backend"].startswith("daemon@") and (r["routers"], r["window"]) == (n, w)), None
        )
        if b is not None:  # --baseline: the same cell on the daemon of another revision
            v.update(
                baseline=b["backend"],
                baseline_lifecycles_per_s=b["lifecycles_per_s"],
                baseline_cpu_us=b["server_cpu_us_per_lifecycle"],
                baseline_p99_us=b["select_us_p99"],
            )
        redis_goal = GOALS["over_redis_window8"] if w >= 8 else GOALS["over_redis_window1"]
        v["redis_goal"] = redis_goal
        v["dynamo_3x"] = None if raw["over_dynamo"] is None else raw["over_dynamo"] >= GOALS["over_dynamo"]
        v["redis"] = None if raw["over_redis"] is None else raw["over_redis"] >= redis_goal
        v["p99_1_3x_echo"] = None if raw["p99_over_echo"] is None else raw["p99_over_echo"] <= GOALS["p99_over_echo"]
        v["cpu_2x_echo"] = None if raw["cpu_over_echo"] is None else raw["cpu_over_echo"] <= GOALS["cpu_over_echo"]
        out.append(v)
    return out


VERDICT_KEYS = (
    ("dynamo_3x", "≥ 3× Dynamo lifecycles/s"),
    ("redis", "≥ 2.5× Redis at window ≥ 8, ≥ 1.5× at window 1"),
    ("p99_1_3x_echo", "admission p99 ≤ 1.3× echo"),
    ("cpu_2x_echo", "server CPU / lifecycle ≤ 2× echo"),
)


def goal_summary(ver: list[dict]) -> list[dict]:
    """Per goal: cells met / measured (None verdicts are not measured)."""
    out = []
    for key, label in VERDICT_KEYS:
        got = [v[key] for v in ver if v[key] is not None]
        out.append(
            {
                "goal": key,
                "label": label,
                "met": sum(got),
                "cells": len(got),
                "verdict": "not measured" if not got else ("met" if all(got) else "missed"),
            }
        )
    return out


def _fmt(v, spec: str = ",.0f") -> str:
    return "-" if v is None else format(v, spec)


def print_rows(rows: list[dict]) -> None:
    hdr = (
        f"{'backend':<8} {'routers':>7} {'window':>6} | {'lifecycles/s':>12} | "
        f"{'select p50 µs':>13} {'p99 µs':>9} | {'server CPU µs/lc':>16} {'router CPU':>10} {'load':>5}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['backend']:<8} {r['routers']:>7} {r['window']:>6} | {r['lifecycles_per_s']:>12,.0f} | "
            f"{_fmt(r['select_us_p50']):>13} {_fmt(r['select_us_p99']):>9} | "
            f"{_fmt(r['server_cpu_us_per_lifecycle'], ',.1f'):>16} "
            f"{_fmt(r.get('router_cpu_us_per_lifecycle'), ',.1f'):>10} "
            f"{r['loadavg_1m']:>5.2f}" + (f"  errors={r['errors']} ({r.get('exception', '')})" if r["errors"] else ""),
            flush=True,
        )


def print_verdicts(ver: list[dict]) -> None:
    def yn(b: bool | None) -> str:
        return "-" if b is None else ("met" if b else "MISS")

    print(
        f"{'routers':>7} {'window':>6} | {'/echo':>6} {'/redis':>7} {'/dynamo':>8} | {'p99/echo':>8} "
        f"{'cpu/echo':>8} | dynamo≥3x  redis     p99≤1.3x  cpu≤2x"
    )
    for v in ver:
        print(
            f"{v['routers']:>7} {v['window']:>6} | {_fmt(v['over_echo'], '.2f'):>6} {_fmt(v['over_redis'], '.2f'):>7} "
            f"{_fmt(v['over_dynamo'], '.2f'):>8} | {_fmt(v['p99_over_echo'], '.2f'):>8} "
            f"{_fmt(v['cpu_over_echo'], '.2f'):>8} | {yn(v['dynamo_3x']):<10} {yn(v['redis']):<9} "
            f"{yn(v['p99_1_3x_echo']):<9} {yn(v['cpu_2x_echo'])}"
        )
    for v in ver:
        if "baseline" in v:
            print(
                f"  {v['routers']}x{v['window']}: daemon vs {v['baseline']}: "
                f"lifecycles/s {v['daemon_lifecycles_per_s']:,.0f} "
                f"vs {v['baseline_lifecycles_per_s']:,.0f}, CPU µs/lc {_fmt(v['daemon_cpu_us'], '.1f')} vs "
                f"{_fmt(v['baseline_cpu_us'], '.1f')}, p99 µs "
                f"{_fmt(v['daemon_p99_us'])} vs {_fmt(v['baseline_p99_us'])}"
            )
    for g in goal_summary(ver):
        print(f"  {g['label']}: {g['met']} of {g['cells']} cells -> {g['verdict']}")


# ---------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="Router counts 1,8 × windows 1,8, 1 s cells, short in-process runs."
    )
    ap.add_argument("--routers", default=None, help="Comma-separated router counts (default 1,4,8,16; quick 1,8).")
    ap.add_argument(
        "--windows", default=None, help="Comma-separated in-flight windows per router (default 1,8,32; quick 1,8)."
    )
    ap.add_argument("--measure-s", type=float, default=None, help="Measured seconds per cell (default 3; quick 1).")
    ap.add_argument("--backends", default=",".join(BACKENDS), help=f"Comma-separated subset of {','.join(BACKENDS)}.")
    ap.add_argument("--no-redis", action="store_true", help="Skip the Redis rows.")
    ap.add_argument("--no-dynamo", action="store_true", help="Skip the Dynamo rows.")
    ap.add_argument("--no-inprocess", action="store_true", help="Skip the in-process core cost and long-prompt cell.")
    ap.add_argument(
        "--baseline",
        metavar="REV",
        default=None,
        help="Also run a daemon from the kvsched/ package of this git revision (backend daemon@REV).",
    )
    ap.add_argument(
        "--dynamo-threads", type=int, default=os.cpu_count() or 1, help="select_service --threads (default: nproc)."
    )
    ap.add_argument("--out", default=str(ROOT / "out" / "bench" / "transport.json"))
    return ap.parse_args(argv)


def inprocess(quick: bool) -> dict:
    """The core's cost per lifecycle and the long-prompt cell (`transport_core.py`), printed."""
    from transport_core import core_cost, long_prompt_cell

    core = core_cost(n=2000 if quick else 10_000, repeats=3 if quick else 5)
    print(
        f"in-process core ({core['source']}): {core['cpu_us_per_lifecycle']:.1f} µs CPU per lifecycle "
        f"(8 workers, 64 hashes, kv selector; goal ≤ {core['goal_us']:g} µs -> "
        f"{'met' if core['cpu_us_per_lifecycle'] <= core['goal_us'] else 'MISS'})",
        flush=True,
    )
    long = long_prompt_cell(n=60 if quick else 400)
    print(
        f"long prompts ({long['prompt_tokens']:,} tokens = {long['blocks']:,} blocks, {long['workers']} workers, "
        f"in process): {long['decisions_per_s']:,.0f} decisions/s, decision p50 {long['decision_us_p50']:,.0f} µs, "
        f"p99 {long['decision_us_p99']:,.0f} µs (no target)",
        flush=True,
    )
    return {"core": core, "long_prompt": long}


def main(argv=None) -> None:
    args = parse_args(argv)
    router_counts = [int(x) for x in (args.routers or ("1,8" if args.quick else "1,4,8,16")).split(",")]
    windows = [int(x) for x in (args.windows or ("1,8" if args.quick else "1,8,32")).split(",")]
    wanted = [b for b in args.backends.split(",") if b]
    measure_s = args.measure_s or (1.0 if args.quick else 3.0)
    warm_s = 0.5

    from kvsched.daemon.process import DaemonProcess
    from kvsched.shm.segments import unlink_segments

    tmp = Path(tempfile.mkdtemp(prefix="kvsched-bench-transport-"))
    (tmp / "daemon.toml").write_text(DAEMON_TOML)
    notes: list[str] = []
    t0 = time.perf_counter()
    extra = {} if args.no_inprocess else inprocess(args.quick)
    with tempfile.TemporaryDirectory() as cold_cache:
        ready_cold = start_to_ready(tmp, cold_cache) if not args.quick else None
    ready_warm = start_to_ready(tmp, None)
    print(f"daemon start-to-ready: cold numba cache {_fmt(ready_cold, '.2f')} s, warm cache {ready_warm:.2f} s")

    instance = f"bench-transport-{os.getpid()}"
    daemon = DaemonProcess.start(tmp / "daemon.toml", instance=instance, runtime_dir=tmp)
    echo_ep = f"ipc://{tmp}/echo.sock"
    echo = mp.get_context("spawn").Process(target=echo_server, args=(echo_ep, str(tmp / "echo.ready")), daemon=True)
    echo.start()
    redis_proc = dynamo_svc = None
    versions: dict[str, str] = {}
    if "redis" in wanted and not args.no_redis:
        redis_proc, redis_sock, versions["redis"] = start_redis(tmp)
    else:
        versions["redis"] = "Redis rows not requested"
    if "dynamo" in wanted and not args.no_dynamo:
        dynamo_svc, dynamo_url, versions["dynamo"] = start_dynamo(args.dynamo_threads)
    else:
        versions["dynamo"] = "Dynamo rows not requested"
    for name, proc in (("redis", redis_proc), ("dynamo", dynamo_svc)):
        if proc is None:
            notes.append(versions[name])
            print(versions[name])
    while not (tmp / "echo.ready").exists():
        time.sleep(0.02)
    backends = [("echo", echo_ep, echo.pid), ("daemon", daemon.endpoint, daemon.pid)]
    if redis_proc is not None:
        backends.append(("redis", redis_sock, redis_proc.pid))
    if dynamo_svc is not None:
        backends.append(("dynamo", dynamo_url, dynamo_svc.proc.pid))
    backends = [b for b in backends if b[0] in wanted]
    base = None
    if args.baseline:
        base, base_instance, base_commit = start_baseline_daemon(args.baseline, tmp)
        backends.insert(
            backends.index(next(b for b in backends if b[0] == "daemon")) + 1,
            (f"daemon@{base_commit}", base.endpoint, base.pid),
        )
        notes.append(f"daemon@{base_commit}: the daemon of revision {args.baseline} ({base_commit}), same run")
    rows: list[dict] = []
    try:
        for n in router_counts:
            routers = Routers(n)
            try:
                if any(b[0] == "dynamo" for b in backends):
                    routers.build_tokens()
                for w in windows:
                    for name, ep, pid in backends:
                        rows.append(routers.run(name, ep, w, pid, warm_s, measure_s, f"{name}{n}x{w}"))
                        print_rows(rows[-1:])
            finally:
                routers.close()
    finally:
        daemon.stop()
        unlink_segments(instance)
        if base is not None:
            base.stop()
            unlink_segments(base_instance)
        if echo.is_alive():
            echo.terminate()
            echo.join(5)
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)
        if dynamo_svc is not None:
            dynamo_svc.stop()
    print()
    print_rows(rows)
    ver = verdicts(rows)
    print()
    print_verdicts(ver)
    import msgspec
    import numpy as np
    import zmq

    meta = {
        "workers": WORKERS,
        "isl_tokens": ISL,
        "block_size": BLOCK,
        "hashes_per_request": N_HASHES,
        "frames_per_lifecycle": FRAMES_PER_LIFECYCLE,
        "measure_s": measure_s,
        "warm_s": warm_s,
        "quick": args.quick,
        "redis": versions["redis"],
        "dynamo": versions["dynamo"],
        "notes": notes,
        "daemon_start_to_ready_cold_s": ready_cold and round(ready_cold, 2),
        "daemon_start_to_ready_warm_s": round(ready_warm, 2),
        "goals": GOALS,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "msgspec": msgspec.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "nproc": os.cpu_count(),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"meta": meta, "rows": rows, "verdicts": ver, "goal_summary": goal_summary(ver), **extra}, indent=1)
    )
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
