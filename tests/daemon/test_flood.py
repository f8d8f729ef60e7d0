"""One flooding connection cannot starve others, and a dead flooder's backlog is dropped (real processes).

A raw peer pipelines tens of thousands of Enqueues pinned to one busy worker. Alone, it may fill the
class's whole queue limit (past it: `queue_full`); a well-behaved router that then asks for an idle
worker is below its `max_waiting_share` while the flooder holds more than its own, so its request is
still accepted past the full limit and admitted (docs/DESIGN.md §5.9). When the flooder is SIGKILLed,
the daemon (watching its pid) removes its queued requests within the liveness timeout and drops the
frames it still buffers.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import pytest

from kvsched import protocol as p
from kvsched.client import SchedulerClient
from tests.conftest import ROOT, admin_call, daemon_fixture

pytestmark = pytest.mark.timeout(180)

# A liveness timeout far longer than the test: the flooder's backlog leaving within 30 s is the pid watch's doing.
CONFIG = """
[daemon]
block_size = 16
liveness_timeout_ms = 120000
heartbeat_ms = 200

[[workers]]
worker_id = 1
total_kv_blocks = 1000000
max_num_batched_tokens = 1000000

[[workers]]
worker_id = 2
total_kv_blocks = 1000000
max_num_batched_tokens = 1000000

[[classes]]
name = "default"
prefill_busy_threshold = 1000
request_queue_limit_per_worker = 100
"""

FLOODER = textwrap.dedent("""
    import os, socket, sys, time
    import zmq
    from kvsched import protocol as p

    endpoint, n = sys.argv[1], int(sys.argv[2])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    enc = p.make_encoder()
    pid_ns = os.stat("/proc/self/ns/pid").st_ino
    # As a kvsched client on this host says Hello (fields by position; pid_ns last).
    sock.send(enc.encode(["hello", p.PROTOCOL_VERSION, "flooder", os.getpid(), socket.gethostname()[:128], pid_ns]))
    sock.recv()
    for i in range(n):
        sock.send(enc.encode(p.Enqueue(f"flood-{i}", 100, pinned=(1, 0))))
    print("SENT", flush=True)
    time.sleep(600)
""")

N_FLOOD = 50_000


daemon = daemon_fixture(CONFIG)


def _depth(d) -> int:
    return sum(row.depth + row.deferred for row in admin_call(d, p.Queues()).classes)


async def test_a_flooder_cannot_starve_others_and_its_backlog_leaves_with_it(daemon, tmp_path):
    """1. a router takes a lease that makes worker 1 busy, 2. a flooder (pid-watched) pipelines 50,000
    Enqueues pinned to worker 1, 3. once it has filled the class, a second router asks for idle
    worker 2, 4. the flooder is SIGKILLed. Result: the lone flooder fills the whole class limit (200),
    the second router is still accepted and admitted, and after the kill the queue empties (within
    30 s, far inside the 120 s liveness timeout: the pid watch) and only the two routers remain
    connected."""
    async with SchedulerClient(daemon.endpoint) as a, SchedulerClient(daemon.endpoint) as b:
        blocker = await a.schedule("blocker", isl_tokens=2000, pinned=(1, 0))
        # The routers' connections, counted before the flooder's (a client whose Welcome came late
        # retried its Hello on a new socket; the daemon keeps the abandoned one until its liveness timeout).
        routers = (await asyncio.to_thread(admin_call, daemon, p.Status())).connections
        script = tmp_path / "flooder.py"
        script.write_text(FLOODER)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        flooder = subprocess.Popen(
            [sys.executable, str(script), daemon.endpoint, str(N_FLOOD)], stdout=subprocess.PIPE, text=True, env=env
        )
        try:
            loop = asyncio.get_running_loop()
            end = loop.time() + 60
            while await asyncio.to_thread(_depth, daemon) < 200 and loop.time() < end:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            assert await asyncio.to_thread(_depth, daemon) == 200  # the class limit: 100 x 2 worker ids
            good = await asyncio.wait_for(b.schedule("good", isl_tokens=100, allowed_workers=[2]), 20)
            assert good.worker.worker_id == 2
            good.release()
            assert (await asyncio.to_thread(flooder.stdout.readline)).strip() == "SENT"
        finally:
            flooder.kill()
            flooder.wait()
        t0 = time.monotonic()
        while await asyncio.to_thread(_depth, daemon) and time.monotonic() - t0 < 30:
            await asyncio.sleep(0.02)
        gone_s = time.monotonic() - t0
        assert not await asyncio.to_thread(_depth, daemon), f"the dead flooder's queued requests stayed {gone_s:.1f}s"
        await asyncio.sleep(0.5)
        assert (await asyncio.to_thread(admin_call, daemon, p.Status())).connections == routers
        blocker.release()
