"""A KV-event batch whose 8-byte seq does not fit a signed 64-bit int is refused as malformed.

Real processes and sockets: a daemon, `kvsched add-worker` (the CLI), an engine's KV-event publisher
(in this process). docs/KV_EVENTS.md "Wire format accepted": seqs count from 0 when the publisher
starts, and the replay protocol reads them signed (0xFF x 8 is its end marker, -1), so a live seq
>= 2^63 cannot be a real batch. Before: it reached the shared-memory store of applied seqs (int64)
and raised OverflowError out of the subscriber's socket callback (a traceback in the daemon's log).
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from kvsched.client import SchedulerClient
from kvsched.sim.kv_publisher import KvEventPublisher
from tests.conftest import TWO_WORKERS, free_port, purge, start_daemon

pytestmark = pytest.mark.timeout(180)

BS, DEPTH = 16, 4


async def _overlap(endpoint: str, rid: str, prefix: list[int]) -> int:
    async with SchedulerClient(endpoint, client_name=rid) as client:
        lease = await client.schedule(
            rid, isl_tokens=(DEPTH + 1) * BS, pinned=(7, 0), block_hashes=[*prefix, random.getrandbits(63)]
        )
        lease.release("completed")
        return lease.overlap_blocks


def _learn(d, pub: KvEventPublisher, prefix: list[int], timeout_s: float = 30.0) -> int:
    """Publish `prefix` as stored until a request pinned to 7:0 sees it (the SUB joins late)."""
    deadline, got = time.monotonic() + timeout_s, -1
    while got != DEPTH and time.monotonic() < deadline:
        pub.block_stored(prefix, block_size=BS)
        pub.flush()
        got = asyncio.run(_overlap(d.endpoint, f"probe-{time.monotonic_ns()}", prefix))
        time.sleep(0.1)
    return got


def test_live_seq_beyond_int64_is_malformed_and_the_stream_keeps_working(tmp_path):
    zctx = zmq.Context()
    pub = KvEventPublisher(zctx, f"tcp://127.0.0.1:{free_port()}", None)
    d = start_daemon(tmp_path, TWO_WORKERS)
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvsched.cli",
                "--admin-endpoint",
                d.admin_endpoint,
                "add-worker",
                "7",
                "--total-kv-blocks",
                "1000",
                "--kv-events-endpoint",
                pub.endpoint,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        rng = random.Random(5)
        a = [rng.getrandbits(63) for _ in range(DEPTH)]
        assert _learn(d, pub, a) == DEPTH
        good_seq = pub.seq
        for bad in (2**64 - 1, 2**63):
            pub.seq = bad
            pub.publish_raw(msgspec.msgpack.encode([time.time(), [], 0]))
        pub.seq = good_seq  # the engine goes on counting where it was
        b = [rng.getrandbits(63) for _ in range(DEPTH)]
        assert _learn(d, pub, b) == DEPTH
        assert asyncio.run(_overlap(d.endpoint, "a-kept", a)) == DEPTH  # not taken for an engine restart
        assert d.alive()
        log = d.log_path.read_text(errors="replace")
        assert "Traceback" not in log and "Exception in callback" not in log, d.log_tail(40)
        assert "kv event frame malformed" in log
    finally:
        d.stop()
        purge(d.instance)
        pub.close()
        zctx.term()
