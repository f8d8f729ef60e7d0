"""The backends of `bench_transport.py`: servers the bench starts and the router-side clients.

Every backend runs the same lifecycle (Enqueue → reply, dispatched, prefill_done, Release) in its own
protocol, driven by the same router processes:

* `echo` — `echo_server`: a ZeroMQ ROUTER with the daemon's I/O pattern (FD on uvloop's `add_reader`,
  NOBLOCK drain with a budget of 512 frames per wake, the replies of a wake in one message per peer)
  decoding every frame with the daemon's decoders (a `Batch` unpacked) and answering each Enqueue with
  an `Admitted`-shaped frame. `EchoBackend` sends the client library's frames over a DEALER with the
  link's coalescing (one `Batch` per loop turn) and stores dispatched / prefill_done into a local
  state-word array, as a local router does into shared memory: 2 frames in, 1 out per lifecycle.
* `daemon` — `DaemonBackend`: the real `SchedulerClient` and leases against `kvsched-daemon`.
* `redis` — `RedisBackend`: redis-py asyncio (hiredis) on the unix socket of a `redis-server` the
  bench starts; select-and-reserve is a Lua script (awaited: its reply is the decision), then
  dispatched (HSET), prefill_done and release (Lua) go as one pipeline: 2 messages in per lifecycle,
  like the daemon's Enqueue and Release.
* `dynamo` — `DynamoBackend`: NVIDIA Dynamo's standalone selection service (`python -m
  dynamo.select_service`, from the `bench-dynamo` extra; `dynamo_driver.py`), one aiohttp
  keep-alive session per router: `POST /select_and_reserve`, `POST /reservations/{id}/prefill_complete`,
  `DELETE /reservations/{id}`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import subprocess
import time
from pathlib import Path

ISL = 1024  # prompt tokens per request
BLOCK = 16  # tokens per block
N_HASHES = ISL // BLOCK  # 64 hashes per request
PREFIX_BLOCKS = 16  # of which a shared "system prompt" prefix
N_PREFIXES = 32
WORKERS = 8
FRAME_BUDGET = 512  # the daemon's default frame_budget_per_wake

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
                        replies.setdefault(identity, []).append(
                            enc.encode(p.Admitted(f.request_id, slot[0] % WORKERS, 0, slot[0], 1, 0, 0, 0))
                        )
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
        import numpy as np
        import zmq

        from kvsched import protocol as p
        from kvsched.shm.words import STATE_DISPATCHED, STATE_PREFILL_DONE, write_state

        self.p, self.zmq = p, zmq
        self.write_state, self.flags = write_state, (STATE_DISPATCHED, STATE_PREFILL_DONE)
        self.state = np.zeros(1 << 16, np.uint64)  # stands for the shared-memory state words
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

    async def lifecycle(self, rid: str, hashes: bytes, payload) -> float:
        p = self.p
        fut = self.loop.create_future()
        self.waiting[rid] = fut
        t0 = time.perf_counter_ns()
        self._send(p.Enqueue(rid, ISL, hashes))
        a = await fut
        lat = (time.perf_counter_ns() - t0) / 1000.0
        self.write_state(self.state, a.slot, a.generation, self.flags[0])  # dispatched: a store
        self.write_state(self.state, a.slot, a.generation, self.flags[1])  # prefill_done: a store
        self._send(p.Release(rid, a.slot, a.generation, "completed", ISL))
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

    async def lifecycle(self, rid: str, hashes: bytes, payload) -> float:
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
    """redis-py asyncio (hiredis parser) over the unix socket: the reserve script awaited, then the
    three other commands in one pipeline (one message, like the daemon's Release)."""

    def __init__(self, endpoint: str, window: int) -> None:
        self.endpoint, self.window = endpoint, window

    async def open(self) -> None:
        import redis.asyncio as aredis

        self.r = aredis.Redis(unix_socket_path=self.endpoint, max_connections=max(1, self.window))
        self.reserve = self.r.register_script(LUA_RESERVE)
        self.prefill_done = self.r.register_script(LUA_PREFILL_DONE)
        self.release = self.r.register_script(LUA_RELEASE)
        await self.r.ping()
        await self.r.script_load(LUA_PREFILL_DONE)  # pipelined EVALSHA: the scripts must be loaded
        await self.r.script_load(LUA_RELEASE)

    async def lifecycle(self, rid: str, hashes: bytes, payload) -> float:
        t0 = time.perf_counter_ns()
        await self.reserve(args=[rid, WORKERS, ISL, N_HASHES, BLOCK])
        lat = (time.perf_counter_ns() - t0) / 1000.0
        pipe = self.r.pipeline(transaction=False)
        pipe.hset("q:" + rid, "state", "dispatched")
        pipe.evalsha(self.prefill_done.sha, 0, rid)
        pipe.evalsha(self.release.sha, 0, rid)
        await pipe.execute()
        return lat

    async def close(self) -> None:
        await self.r.aclose()


class DynamoBackend:
    """One aiohttp keep-alive session to Dynamo's selection service (`dynamo_driver.DynamoRoute`)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    async def open(self) -> None:
        from dynamo_driver import DynamoRoute

        self.route = DynamoRoute(self.base_url)
        await self.route.open()

    async def lifecycle(self, rid: str, hashes: bytes, payload) -> float:
        t0 = time.perf_counter_ns()
        rep = await self.route.select_and_reserve(payload)
        lat = (time.perf_counter_ns() - t0) / 1000.0
        sid = rep["selection_id"]
        await self.route.prefill_complete(sid)
        await self.route.release(sid)
        return lat

    async def close(self) -> None:
        await self.route.close()


def make_backend(kind: str, endpoint: str, window: int):
    """The router-side client of backend `kind` (echo, daemon, redis, dynamo)."""
    if kind == "echo":
        return EchoBackend(endpoint)
    if kind == "daemon" or kind.startswith("daemon@"):
        return DaemonBackend(endpoint)
    if kind == "redis":
        return RedisBackend(endpoint, window)
    if kind == "dynamo":
        return DynamoBackend(endpoint)
    raise ValueError(f"unknown backend {kind!r}")


# ---------------------------------------------------------------------------- servers
def start_redis(tmp: Path) -> tuple[subprocess.Popen | None, str, str]:
    """redis-server on 127.0.0.1 (free port) + a unix socket, persistence off. Returns (proc, socket, note)."""
    exe = shutil.which("redis-server")
    if exe is None:
        return None, "", "redis-server not installed (Debian: apt-get install redis-server); Redis rows skipped"
    if importlib.util.find_spec("redis") is None:
        return None, "", "redis-py not installed (pip install 'kvsched[bench]'); Redis rows skipped"
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sock = str(tmp / "redis.sock")
    proc = subprocess.Popen(
        [
            exe,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--unixsocket",
            sock,
            "--unixsocketperm",
            "700",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            str(tmp),
            "--logfile",
            str(tmp / "redis.log"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while not os.path.exists(sock):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            return None, "", "redis-server did not start; Redis rows skipped"
        time.sleep(0.05)
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()
    return proc, sock, version


def start_dynamo(threads: int) -> tuple[object | None, str, str]:
    """Dynamo's selection service with the bench's 8 workers registered (block size 16, one KV-event
    endpoint each: a free loopback port nothing publishes on, so its index stays empty and every
    decision is load-only, as Redis's). Returns (service, base URL, note); (None, "", why) when the
    package is missing or the service does not start."""
    from dynamo_driver import DynamoService, _free_port, dynamo_unavailable_reason

    why = dynamo_unavailable_reason()
    if why is not None:
        return None, "", f"{why}; Dynamo rows skipped"
    svc = DynamoService(threads=threads)
    try:
        svc.start()
        for w in range(WORKERS):
            svc.add_worker(w, BLOCK, f"tcp://127.0.0.1:{_free_port()}")
    except Exception as exc:
        svc.stop()
        return None, "", f"dynamo.select_service failed to start ({exc}); Dynamo rows skipped"
    from importlib.metadata import version

    return svc, svc.base, f"ai-dynamo-runtime {version('ai-dynamo-runtime')}, select_service --threads {threads}"
