"""What the gateway adds: the same HTTP client, the same requests, straight to the engines vs
through `kvsched-gateway` + daemon, in one run.

Stack: a real daemon, two `kvsched-sim-engine` processes (sped up so the engine's own time is close
to its Python overhead) and one gateway process (`LocalFleet`). The client is one process with
`--concurrency` streaming chat requests in flight (aiohttp), each a 256-token prompt drawn from 32
shared prefixes, `max_tokens` 16, streamed. Direct mode sends each request to the engines
round-robin; gateway mode sends it to the gateway, which schedules it and forwards it. The two modes
run in interleaved blocks (direct, gateway, direct, ... `ROUNDS` each) so a change in the machine's
load during the run affects both.

Figures per mode: time to first token and to the last byte (ms, p50 / p99), requests/s; then the
added latency = gateway - direct at p50 and p99 (distributions compared, not requests paired), the
gateway process's CPU per request (µs, /proc), and the gateway's own split of each request from its
`Server-Timing` header (prep = parse + tokenize + hash, schedule = the daemon's answer, queue = the
part of it spent in the daemon's queue, engine = the engine's response headers; ms). Goal: <= 2 ms added at p50,
<= 5 ms at p99 at 50 concurrent streams.

With `--compare-ref REF` a second gateway process runs the `kvsched` package of git REF (e.g. the
commit before a gateway change) against the same daemon and engines, as a third interleaved mode:
before and after in one run, under the same load. CPU per request (process CPU time / requests,
all threads) is the figure least disturbed by other jobs on a shared machine.

With `--workers N` one more gateway runs as `kvsched-gateway --workers N` (N processes sharing its
listening socket, each a router of the daemon), as another interleaved mode; its CPU per
request sums the supervisor and its workers.

Usage: python bench/bench_gateway.py [--quick] [--requests N] [--concurrency C] [--workers N] [--compare-ref REF]
       -> table, out/bench/gateway.json (out/bench/quick/ with --quick)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT_WORDS = 256
N_PREFIXES = 32
PREFIX_WORDS = 192
MAX_TOKENS = 16
ROUNDS = 6  # interleaved direct / gateway blocks


def prompt(i: int) -> str:
    p = i % N_PREFIXES
    head = " ".join(f"w{(p * PREFIX_WORDS + k) % 1900}" for k in range(PREFIX_WORDS))
    tail = " ".join(f"w{(i * 7 + k) % 1900}" for k in range(PROMPT_WORDS - PREFIX_WORDS))
    return head + " " + tail


async def one(session, url: str, i: int) -> tuple[float, float, bool, dict[str, float]]:
    """One streamed chat: (TTFT s, whole request s, complete?, the gateway's Server-Timing in ms)."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": prompt(i)}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft = None
    ok = False
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            await resp.read()
            return 0.0, 0.0, False, {}
        timing = {}
        for part in resp.headers.get("Server-Timing", "").split(","):
            name, _, dur = part.strip().partition(";dur=")
            if dur:
                timing[name] = float(dur)
        async for line in resp.content:
            if ttft is None and line.startswith(b"data: "):
                ttft = time.perf_counter() - t0
            if line.startswith(b"data: [DONE]"):
                ok = True
    return (ttft or 0.0), time.perf_counter() - t0, ok, timing


async def run_mode(urls: list[str], n: int, concurrency: int, start: int, acc: dict | None = None) -> dict:
    """`n` requests, `concurrency` in flight; latencies appended to `acc` ({"ttft", "total", "failed",
    "elapsed"}) when given, so interleaved blocks of one mode add up."""
    import aiohttp

    ttfts, totals, fails = [], [], 0
    timings: dict[str, list[float]] = {}
    next_i = start
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def worker() -> None:
            nonlocal next_i, fails
            while next_i < start + n:
                i = next_i
                next_i += 1
                ttft, total, ok, timing = await one(s, urls[i % len(urls)], i)
                if ok:
                    ttfts.append(ttft)
                    totals.append(total)
                    for k, v in timing.items():
                        timings.setdefault(k, []).append(v)
                else:
                    fails += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    if acc is not None:
        for k, v in timings.items():
            acc.setdefault("timing", {}).setdefault(k, []).extend(v)
        timings = acc.get("timing", {})
        acc["ttft"] += ttfts
        acc["total"] += totals
        acc["failed"] += fails
        acc["elapsed"] += elapsed
        ttfts, totals, fails, elapsed, n = (
            acc["ttft"],
            acc["total"],
            acc["failed"],
            acc["elapsed"],
            len(acc["total"]) + acc["failed"],
        )

    def ms(a: list[float], q: float) -> float:
        return float(np.percentile(np.asarray(a) * 1e3, q)) if a else float("nan")

    out = {
        "requests": n,
        "failed": fails,
        "elapsed_s": elapsed,
        "requests_per_s": len(totals) / elapsed,
        "ttft_p50_ms": ms(ttfts, 50),
        "ttft_p99_ms": ms(ttfts, 99),
        "total_p50_ms": ms(totals, 50),
        "total_p99_ms": ms(totals, 99),
    }
    for k, v in timings.items():  # the gateway's own split (Server-Timing, ms)
        out[f"gw_{k}_p50_ms"] = float(np.percentile(v, 50))
        out[f"gw_{k}_p99_ms"] = float(np.percentile(v, 99))
    return out


def cpu_s(pid: int) -> float:
    """CPU time (s, user + system, all threads) of `pid` and of its child processes (the workers of
    `kvsched-gateway --workers N` are children of its supervisor)."""
    total = 0.0
    for q in [pid, *_children(pid)]:
        try:
            fields = Path(f"/proc/{q}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _archive(ref: str, dest: Path) -> Path:
    """The `kvsched` package of git `ref` extracted under `dest` (for `--compare-ref`)."""
    import subprocess

    dest.mkdir(parents=True, exist_ok=True)
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "kvsched"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True)
    return dest


def main() -> None:
    global MAX_TOKENS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests, out/bench/quick/")
    ap.add_argument("--requests", type=int, default=0, help="requests per mode (default 3000, quick 600)")
    ap.add_argument("--concurrency", type=int, default=50, help="streams in flight (default 50)")
    ap.add_argument("--speedup", type=float, default=1000.0, help="sim engines' speedup (default 1000)")
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=MAX_TOKENS,
        help=f"output tokens per request, one streamed chunk each (default {MAX_TOKENS})",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=0,
        metavar="N",
        help="also run `kvsched-gateway --workers N` (N processes on one listening socket) as another interleaved mode",
    )
    ap.add_argument(
        "--compare-ref",
        metavar="REF",
        help="also run a gateway from git REF's kvsched package "
        "(same daemon, so REF must speak this protocol), interleaved with the others: before/after "
        "of a gateway change in one run",
    )
    args = ap.parse_args()
    n = args.requests or (600 if args.quick else 3000)
    MAX_TOKENS = args.max_tokens
    from kvsched.gateway.local_fleet import LocalFleet

    out_dir = ROOT / "out" / "bench" / ("quick" if args.quick else "")
    out_dir.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        fleet = LocalFleet.start(tmp, n_engines=2, n_gateways=1, speedup=args.speedup, total_kv_blocks=20000)
        try:
            engines = [e.url for e in fleet.engines]
            # mode -> (urls, gateway process or None)
            modes = {"direct": (engines, None), "gateway": ([fleet.gateway_urls[0]], fleet.gateways[0])}
            if args.workers > 1:
                url = fleet.add_gateway(extra=f"workers = {args.workers}")
                modes[f"gateway x{args.workers}"] = ([url], fleet.gateways[-1])
            if args.compare_ref:
                url = fleet.add_gateway(_archive(args.compare_ref, Path(tmp) / "ref"))
                modes[f"gateway@{args.compare_ref}"] = ([url], fleet.gateways[-1])
            for urls, _ in modes.values():  # warm-up, every path
                asyncio.run(run_mode(urls, 200, args.concurrency, 10_000_000))
            # Interleaved blocks (direct, gateway, [gateway@ref,] direct, ...) so drift in the machine's
            # load hits every mode.
            acc = {m: {"ttft": [], "total": [], "failed": 0, "elapsed": 0.0} for m in modes}
            cpu = dict.fromkeys(modes, 0.0)
            res: dict[str, dict] = {}
            per = max(args.concurrency * 2, n // ROUNDS)
            for r in range(ROUNDS):
                for m, (urls, proc) in modes.items():
                    c0 = cpu_s(proc.pid) if proc else 0.0
                    res[m] = asyncio.run(run_mode(urls, per, args.concurrency, r * per, acc[m]))
                    cpu[m] += (cpu_s(proc.pid) - c0) if proc else 0.0
            for m, (_, proc) in modes.items():
                if proc:
                    res[m]["gateway_cpu_us_per_request"] = cpu[m] / (per * ROUNDS) * 1e6
        finally:
            fleet.stop()
    direct = res["direct"]
    added = {
        m: {k: r[f"{k}_ms"] - direct[f"{k}_ms"] for k in ("ttft_p50", "ttft_p99", "total_p50", "total_p99")}
        for m, r in res.items()
        if m != "direct"
    }
    result = {
        "meta": {
            "requests_per_mode": n,
            "concurrency": args.concurrency,
            "max_tokens": MAX_TOKENS,
            "prompt_tokens": PROMPT_WORDS + 3,
            "engines": 2,
            "speedup": args.speedup,
            "cpus": os.cpu_count(),
            "load_avg_1m_start": load_start,
            "load_avg_1m": os.getloadavg()[0],
            "python": platform.python_version(),
            "compare_ref": args.compare_ref,
            "workers": args.workers,
        },
        **res,
        "rounds": ROUNDS,
        "added_ms": added["gateway"],
        "added_ms_by_mode": added,
        "goal": {"added_p50_ms": 2.0, "added_p99_ms": 5.0},
    }
    (out_dir / "gateway.json").write_text(json.dumps(result, indent=1))
    w = max(len(m) for m in res) + 2
    print(
        f"{'mode':<{w}}{'req/s':>8}{'ttft p50':>10}{'ttft p99':>10}{'total p50':>11}{'total p99':>11}"
        f"{'CPU/req':>10}  (ms; CPU µs)"
    )
    for m, r in res.items():
        c = r.get("gateway_cpu_us_per_request")
        print(
            f"{m:<{w}}{r['requests_per_s']:>8.0f}{r['ttft_p50_ms']:>10.2f}{r['ttft_p99_ms']:>10.2f}"
            f"{r['total_p50_ms']:>11.2f}{r['total_p99_ms']:>11.2f}{'' if c is None else f'{c:.0f}':>10}"
            f"   failed={r['failed']}"
        )
    for m, r in res.items():
        if "gw_schedule_p50_ms" in r:
            print(
                f"{m}: inside the gateway (Server-Timing, ms p50 / p99): "
                + ", ".join(
                    f"{k} {r[f'gw_{k}_p50_ms']:.2f} / {r[f'gw_{k}_p99_ms']:.2f}"
                    for k in ("prep", "schedule", "queue", "engine")
                    if f"gw_{k}_p50_ms" in r
                )
            )
    for m, a in added.items():
        print(
            f"added by {m} + daemon: ttft p50 {a['ttft_p50']:+.2f} ms, p99 {a['ttft_p99']:+.2f} ms; "
            f"total p50 {a['total_p50']:+.2f} ms, p99 {a['total_p99']:+.2f} ms"
        )
    print(f"load avg (1 min) {load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    print(f"-> {out_dir / 'gateway.json'}")


if __name__ == "__main__":
    main()
