"""One connection that floods the data socket with near-`max_frame_bytes` messages and never reads its
replies cannot make the daemon hold more than its queue budget (real daemon, real ipc socket).

Before the fix the data ROUTER's receive high-water mark was 100,000 messages per peer: at up to
~1 MiB a message one DEALER could make libzmq queue ~100 GiB inside the daemon (a new user saw a fresh
daemon grow from 230 MiB to 2.34 GiB RSS in 14 s). Now the high-water marks are derived from the
per-connection budget (kvsched/daemon/sockets.py, docs/DESIGN.md §5.3), and the flooder is
back-pressured instead: its own sends meet EAGAIN.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from kvsched.client import SyncSchedulerClient
from tests.conftest import ROOT, daemon_fixture

pytestmark = pytest.mark.timeout(300)

FLOOD_S = 8.0
# Growth bound: the budget of one connection (64 MiB) plus the kernel's socket buffers, the actor's
# carried-over batch, allocator slack and the replies; far below the ~2 GiB seen before.
MAX_RSS_GROWTH_MIB = 400

CONFIG = """
[daemon]
block_size = 16
liveness_timeout_ms = 60000

[[workers]]
worker_id = 1
total_kv_blocks = 2048
max_num_batched_tokens = 1000000

[[workers]]
worker_id = 2
total_kv_blocks = 100000
max_num_batched_tokens = 1000000
"""

# As /tmp memflood.py: `batch` messages of 1,800 enqueues (64 hashes each, ~0.99 MB, under
# max_frame_bytes), sent with NOBLOCK as fast as ZeroMQ takes them (default SNDHWM), never reading.
FLOODER = textwrap.dedent("""
    import os, socket, sys, time
    import msgspec, numpy as np, zmq
    from kvsched import protocol as p

    endpoint, secs = sys.argv[1], float(sys.argv[2])
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    enc = p.make_encoder()
    s.send(enc.encode(p.Hello(p.PROTOCOL_VERSION, "memflood", os.getpid(), socket.gethostname(),
                              os.stat("/proc/self/ns/pid").st_ino)))
    welcome = p.make_daemon_decoder().decode(s.recv())
    hashes = np.arange(1, 65, dtype="<u8").tobytes()
    msgs = [enc.encode(p.Batch([msgspec.Raw(enc.encode(p.Enqueue(f"m{k}-{i}", 1024, hashes, pinned=(1, 0),
                                                                  do_not_queue=True)))
                                for i in range(1800)])) for k in range(4)]
    assert all(len(m) < welcome.max_frame_bytes for m in msgs), [len(m) for m in msgs]
    print("FLOODING", len(msgs[0]), flush=True)
    t0 = time.time(); n = nbytes = again = 0
    while time.time() - t0 < secs:
        msg = msgs[n % len(msgs)]
        try:
            s.send(msg, zmq.NOBLOCK); n += 1; nbytes += len(msg)
        except zmq.Again:
            again += 1
            time.sleep(0.001)
    print(f"SENT {n} {nbytes >> 20} {again}", flush=True)
    time.sleep(600)
""")

daemon = daemon_fixture(CONFIG)


def _rss_mib(pid: int) -> float:
    """VmRSS of process `pid` in MiB (/proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_a_lone_router_flooding_1mb_batches_without_reading_grows_the_daemon_rss_less_than_400mib(daemon, tmp_path):
    """1. a well-behaved router connects, 2. a flooder sends ~1 MB `batch` messages as fast as ZeroMQ
    takes them for 8 s and never reads, 3. the router schedules and releases throughout.
    Result: the daemon's peak RSS stays within 400 MiB of its level before the flood, and every
    schedule/release of the router succeeds."""
    script = tmp_path / "memflood.py"
    script.write_text(FLOODER)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with SyncSchedulerClient(daemon.endpoint, attach_progress=False) as router:
        router.schedule("warm", isl_tokens=16, pinned=(2, 0)).release()
        base = _rss_mib(daemon.pid)
        flooder = subprocess.Popen(
            [sys.executable, str(script), daemon.endpoint, str(FLOOD_S)], stdout=subprocess.PIPE, text=True, env=env
        )
        peak = base
        done = threading.Event()
        rtts: list[float] = []
        errors: list[BaseException] = []

        def well_behaved() -> None:
            i = 0
            while not done.is_set():
                start = time.monotonic()
                try:
                    router.schedule(f"good-{i}", isl_tokens=64, pinned=(2, 0)).release()
                except BaseException as exc:
                    errors.append(exc)
                    return
                rtts.append(time.monotonic() - start)
                i += 1
                time.sleep(0.2)

        try:
            first = flooder.stdout.readline().split()
            assert first[0] == "FLOODING", first
            worker = threading.Thread(target=well_behaved, daemon=True)
            worker.start()
            end = time.monotonic() + FLOOD_S + 2.0
            while time.monotonic() < end:
                peak = max(peak, _rss_mib(daemon.pid))
                time.sleep(0.1)
            done.set()
            worker.join(60)
            sent = flooder.stdout.readline().split()
        finally:
            flooder.kill()
            flooder.wait()
        assert daemon.alive()
        router.schedule("after", isl_tokens=16, pinned=(2, 0)).release()
    print(
        f"\nflooder: {first[1]} B messages; sent {sent[1]} messages ({sent[2]} MiB), {sent[3]} sends refused (EAGAIN)"
    )
    print(
        f"daemon RSS before the flood {base:.0f} MiB, peak during it {peak:.0f} MiB (+{peak - base:.0f} MiB, "
        f"bound +{MAX_RSS_GROWTH_MIB} MiB)"
    )
    print(f"well-behaved router: {len(rtts)} schedule+release, worst {max(rtts):.3f} s")
    assert not errors, f"the well-behaved router failed during the flood: {errors[0]!r}"
    assert len(rtts) >= 5, f"only {len(rtts)} schedule+release round trips during the flood"
    assert peak - base <= MAX_RSS_GROWTH_MIB, (
        f"daemon RSS grew {peak - base:.0f} MiB (from {base:.0f} to {peak:.0f}) under one flooding connection"
    )
