"""A router that says Hello to a daemon whose loop is busy waits for its Welcome on the same
connection instead of opening new ones (docs/PROTOCOL.md, "Lifecycle", step 1)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from kvsched import protocol as p
from kvsched.client import SchedulerClient
from kvsched.daemon.process import DaemonProcess
from tests.conftest import admin_call, purge, unique_instance, write_config

pytestmark = pytest.mark.timeout(180)

STALL_S = 4.0
CONFIG = """
[daemon]
block_size = 16
liveness_timeout_ms = 60000
heartbeat_ms = 1000

[[workers]]
worker_id = 1
total_kv_blocks = 100000
"""


async def test_a_hello_to_a_busy_daemon_is_answered_on_one_connection(tmp_path):
    """The daemon's loop is blocked for 4 s (its ZeroMQ I/O threads still accept connections) while
    a router starts. Before, the router opened a new socket and said Hello again every 50 ms
    doubling to 2 s, so the daemon found 6 Hellos on 6 connections when its loop resumed and kept
    the 5 abandoned ones as live routers until its liveness timeout; a daemon needing more than the
    2 s backoff ceiling to answer was never reached. Now: one connection, one Hello."""
    instance = unique_instance("hp")
    cfg = write_config(tmp_path / f"{instance}.toml", CONFIG)
    d = DaemonProcess.start(
        cfg, instance=instance, runtime_dir=tmp_path, env=dict(os.environ, KVSCHED_DEBUG_STALL_S=str(STALL_S))
    )
    try:
        os.kill(d.pid, signal.SIGUSR2)  # the actor loop sleeps STALL_S
        await asyncio.sleep(0.3)
        async with SchedulerClient(d.endpoint, client_name="patient", connect_timeout_s=30) as client:
            lease = await asyncio.wait_for(client.schedule("r1", isl_tokens=10), 30)
            status: p.StatusReply = await asyncio.to_thread(admin_call, d, p.Status())
            assert status.connections == 1, f"{status.connections} connections for one router"
            lease.release()
    finally:
        d.stop()
        purge(d.instance)
