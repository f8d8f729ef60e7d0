"""A router's first connect waits out a daemon that answers late (start-up, a loaded machine)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from kvsched.client import SchedulerClient
from tests.conftest import daemon_fixture

pytestmark = pytest.mark.timeout(120)

daemon = daemon_fixture("[daemon]\nblock_size = 16\n\n[[workers]]\nworker_id = 1\n")


async def test_default_connect_timeout_waits_out_a_daemon_silent_for_8s(daemon):
    """1. the daemon is up (its socket bound), then stopped with SIGSTOP — it answers nothing, as a
       daemon starved of CPU or still starting does;
    2. a client connects with the default `connect_timeout_s`; the daemon resumes (SIGCONT) 8 s later.
    Result: the client connects and schedules a request. (The default was 5 s, and routers on a loaded
    machine failed with `DaemonUnavailable` while their daemon was merely slow.)"""
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        client = SchedulerClient(daemon.endpoint, client_name="patient")
        connecting = asyncio.create_task(client.connect())
        await asyncio.sleep(8.0)
        assert not connecting.done(), connecting
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    await asyncio.wait_for(connecting, 60)
    try:
        lease = await client.schedule("late-1", isl_tokens=32, block_hashes=[1, 2])
        async with lease:
            assert lease.worker.worker_id == 1 and not lease.degraded
    finally:
        await client.close()
