"""Transport ceiling vs the daemon vs what users would pick instead, side by side in one run.

One lifecycle = Enqueue → reply, dispatched, prefill_done, Release(completed). On the daemon's wire
(protocol version 2, local routers) that is 2 frames in (Enqueue, Release) and 1 out: dispatched and
prefill_done are stores into the slot's shared-memory state word, and the frames a router's coroutines
send within one event-loop turn travel as one `Batch` message (replies of one wake as one `Replies`).
Backends, all driven by the same long-lived router processes in the same run:

* `echo` — a ZeroMQ ROUTER with the daemon's own I/O pattern (FD on uvloop's `add_reader`, NOBLOCK
  drain with a budget of 512 frames per wake, replies of a wake in one message per peer) that decodes
  every frame with the daemon's decoders (`Batch` unpacked) and answers each Enqueue with an
  `Admitted`-shaped frame: everything but the scheduling. The routers send the daemon client's frames
  over a DEALER (same encoder, same bytes, one `Batch` per loop turn): 2 in, 1 out per lifecycle.
* `daemon` — `kvsched-daemon` (8 workers) doing full lifecycles; routers use the real
  `SchedulerClient` and leases (state words, version-2 batching).
* `redis` — a `redis-server` the bench starts (loopback, persistence off; clients on its unix
  socket, like the daemon's ipc://) holding the same per-worker arrays as hashes: select-and-reserve
  and prefill_done and release are Lua scripts (EVALSHA), dispatched an HSET; redis-py asyncio with
  hiredis, one awaited command per frame (RESP has no fire-and-forget).
* `ray` — a detached named actor holding the same arrays: only if Ray is installed (it is not
  installed by this bench; the row is skipped with the reason).

Grid: 1, 4, 8, 16 router processes × in-flight windows (coroutines per router). Figures: lifecycles/s,
frames/s (3 per lifecycle, both directions), select/admission latency p50/p99 (router side, µs),
server CPU per lifecycle (µs, from /proc), and the ratios daemon / echo and daemon / redis. Also:
daemon start-to-ready time with a cold and a warm numba cache.

Usage: python bench/bench_transport.py [--quick]  ->  tables, out/bench/transport.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ISL = 1024  # prompt tokens per request
BLOCK = 16  # tokens per block
N_HASHES = 64  # hashes per request (ISL / BLOCK)
PREFIX_BLOCKS = 16  # of which a shared "system prompt" prefix
N_PREFIXES = 32
N_SEQUENCES = 4096  # distinct requests cycled through by each router
WORKERS = 8
FRAME_BUDGET = 512  # the daemon's default frame_budget_per_wake
FRAMES_PER_LIFECYCLE = 3  # Enqueue + Release in, Admitted out (dispatched / prefill_done: shared-memory stores)
CDF_POINTS = 200
DAEMON_TOML = f"""
[daemon]
block_size = {BLOCK}
max_workers = {WORKERS}
max_slots = 16384
max_blocks_per_request = {N_HASHES}
liveness_timeout_ms = 5000

[selector]
seed = 0
""" + "".join(f"""
[[workers]]
worker_id = {w}
total_kv_blocks = 1000000
max_num_batched_tokens = 100000000
""" for w in range(WORKERS))

# ---------------------------------------------------------------------------- Redis Lua scripts
# Per-worker hash w:<i> {blocks, prefill, requests}; per-request hash q:<rid> {w, blocks, prefill}.
# Cost = the selection cost of docs/DESIGN.md §4.12 without the overlap credit (no prefix index in Redis):
# prefill/B + isl/B + blocks + n.
LUA_RESERVE = """
local n, isl, nb, bs = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local best, best_cost = -1, nil
for i = 0, n - 1 do
  local v = redis.call('HMGET', 'w:' .. i, 'blocks', 'prefill')
  local cost = ((tonumber(v[2]) or 0) + isl) / bs + (tonumber(v[1]) or 0) + nb
  if best_cost == nil or cost < best_cost then best, best_cost = i, cost end
end
local w = 'w:' .. best
redis.call('HINCRBY', w, 'blocks', nb)
redis.call('HINCRBY', w, 'prefill', isl)
redis.call('HINCRBY', w, 'requests', 1)
redis.call('HSET', 'q:' .. ARGV[1], 'w', best, 'blocks', nb, 'prefill', isl)
return best
"""
LUA_PREFILL_DONE = """
local v = redis.call('HMGET', 'q:' .. ARGV[1], 'w', 'prefill')
if not v[1] then return 0 end
redis.call('HINCRBY', 'w:' .. v[1], 'prefill', 0 - tonumber(v[2]))
redis.call('HSET', 'q:' .. ARGV[1], 'prefill', 0)
return 1
"""
LUA_RELEASE = """
local v = redis.call('HMGET', 'q:' .. ARGV[1], 'w', 'blocks', 'prefill')
if not v[1] then return 0 end
local w = 'w:' .. v[1]
redis.call('HINCRBY', w, 'blocks', 0 - tonumber(v[2]))
redis.call('HINCRBY', w, 'prefill', 0 - tonumber(v[3]))
redis.call('HINCRBY', w, 'requests', -1)
redis.call('DEL', 'q:' .. ARGV[1])
return 1
"""


def request_hashes(i: int) -> bytes:
    """The block hashes of sequence `i` (little-endian u64 bytes): a shared prefix + a unique suffix."""
    import numpy as np

    g = i % N_PREFIXES
    prefix = np.arange(g * 1000 + 1, g * 1000 + 1 + PREFIX_BLOCKS, dtype="<u8")
    base = 10**9 + i * N_HASHES
    suffix = np.arange(base, base + N_HASHES - PREFIX_BLOCKS, dtype="<u8")
    return np.concatenate([prefix, suffix]).tobytes()


# ---------------------------------------------------------------------------- echo server
def echo_server(endpoint: str, ready_path: str) -> None:
    """ROUTER with the daemon's I/O pattern; answers each Enqueue with an Admitted-shaped frame."""
    import uvloop
    import zmq

    from kvsched import protocol as p

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.bind(endpoint)
        enc, dec, inner = p.make_encoder(), p.make_router_decoder(), p.make_batched_router_decoder()
        done = loop.create_future()
        slot = [0]

        def on_readable() -> None:
            replies: dict[bytes, list[bytes]] = {}
            n = 0
            while n < FRAME_BUDGET:
                try:
                    identity, payload = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                frame = dec.decode(payload)
                frames = [inner.decode(r) for r in frame.frames] if isinstance(frame, p.Batch) else [frame]
                n += len(frames)
                for f in frames:
                    if isinstance(f, p.Enqueue):
                        slot[0] = (slot[0] + 1) & 0xFFFF
                        replies.setdefault(identity, []).append(enc.encode(p.Admitted(f.request_id, slot[0] % WORKERS, 0, slot[0], 1, 0, 0, 0)))
            for identity, raws in replies.items():
                sock.send_multipart((identity, raws[0] if len(raws) == 1 else p.encode_replies(raws)), zmq.NOBLOCK)
            if n == FRAME_BUDGET or sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                loop.call_soon(on_readable)

        loop.add_reader(sock.getsockopt(zmq.FD), on_readable)
        loop.add_signal_handler(15, done.set_result, None)
        Path(ready_path).write_text("ready")
        await done
        sock.close(0)
        ctx.term()

    uvloop.run(main())


# ---------------------------------------------------------------------------- router side
class EchoBackend:
    """A DEALER sending the daemon client's exact frames; one future per waiting Enqueue."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    async def open(self) -> None:
        import zmq

        from kvsched import protocol as p

        self.p = p
        self.zmq = zmq
        self.loop = asyncio.get_running_loop()
        self.ctx = zmq.Context()
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.setsockopt(zmq.RCVHWM, 100_000)
        s.connect(self.endpoint)
        self.sock = s
        self.enc, self.dec, self.inner = p.make_encoder(), p.make_daemon_decoder(), p.make_replied_daemon_decoder()
        self.waiting: dict[str, asyncio.Future] = {}
        self.out: list[bytes] = []
        self.loop.add_reader(s.getsockopt(zmq.FD), self._on_readable)

    def _on_readable(self) -> None:
        zmq = self.zmq
        while True:
            try:
                raw = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            frame = self.dec.decode(raw)
            for f in [self.inner.decode(r) for r in frame.frames] if isinstance(frame, self.p.Replies) else [frame]:
                fut = self.waiting.pop(f.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(f)

    def _send(self, frame) -> None:
        """Like the client's link: the frames of one loop turn go out as one Batch (a lone one as is)."""
        self.out.append(self.enc.encode(frame))
        if len(self.out) == 1:
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        out, self.out = self.out, []
        self.sock.send(out[0] if len(out) == 1 else self.p.encode_batch(out), self.zmq.NOBLOCK)
        if self.sock.getsockopt(self.zmq.EVENTS) & self.zmq.POLLIN:  # edge-triggered FD: re-check
            self.loop.call_soon(self._on_readable)

    async def lifecycle(self, rid: str, hashes: bytes) -> float:
        p = self.p
        fut = self.loop.create_future()
        self.waiting[rid] = fut
        t0 = time.perf_counter_ns()
        self._send(p.Enqueue(rid, ISL, hashes))
        a = await fut
        lat = (time.perf_counter_ns() - t0) / 1000.0
        self._send(p.Release(rid, a.slot, a.generation, "completed", ISL))  # dispatched / prefill_done: stores
        return lat

    async def close(self) -> None:
        self.loop.remove_reader(self.sock.getsockopt(self.zmq.FD))
        self.sock.close(0)
        self.ctx.term()


class DaemonBackend:
    """The real `SchedulerClient` and leases."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    async def open(self) -> None:
        from kvsched.client import SchedulerClient

        self.client = SchedulerClient(self.endpoint, client_name=f"bench-{os.getpid()}")
        await self.client.connect()

    async def lifecycle(self, rid: str, hashes: bytes) -> float:
        t0 = time.perf_counter_ns()
        lease = await self.client.schedule(rid, ISL, hashes)
        lat = (time.perf_counter_ns() - t0) / 1000.0
        lease.dispatched()
        lease.prefill_done()
        lease.release("completed")
        return lat

    async def close(self) -> None:
        await self.client.close()


class RedisBackend:
    """redis-py asyncio (hiredis parser) over the unix socket; one awaited command per frame."""

    def __init__(self, endpoint: str, window: int) -> None:
        self.endpoint, self.window = endpoint, window

    async def open(self) -> None:
        import redis.asyncio as aredis

        self.r = aredis.Redis(unix_socket_path=self.endpoint, max_connections=max(1, self.window))
        self.reserve = self.r.register_script(LUA_RESERVE)
        self.prefill_done = self.r.register_script(LUA_PREFILL_DONE)
        self.release = self.r.register_script(LUA_RELEASE)
        await self.r.ping()

    async def lifecycle(self, rid: str, hashes: bytes) -> float:
        t0 = time.perf_counter_ns()
        await self.reserve(args=[rid, WORKERS, ISL, N_HASHES, BLOCK])
        lat = (time.perf_counter_ns() - t0) / 1000.0
        await self.r.hset("q:" + rid, "state", "dispatched")
        await self.prefill_done(args=[rid])
        await self.release(args=[rid])
        return lat

    async def close(self) -> None:
        await self.r.aclose()


async def session(cmd: dict, idx: int, hashes: list[bytes]) -> dict:
    """One measured run of one router process: `window` coroutines doing lifecycles back to back."""
    kind = cmd["backend"]
    if kind == "echo":
        backend = EchoBackend(cmd["endpoint"])
    elif kind == "daemon":
        backend = DaemonBackend(cmd["endpoint"])
    else:
        backend = RedisBackend(cmd["endpoint"], cmd["window"])
    await backend.open()
    await asyncio.sleep(max(0.0, cmd["start_at"] - time.monotonic()))
    measure_from, end_at = cmd["measure_from"], cmd["end_at"]
    lats: list[float] = []
    errors = [0]

    async def worker(k: int) -> None:
        i = k
        while True:
            t = time.monotonic()
            if t >= end_at:
                return
            rid = f"{cmd['tag']}-{idx}-{k}-{i}"
            try:
                lat = await backend.lifecycle(rid, hashes[i % len(hashes)])
            except Exception:  # counted; a bench must report failures, not hide them
                errors[0] += 1
                continue
            finally:
                i += cmd["window"]
            if t >= measure_from:
                lats.append(lat)

    await asyncio.gather(*(worker(k) for k in range(cmd["window"])))
    await backend.close()
    return {"count": len(lats), "lats": lats, "errors": errors[0]}


def router_main(conn, idx: int) -> None:
    """A long-lived router process: runs one session per command until it receives None."""
    import uvloop

    hashes = [request_hashes(idx * N_SEQUENCES + i) for i in range(N_SEQUENCES)]
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd is None:
            return
        try:
            conn.send(uvloop.run(session(cmd, idx, hashes)))
        except Exception as exc:  # report to the parent instead of dying silently
            conn.send({"count": 0, "lats": [], "errors": 1, "exception": repr(exc)})


# ---------------------------------------------------------------------------- parent
def cpu_s(pid: int) -> float:
    """utime + stime of `pid` (s)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Routers:
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

    def run(self, backend: str, endpoint: str, window: int, server_pid: int, warm_s: float, measure_s: float,
            tag: str) -> dict:
        import numpy as np

        start = time.monotonic() + 0.5 + 0.05 * len(self.pipes)
        cmd = {"backend": backend, "endpoint": endpoint, "window": window, "start_at": start,
               "measure_from": start + warm_s, "end_at": start + warm_s + measure_s, "tag": tag}
        for pipe in self.pipes:
            pipe.send(cmd)
        while time.monotonic() < cmd["measure_from"]:
            time.sleep(0.005)
        cpu0, load0 = cpu_s(server_pid), os.getloadavg()[0]
        time.sleep(max(0.0, cmd["end_at"] - time.monotonic()))
        cpu1 = cpu_s(server_pid)
        outs = [pipe.recv() for pipe in self.pipes]
        lats = np.concatenate([np.asarray(o["lats"], dtype=np.float64) for o in outs]) if outs else np.zeros(0)
        count = sum(o["count"] for o in outs)
        errors = sum(o["errors"] for o in outs)
        exc = [o["exception"] for o in outs if "exception" in o]
        lc_s = count / measure_s
        row = {"backend": backend, "routers": len(self.pipes), "window": window, "lifecycles": count,
               "lifecycles_per_s": round(lc_s, 1), "frames_per_s": round(lc_s * FRAMES_PER_LIFECYCLE, 1),
               "select_us_p50": round(float(np.percentile(lats, 50)), 1) if lats.size else None,
               "select_us_p99": round(float(np.percentile(lats, 99)), 1) if lats.size else None,
               "server_cpu_us_per_lifecycle": round((cpu1 - cpu0) / count * 1e6, 1) if count else None,
               "server_cpu_share": round((cpu1 - cpu0) / measure_s, 3), "errors": errors, "loadavg_1m": load0}
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


def start_redis(tmp: Path) -> tuple[subprocess.Popen | None, str, str]:
    """redis-server on 127.0.0.1 (free port) + a unix socket, persistence off. Returns (proc, socket, note)."""
    exe = shutil.which("redis-server")
    if exe is None:
        return None, "", "redis-server not installed (Debian: apt-get install redis-server); Redis rows skipped"
    try:
        import redis  # noqa: F401
    except ImportError:
        return None, "", "redis-py not installed (pip install 'kvsched[bench]'); Redis rows skipped"
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sock = str(tmp / "redis.sock")
    proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(port), "--unixsocket", sock,
                             "--unixsocketperm", "700", "--save", "", "--appendonly", "no", "--daemonize", "no",
                             "--dir", str(tmp), "--logfile", str(tmp / "redis.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not os.path.exists(sock):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            return None, "", "redis-server did not start; Redis rows skipped"
        time.sleep(0.05)
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()
    return proc, sock, version


def ray_note() -> str:
    try:
        import ray  # noqa: F401
    except ImportError:
        return ("Ray not installed (pip install ray: several hundred MB, not installed by this bench); "
                "Ray actor rows skipped")
    return "Ray is installed but the Ray actor rows are not implemented in this bench; skipped"


def start_to_ready(tmp: Path, cache_dir: str | None) -> float:
    """Seconds from spawning `kvsched-daemon` to its ready line (cache_dir None = the shared cache)."""
    from kvsched.daemon.process import DaemonProcess
    from kvsched.shm.layout import unlink_segments

    env = dict(os.environ)
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    instance = f"bench-ready-{os.getpid()}-{int(time.monotonic() * 1000) % 100000}"
    t0 = time.perf_counter()
    d = DaemonProcess.start(tmp / "daemon.toml", instance=instance, runtime_dir=tmp / "ready", env=env,
                            ready_timeout_s=120)
    dt = time.perf_counter() - t0
    d.stop()
    unlink_segments(instance)
    return dt


def print_rows(rows: list[dict]) -> None:
    hdr = (f"{'backend':<8} {'routers':>7} {'window':>6} | {'lifecycles/s':>12} {'frames/s':>10} | "
           f"{'select p50 µs':>13} {'p99 µs':>9} | {'server CPU µs/lc':>16} {'load':>5}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        p50 = f"{r['select_us_p50']:,.0f}" if r["select_us_p50"] is not None else "-"
        p99 = f"{r['select_us_p99']:,.0f}" if r["select_us_p99"] is not None else "-"
        cpu = f"{r['server_cpu_us_per_lifecycle']:,.1f}" if r["server_cpu_us_per_lifecycle"] is not None else "-"
        print(f"{r['backend']:<8} {r['routers']:>7} {r['window']:>6} | {r['lifecycles_per_s']:>12,.0f} "
              f"{r['frames_per_s']:>10,.0f} | {p50:>13} {p99:>9} | {cpu:>16} {r['loadavg_1m']:>5.2f}"
              + (f"  errors={r['errors']}" if r["errors"] else ""), flush=True)


def summarize(rows: list[dict]) -> list[dict]:
    """Per (routers, window): daemon / echo and daemon / redis ratios."""
    by = {(r["backend"], r["routers"], r["window"]): r for r in rows}
    out = []
    for (b, n, w), d in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if b != "daemon":
            continue
        e, rd = by.get(("echo", n, w)), by.get(("redis", n, w))
        out.append({
            "routers": n, "window": w,
            "daemon_over_echo_frames": round(d["frames_per_s"] / e["frames_per_s"], 3) if e and e["frames_per_s"] else None,
            "daemon_p50_over_echo_p50": round(d["select_us_p50"] / e["select_us_p50"], 3) if e and e["select_us_p50"] else None,
            "daemon_over_redis_lifecycles": round(d["lifecycles_per_s"] / rd["lifecycles_per_s"], 2) if rd and rd["lifecycles_per_s"] else None,
            "daemon_p99_us": d["select_us_p99"], "redis_p99_us": rd["select_us_p99"] if rd else None,
        })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Fewer router counts and windows, shorter runs.")
    ap.add_argument("--routers", default=None, help="Comma-separated router counts (default 1,4,8,16; quick 1,8).")
    ap.add_argument("--windows", default=None, help="Comma-separated in-flight windows per router (default 1,8,32; quick 1,16).")
    ap.add_argument("--measure-s", type=float, default=None, help="Measured seconds per cell (default 3; quick 1.5).")
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "out" / "bench" / "transport.json"))
    args = ap.parse_args()
    router_counts = [int(x) for x in (args.routers or ("1,8" if args.quick else "1,4,8,16")).split(",")]
    windows = [int(x) for x in (args.windows or ("1,16" if args.quick else "1,8,32")).split(",")]
    measure_s = args.measure_s or (1.5 if args.quick else 3.0)
    warm_s = 0.5

    from kvsched.daemon.process import DaemonProcess
    from kvsched.shm.layout import unlink_segments

    tmp = Path(tempfile.mkdtemp(prefix="kvsched-bench-transport-"))
    (tmp / "daemon.toml").write_text(DAEMON_TOML)
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as cold_cache:
        ready_cold = start_to_ready(tmp, cold_cache)
    ready_warm = start_to_ready(tmp, None)
    print(f"daemon start-to-ready: cold numba cache {ready_cold:.2f} s, warm cache {ready_warm:.2f} s")

    instance = f"bench-transport-{os.getpid()}"
    daemon = DaemonProcess.start(tmp / "daemon.toml", instance=instance, runtime_dir=tmp)
    echo_ep = f"ipc://{tmp}/echo.sock"
    ctx = mp.get_context("spawn")
    echo = ctx.Process(target=echo_server, args=(echo_ep, str(tmp / "echo.ready")), daemon=True)
    echo.start()
    redis_proc, redis_sock, redis_note = (None, "", "--no-redis given; Redis rows skipped") if args.no_redis else start_redis(tmp)
    if redis_proc is None:
        notes.append(redis_note)
        print(redis_note)
    notes.append(ray_note())
    print(notes[-1])
    while not (tmp / "echo.ready").exists():
        time.sleep(0.02)
    backends = [("echo", echo_ep, echo.pid), ("daemon", daemon.endpoint, daemon.pid)]
    if redis_proc is not None:
        backends.append(("redis", redis_sock, redis_proc.pid))
    rows: list[dict] = []
    t0 = time.perf_counter()
    try:
        for n in router_counts:
            routers = Routers(n)
            try:
                for w in windows:
                    for name, ep, pid in backends:
                        rows.append(routers.run(name, ep, w, pid, warm_s, measure_s, f"{name}{n}x{w}"))
                        print_rows(rows[-1:])
            finally:
                routers.close()
    finally:
        daemon.stop()
        unlink_segments(instance)
        if echo.is_alive():
            echo.terminate()
            echo.join(5)
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)
    print()
    print_rows(rows)
    ratios = summarize(rows)
    for r in ratios:
        print(f"routers={r['routers']:>2} window={r['window']:>2}: daemon/echo frames {r['daemon_over_echo_frames']}, "
              f"daemon p50 / echo p50 {r['daemon_p50_over_echo_p50']}, daemon/redis lifecycles {r['daemon_over_redis_lifecycles']}")
    import msgspec
    import numpy as np
    import zmq

    meta = {"workers": WORKERS, "isl_tokens": ISL, "block_size": BLOCK, "hashes_per_request": N_HASHES,
            "frames_per_lifecycle": FRAMES_PER_LIFECYCLE, "measure_s": measure_s, "warm_s": warm_s,
            "quick": args.quick, "redis": redis_note if redis_proc is not None else None, "notes": notes,
            "daemon_start_to_ready_cold_s": round(ready_cold, 2), "daemon_start_to_ready_warm_s": round(ready_warm, 2),
            "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "msgspec": msgspec.__version__,
            "numpy": np.__version__, "python": sys.version.split()[0], "wall_s": round(time.perf_counter() - t0, 1)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows, "ratios": ratios}, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
