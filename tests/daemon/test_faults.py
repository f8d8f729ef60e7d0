"""Fault tests with real processes: router death, long streams, hostile input (docs/DESIGN.md §5.4, §5.11)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import zmq

from kvsched import protocol as p
from kvsched.client import AdminClient, SchedulerClient
from tests.conftest import RawPeer, admin_call, daemon_fixture, wait_until

pytestmark = pytest.mark.timeout(120)

# Liveness 3 s against heartbeats every 0.2 s: a live client survives seconds of scheduling delay.
LIVENESS_S = 3.0
FAULT_CONFIG = f"""
[daemon]
block_size = 16
liveness_timeout_ms = {int(LIVENESS_S * 1000)}
heartbeat_ms = 200

[[workers]]
worker_id = 1
total_kv_blocks = 100000
max_num_batched_tokens = 2450

[[workers]]
worker_id = 2
total_kv_blocks = 100000
max_num_batched_tokens = 2450

[[classes]]
name = "default"
prefill_busy_threshold_frac = 1.0
"""


daemon = daemon_fixture(FAULT_CONFIG)
# Liveness far longer than any wait below: a dead router's leases freed in time were freed by the pid watch.
pid_watch_daemon = daemon_fixture(
    FAULT_CONFIG.replace(f"liveness_timeout_ms = {int(LIVENESS_S * 1000)}", "liveness_timeout_ms = 120000"),
    name="pid_watch_daemon",
)


def status(d) -> p.StatusReply:
    return admin_call(d, p.Status())


def loads(d) -> list[tuple[int, int, int]]:
    with AdminClient(d.admin_endpoint) as admin:
        return [(w.active_blocks, w.active_prefill_tokens, w.active_requests) for w in admin.call(p.Workers()).workers]


HOLDER = textwrap.dedent("""
    import asyncio, sys
    from kvsched.client import SchedulerClient

    async def main(endpoint, n):
        client = await SchedulerClient(endpoint, client_name="holder").connect()
        tasks = [asyncio.create_task(client.schedule(f"kill-{i}", isl_tokens=100, block_hashes=[i]))
                 for i in range(n)]
        await asyncio.sleep(3600)

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
""")


def test_router_sigkill_frees_its_leases_and_queued_requests(pid_watch_daemon):
    """1. a router gets 50 leases (each worker busy past 25 x 100 prefill tokens) and 50 queued
    requests, 2. it is SIGKILLed, 3. the daemon notices by its pid watch (its liveness timeout is 120 s,
    the wait 30 s). Result: no lease, no queued request, all worker load back to zero, none of them
    ever dispatched."""
    daemon = pid_watch_daemon
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, daemon.endpoint, "100"])
    try:
        assert wait_until(lambda: status(daemon).active_leases == 50 and status(daemon).queued == 50, 20), status(
            daemon
        )
        decisions_before = status(daemon).decisions_total
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert wait_until(lambda: status(daemon).active_leases == 0 and status(daemon).queued == 0, 30)
        assert all(load == (0, 0, 0) for load in loads(daemon))
        # the 50 queued requests were dropped, never admitted
        assert status(daemon).decisions_total == decisions_before
    finally:
        if proc.poll() is None:
            proc.kill()

    async def fresh() -> None:
        async with SchedulerClient(daemon.endpoint) as client:
            lease = await client.schedule("after-kill", isl_tokens=100)
            lease.release()

    asyncio.run(fresh())


async def test_long_stream_keeps_its_lease_while_owner_heartbeats(daemon):
    """1. a lease is held idle for 3x the liveness timeout, 2. the client only heartbeats.
    Result: the lease is still active, and releases normally."""
    async with SchedulerClient(daemon.endpoint) as client:
        lease = await client.schedule("long-stream", isl_tokens=100)
        lease.prefill_done()
        for _ in range(int(3 * LIVENESS_S / 0.5)):
            await asyncio.sleep(0.5)
            lease.add_output_tokens(1)
        assert await asyncio.to_thread(lambda: status(daemon).active_leases) == 1
        lease.release()
    assert wait_until(lambda: status(daemon).active_leases == 0)


def test_silent_remote_connection_is_reaped_after_liveness_timeout(daemon):
    """1. a peer says Hello with pid 0 (no pid watch) and takes a lease, 2. it goes silent.
    Result: the lease is released once the liveness timeout passes."""
    with RawPeer(daemon.endpoint) as peer:
        peer.hello("remote")
        peer.send(p.Enqueue("silent-1", 100))
        assert isinstance(peer.recv(), p.Admitted)
        assert status(daemon).active_leases == 1
        assert wait_until(lambda: status(daemon).active_leases == 0, 30)


_REPLY_DEC = p.make_daemon_decoder()


def _frames_in(raw: bytes) -> int:
    """Daemon frames in one message: a version-2 peer gets a wake's answers in one `Replies`."""
    frame = _REPLY_DEC.decode(raw)
    return len(frame.frames) if isinstance(frame, p.Replies) else 1


def _hostile_frames(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    enc = p.make_encoder()
    valid = [
        enc.encode(p.Enqueue("h-x", 100, p.hashes_to_bytes([1, 2]))),
        enc.encode(p.Update("h-x", 0, 1, "progress", 5)),
        enc.encode(p.Release("h-x", 0, 1, "completed", 1)),
        enc.encode(p.Release("good-1", 0, 1, "completed", 1)),  # an id another client holds
        enc.encode(p.Hello(p.PROTOCOL_VERSION)),
        enc.encode(p.Heartbeat(1)),
    ]
    crafted = [
        enc.encode(["enqueue", "big", 2**40]),  # overflowing isl
        enc.encode(["enqueue", "neg", -5]),
        enc.encode(["enqueue", "hash", 16, b"\x00" * 800]),  # more hashes than the ISL allows
        enc.encode(["enqueue", "odd", 16, b"\x00" * 7]),  # not a multiple of 8
        enc.encode(["update", "nobody", 3, 9, "prefill_done"]),  # unknown lease
        enc.encode(["release", "nobody", 3, 9, "completed", 0]),
        enc.encode(["hello", 999]),  # wrong protocol version
        enc.encode(["enqueue", "list", 10, list(range(10000))]),  # wrong type (huge array)
        enc.encode({"t": "drain", "worker_id": 1}),  # admin on the data socket
    ]
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.3:
            out.append(rng.randbytes(rng.randint(0, 64)))
        elif r < 0.5:
            out.append(rng.choice(crafted))
        else:
            raw = bytearray(rng.choice(valid))
            for _ in range(rng.randint(1, 3)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            if rng.random() < 0.3:
                raw = raw[: rng.randrange(1, len(raw) + 1)]
            out.append(bytes(raw))
    return out


async def test_ten_thousand_hostile_frames_change_nothing_for_a_good_client(daemon):
    """1. a good client holds a lease, 2. a hostile peer sends 10,000 frames (fixed seed) with and
    without Hello. Result: errors go to the hostile peer only; the good lease and the ledger are
    unchanged; the good client still gets correct service."""
    async with SchedulerClient(daemon.endpoint) as good:
        lease = await good.schedule("good-1", isl_tokens=100, block_hashes=[7])
        before = await asyncio.to_thread(loads, daemon)
        ctx = zmq.Context()
        hostile = ctx.socket(zmq.DEALER)
        hostile.setsockopt(zmq.LINGER, 0)
        hostile.connect(daemon.endpoint)
        frames = _hostile_frames(10_000, seed=20261130)

        def flood() -> int:  # in a thread: the good client's loop keeps heartbeating meanwhile
            replies = 0
            for raw in frames:
                hostile.send(raw)
                while hostile.poll(0):
                    replies += _frames_in(hostile.recv())
            deadline = time.monotonic() + 60  # until the daemon goes quiet (slow on a loaded machine)
            while time.monotonic() < deadline and hostile.poll(2000):
                replies += _frames_in(hostile.recv())
            return replies

        replies = await asyncio.to_thread(flood)
        hostile.close(0)
        ctx.term()
        assert replies > 5000  # most hostile frames were answered with Error / Rejected
        # hostile Enqueues that were admitted belong to the hostile peer; release them by killing it:
        # its connection goes silent and is reaped after the liveness timeout
        assert await asyncio.to_thread(wait_until, lambda: status(daemon).active_leases == 1, 30), (
            status(daemon),
            loads(daemon),
        )
        assert await asyncio.to_thread(loads, daemon) == before
        lease.add_output_tokens(3)
        lease.release()
        second = await good.schedule("good-2", isl_tokens=64, block_hashes=[7])
        second.release()
    assert wait_until(lambda: all(x == (0, 0, 0) for x in loads(daemon)))


def test_hostile_admin_frames_get_admin_errors_and_the_daemon_keeps_serving(daemon):
    """1. random bytes, truncated maps, wrong types and unknown tags go to the admin socket.
    Result: each gets an AdminError (or a valid reply for a valid request); status still answers."""
    rng = random.Random(11)
    enc = p.make_encoder()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.admin_endpoint)
    dec = p.make_admin_reply_decoder()
    frames = [rng.randbytes(rng.randint(0, 40)) for _ in range(300)]
    frames += [
        enc.encode({"t": "drain", "worker_id": -1}),
        enc.encode({"t": "teleport"}),
        enc.encode({"t": "leases", "limit": 10**9}),
        enc.encode(["status"]),
        enc.encode({"t": "drain"}),
        enc.encode({"t": "cancel", "request_id": "x" * 1000}),
    ]
    try:
        errors = 0
        for raw in frames:
            sock.send(raw)
            assert sock.poll(5000), "admin socket stopped answering"
            reply = dec.decode(sock.recv())
            errors += isinstance(reply, p.AdminError)
        assert errors == len(frames)
    finally:
        sock.close(0)
        ctx.term()
    assert status(daemon).workers == 2
