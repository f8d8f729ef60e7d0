"""KV-cache events: ingest rate, overlap-kernel cost, and what events buy in cache hits (docs/DESIGN.md §6).

1. **Ingest**: a real `kvsched-daemon` subscribed to one `KvEventPublisher` (ipc); the publisher sends
   N batches of one BlockStored of 16 blocks each (fresh hashes), as fast as the daemon applies them
   (closed loop: at most ~2000 batches outstanding, so no socket queue overflows), while a router
   thread schedules and releases requests through the same daemon. Figures: events (= batches) and
   blocks applied per second (time until the daemon's `kv_events_applied + _replayed` counters
   reach N; PUB drops past its HWM are recovered through the replay ROUTER), and the router's
   decisions/s and p50/p99 schedule round trip during ingest vs. with the publisher idle.
2. **Overlap kernel**: `OverlapIndex.depth` (numba) vs a pure-Python dict version
   (hash -> set of rows, prefix walk) on the same contents, for W workers x prefix depth D blocks
   (worker w holds the first (w+1)*D/W blocks of the query), measured in the same run.
3. **Cache hits**: the conversation trace through the virtual driver with overlap mode events vs
   approx vs none (kv selector): prompt tokens served from the engines' caches / prompt tokens.

Usage: python bench/bench_kv_events.py [--quick] [--trace PATH]  ->  table on stdout, out/bench/kv_events.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from functools import partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NUMBA_CACHE_DIR", str(ROOT / ".numba-cache"))

from kvsched.shm.overlap import OverlapIndex

BLOCKS_PER_BATCH = 16
WINDOW = 1000  # batches published per window of the closed-loop ingest


# ---------------------------------------------------------------------------- 1. ingest
def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    m = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _router(endpoint: str, stop: threading.Event, lat: list[tuple[float, float]]) -> None:
    """Schedule + release back to back; appends (finish time, round trip µs) per decision."""
    from kvsched.client.sync import SyncSchedulerClient

    rng = np.random.default_rng(1)
    with SyncSchedulerClient(endpoint) as client:
        i = 0
        while not stop.is_set():
            hashes = rng.integers(1, 2**63, 32, dtype=np.uint64)
            t = time.perf_counter()
            lease = client.schedule(f"b{i}", 32 * 16, hashes)
            now = time.perf_counter()
            lat.append((now, (now - t) * 1e6))
            lease.release("completed")
            i += 1


def _window(lat: list[tuple[float, float]], t0: float, t1: float) -> dict:
    a = np.array([us for t, us in lat if t0 <= t < t1] or [0.0])
    n = sum(1 for t, _ in lat if t0 <= t < t1)
    return {
        "decisions_per_s": round(n / max(t1 - t0, 1e-9), 1),
        "p50_us": round(float(np.percentile(a, 50)), 1),
        "p99_us": round(float(np.percentile(a, 99)), 1),
    }


def bench_ingest(n_batches: int) -> dict:
    import zmq

    from kvsched.daemon.process import DaemonProcess
    from kvsched.sim.kv_publisher import KvEventPublisher

    d = Path(tempfile.mkdtemp(prefix="kvbench", dir="/tmp"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ev, rp = f"ipc://{d}/ev", f"ipc://{d}/rp"
    (d / "cfg.toml").write_text(f"""
[daemon]
block_size = 16
max_workers = 8
metrics_port = {port}
[[workers]]
worker_id = 0
kv_events_endpoint = "{ev}"
kv_replay_endpoint = "{rp}"
[[workers]]
worker_id = 1
""")
    ctx = zmq.Context()
    pub = KvEventPublisher(ctx, ev, rp, buffer_steps=n_batches + 16)
    pub.pub.setsockopt(zmq.SNDHWM, 100_000)
    daemon = DaemonProcess.start(d / "cfg.toml", instance=f"kvbench-{os.getpid()}", runtime_dir=d)
    try:
        pub.block_stored([1], None)
        pub.flush()  # first contact: the daemon subscribes and replays seq 0
        deadline = time.monotonic() + 10
        while _metric(port, "kvsched_kv_events_applied") + _metric(port, "kvsched_kv_events_replayed") < 1:
            pub.service_replay()
            if time.monotonic() > deadline:
                raise RuntimeError("daemon did not pick up the first KV event")
            time.sleep(0.01)
        lat: list[tuple[float, float]] = []
        stop = threading.Event()
        router = threading.Thread(target=_router, args=(daemon.endpoint, stop, lat), daemon=True)
        router.start()
        while len(lat) < 50:  # connected and warm
            time.sleep(0.01)
        t_idle = time.perf_counter()
        time.sleep(2.0)
        t_start = time.perf_counter()
        base = 2  # hashes already used
        for b in range(n_batches):
            h0 = base + b * BLOCKS_PER_BATCH
            pub.block_stored(range(h0, h0 + BLOCKS_PER_BATCH), h0 - 1)
            pub.flush()
            if b % WINDOW == WINDOW - 1:  # closed loop: at most ~2 windows outstanding (no HWM drops)
                while (
                    _metric(port, "kvsched_kv_events_applied") + _metric(port, "kvsched_kv_events_replayed")
                    < b - WINDOW
                ):
                    pub.service_replay()
                    time.sleep(0.02)  # each poll is a /metrics scrape, which costs the daemon CPU
        sent_s = time.perf_counter() - t_start
        while _metric(port, "kvsched_kv_events_applied") + _metric(port, "kvsched_kv_events_replayed") < n_batches + 1:
            pub.service_replay()
            if time.perf_counter() - t_start > 120:
                break
            time.sleep(0.005)
        t_end = time.perf_counter()
        stop.set()
        router.join(10)
        done_s = t_end - t_start
        applied = _metric(port, "kvsched_kv_events_applied") + _metric(port, "kvsched_kv_events_replayed") - 1
        idle = _window(lat, t_idle, t_start)
        busy = _window(lat, t_start, t_end)
        busy["extra"] = {
            "batches": n_batches,
            "applied": int(applied),
            "send_s": round(sent_s, 3),
            "ingest_s": round(done_s, 3),
            "replayed": int(_metric(port, "kvsched_kv_events_replayed")),
            "events_per_s": round(applied / done_s, 0),
            "blocks_per_s": round(applied * BLOCKS_PER_BATCH / done_s, 0),
        }
        return {"idle_router": idle, "during_ingest": busy}
    finally:
        daemon.stop(timeout_s=10)
        pub.close()
        ctx.destroy(linger=0)
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------- 2. kernel
def _dict_depth(index: dict[int, set[int]], hashes: list[int], n_rows: int) -> list[int]:
    """Pure-Python twin: prefix depth per row from a hash -> set-of-rows dict."""
    out = [0] * n_rows
    alive = set(range(n_rows))
    for k, h in enumerate(hashes):
        holders = index.get(h, ())
        for r in [r for r in alive if r not in holders]:
            out[r] = k
            alive.discard(r)
        if not alive:
            return out
    for r in alive:
        out[r] = len(hashes)
    return out


def _timeit(fn, min_s: float = 0.2) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return dt / n * 1e6


def bench_kernel(workers_list, depths) -> list[dict]:
    rows = []
    for w in workers_list:
        for depth in depths:
            query = np.arange(1, depth + 1, dtype=np.uint64)
            idx = OverlapIndex(w, 1 << max(12, int(np.ceil(np.log2(depth * 4)))))
            py: dict[int, set[int]] = {}
            for r in range(w):
                held = query[: (r + 1) * depth // w]
                idx.insert(held, r, 0, None)
                for h in held.tolist():
                    py.setdefault(h, set()).add(r)
            out = np.zeros(w, np.int32)
            qlist = query.tolist()
            idx.depth(query, 1, out)
            assert out.tolist() == _dict_depth(py, qlist, w)
            k_us = _timeit(partial(idx.depth, query, 1, out))
            p_us = _timeit(partial(_dict_depth, py, qlist, w))
            rows.append(
                {
                    "workers": w,
                    "depth_blocks": depth,
                    "kernel_us": round(k_us, 2),
                    "dict_us": round(p_us, 2),
                    "speedup": round(p_us / k_us, 1),
                }
            )
    return rows


# ---------------------------------------------------------------------------- 3. cache hits
def bench_hits(trace_path: str, workers: int, limit: int | None) -> list[dict]:
    from kvsched.sim.replay import ReplayOptions, fleet_spec_for
    from kvsched.sim.trace import load_trace
    from kvsched.sim.virtual import run_virtual

    trace = load_trace(trace_path, limit)
    spec = fleet_spec_for(ReplayOptions(trace=Path(trace_path), workers=workers), trace)
    rows = []
    for mode in ("events", "approx", "none"):
        t = time.perf_counter()
        run = run_virtual(trace, spec, overlap_mode=mode)
        done = [r for r in run.results if r.outcome == "completed"]
        prompt = sum(r.isl for r in done)
        cached = sum(r.cached_tokens for r in done)
        predicted = sum(r.predicted_cached_tokens for r in done)
        ttft = np.array([r.ttft_us for r in done], dtype=float) / 1e3
        rows.append(
            {
                "mode": mode,
                "requests": len(run.results),
                "completed": len(done),
                "hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
                "predicted_hit_ratio": round(predicted / prompt, 4) if prompt else 0.0,
                "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1) if len(ttft) else None,
                "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 1) if len(ttft) else None,
                "evicted_blocks": sum(e.stats.evicted_blocks for e in run.engines.values()),
                "wall_s": round(time.perf_counter() - t, 1),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Fewer batches, smaller grid, trace slice.")
    parser.add_argument(
        "--trace",
        default=None,
        help="Conversation trace (default: bench/data/conversation_trace.jsonl; --quick: the package's bundled slice).",
    )
    parser.add_argument("--workers", type=int, default=8, help="Simulated engines for the cache-hit run.")
    parser.add_argument("--out", default=str(ROOT / "out" / "bench" / "kv_events.json"))
    args = parser.parse_args()
    trace = args.trace
    if trace is None:
        full = ROOT / "bench" / "data" / "conversation_trace.jsonl"
        trace = (
            str(full) if full.exists() and not args.quick else str(ROOT / "kvsched" / "data" / "mooncake_slice.jsonl")
        )

    from kvsched.shm.warm import warm_kernels

    warm_kernels()
    ingest = bench_ingest(5_000 if args.quick else 50_000)
    i, b = ingest["idle_router"], ingest["during_ingest"]
    e = b["extra"]
    print(f"1. KV-event ingest (batches of {BLOCKS_PER_BATCH} blocks) while scheduling")
    print(
        f"   {e['applied']}/{e['batches']} events in {e['ingest_s']} s (publisher sent in {e['send_s']} s, "
        f"{e['replayed']} recovered by replay): {e['events_per_s']:.0f} events/s = {e['blocks_per_s']:.0f} blocks/s"
    )
    print(f"   {'router':<18}{'decisions/s':>12}{'p50 µs':>10}{'p99 µs':>10}")
    print(f"   {'idle publisher':<18}{i['decisions_per_s']:>12}{i['p50_us']:>10}{i['p99_us']:>10}")
    print(f"   {'during ingest':<18}{b['decisions_per_s']:>12}{b['p50_us']:>10}{b['p99_us']:>10}")

    grid = bench_kernel((8, 64) if args.quick else (8, 64, 256), (8, 64) if args.quick else (8, 64, 512))
    print("\n2. Overlap depth: numba OverlapIndex vs pure-Python dict (same contents, same run)")
    print(f"   {'workers':>8}{'depth':>8}{'kernel µs':>12}{'dict µs':>12}{'dict/kernel':>13}")
    for r in grid:
        print(f"   {r['workers']:>8}{r['depth_blocks']:>8}{r['kernel_us']:>12}{r['dict_us']:>12}{r['speedup']:>13}")

    hits = bench_hits(trace, args.workers, 1500 if args.quick else None)
    print(f"\n3. Cache hits, {Path(trace).name}, {args.workers} workers, virtual driver, kv selector")
    print(
        f"   {'index':<8}{'completed':>10}{'hit ratio':>11}{'predicted':>11}"
        f"{'TTFT p50 ms':>13}{'p99 ms':>10}{'evicted':>10}"
    )
    for r in hits:
        print(
            f"   {r['mode']:<8}{r['completed']:>10}{r['hit_ratio']:>11}{r['predicted_hit_ratio']:>11}"
            f"{r['ttft_p50_ms']:>13}{r['ttft_p99_ms']:>10}{r['evicted_blocks']:>10}"
        )

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "trace": trace,
        "workers": args.workers,
        "quick": args.quick,
    }
    out.write_text(json.dumps({"meta": meta, "ingest": ingest, "overlap_kernel": grid, "cache_hits": hits}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
