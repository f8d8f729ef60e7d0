"""A worker added at runtime keeps its URL and KV-event subscription across a daemon crash.

Real processes and sockets: a daemon, `kvsched add-worker` (the CLI), an engine's KV-event
publisher with its replay ROUTER (in this process), SIGKILL, restart. docs/KV_EVENTS.md "Restarts keep the cache view".
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import threading
import time

import pytest
import zmq

from kvsched import protocol as p
from kvsched.client import SchedulerClient
from kvsched.sim.kv_publisher import KvEventPublisher
from tests.conftest import TWO_WORKERS, admin_call, free_port, purge, start_daemon

pytestmark = pytest.mark.timeout(180)

BS, DEPTH = 16, 4
URL = "http://127.0.0.1:18077"


def _cli(d, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvsched.cli", "--admin-endpoint", d.admin_endpoint, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def _pinned(endpoint: str, rid: str, prefix: list[int]) -> tuple[str, int]:
    """(Admitted.url, overlap_blocks) of one request pinned to 7:0 carrying `prefix` + a fresh block."""
    async with SchedulerClient(endpoint, client_name=rid) as client:
        lease = await client.schedule(
            rid, isl_tokens=(DEPTH + 1) * BS, pinned=(7, 0), block_hashes=[*prefix, random.getrandbits(63)]
        )
        lease.release("completed")
        return lease.url, lease.overlap_blocks


def test_runtime_worker_keeps_url_and_kv_events_after_sigkill_without_add_worker_again(tmp_path):
    """1. `add-worker 7 --url U --kv-events-endpoint E --kv-replay-endpoint R`; the daemon learns prefix
    A from 7's events; 2. SIGKILL; while it is down the engine caches prefix B (published to nobody);
    3. restart, nobody runs add-worker again. Result: requests on 7:0 carry U, see A, and see B —
    learnt only through the catch-up replay of the restored subscription; the same add-worker is an
    idempotent OK, other capacities are still refused; after remove-worker + another crash 7 stays
    gone. Before: Admitted.url was "" and 7 had no KV-event stream until the add-worker was re-run."""
    zctx = zmq.Context()
    pub = KvEventPublisher(zctx, f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    d = start_daemon(tmp_path, TWO_WORKERS)
    stop = threading.Event()
    try:
        add = (
            "add-worker",
            "7",
            "--total-kv-blocks",
            "1000",
            "--url",
            URL,
            "--kv-events-endpoint",
            pub.endpoint,
            "--kv-replay-endpoint",
            pub.replay_endpoint,
        )
        out = _cli(d, *add)
        assert out.returncode == 0, out.stderr
        rng = random.Random(11)
        a = [rng.getrandbits(63) for _ in range(DEPTH)]
        deadline = time.monotonic() + 30
        while True:  # the SUB joins a little after add-worker: publish until the daemon has learnt A
            pub.block_stored(a, block_size=BS)
            pub.flush()
            url, overlap = asyncio.run(_pinned(d.endpoint, f"learn-{time.monotonic_ns()}", a))
            if overlap == DEPTH or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert (url, overlap) == (URL, DEPTH)
        d.kill()
        b = [rng.getrandbits(63) for _ in range(DEPTH)]
        pub.block_stored(b, block_size=BS)
        pub.flush()  # nobody subscribed: only a replay can bring it

        def serve_replays() -> None:
            while not stop.is_set():
                pub.service_replay()
                time.sleep(0.01)

        server = threading.Thread(target=serve_replays, daemon=True)
        server.start()
        d.restart()
        assert asyncio.run(_pinned(d.endpoint, "after-a", a)) == (URL, DEPTH)
        deadline = time.monotonic() + 15
        while True:
            got = asyncio.run(_pinned(d.endpoint, f"after-b-{time.monotonic_ns()}", b))
            if got == (URL, DEPTH) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert got == (URL, DEPTH), "B was not learnt: no KV-event subscription for 7 after the restart"
        again = _cli(d, *add)
        assert again.returncode == 0 and "already registered with these settings" in again.stdout, again
        other = _cli(d, "add-worker", "7", "--total-kv-blocks", "500", "--url", URL)
        assert other.returncode != 0 and "already registered" in other.stdout + other.stderr, other
        assert _cli(d, "remove-worker", "7").returncode == 0
        d.kill()
        d.restart()
        assert 7 not in {w.worker_id for w in admin_call(d, p.Workers()).workers}
        fresh = _cli(d, "add-worker", "7", "--total-kv-blocks", "1000")  # no URL: nothing stale comes back
        assert fresh.returncode == 0, fresh
        assert asyncio.run(_pinned(d.endpoint, "fresh", a))[0] == ""
    finally:
        stop.set()
        d.stop()
        purge(d.instance)
        pub.close()
        zctx.term()
