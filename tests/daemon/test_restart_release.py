"""Leases released while the daemon is down are applied by the restarted daemon at once (real processes).

The client buffers a `Release` made while it is disconnected; after the new daemon's `Welcome` it
claims that lease in `Reattach` and then sends the buffered `Release`, so the lease ends `completed`
and its capacity is free at once, not after the re-attach grace (the liveness timeout).
"""

from __future__ import annotations

import asyncio

import pytest

from kvsched import protocol as p
from kvsched.client import SchedulerClient
from tests.conftest import admin_call, daemon_fixture, kill_and_wait_for_disconnect

pytestmark = pytest.mark.timeout(150)

# A long liveness timeout: leases nobody claims are held for 30 s after a restart, so a lease freed
# within the test's wait was freed by the buffered Release, not by the grace timeout.
CONFIG = """
[daemon]
block_size = 16
liveness_timeout_ms = 30000
heartbeat_ms = 200

[[workers]]
worker_id = 1
total_kv_blocks = 100000
max_num_batched_tokens = 100000
"""


daemon = daemon_fixture(CONFIG)


def _status(d) -> p.StatusReply:
    return admin_call(d, p.Status())


async def test_a_release_made_while_the_daemon_is_down_is_applied_after_its_restart(daemon):
    """1. a router holds three leases, 2. the daemon is SIGKILLed, 3. the router releases two of
    them (completed) while no daemon runs, 4. the daemon restarts and the router reconnects.
    Result: the daemon applies both releases (one lease stays live, no "belongs to another
    connection" rejection) well before the 30 s re-attach grace; the third lease is kept."""
    async with SchedulerClient(daemon.endpoint, reconnect_deadline_s=120) as client:
        leases = [await client.schedule(f"st-{i}", isl_tokens=100) for i in range(3)]
        for lease in leases:
            lease.dispatched()
        await asyncio.sleep(0.3)
        await kill_and_wait_for_disconnect(daemon, client)
        loop = asyncio.get_running_loop()
        leases[0].release("completed")
        leases[1].release("completed")
        await asyncio.to_thread(daemon.restart)
        end = loop.time() + 15
        while loop.time() < end and (await asyncio.to_thread(_status, daemon)).active_leases != 1:
            await asyncio.sleep(0.1)
        status = await asyncio.to_thread(_status, daemon)
        assert status.active_leases == 1, daemon.log_tail(30)
        log = daemon.log_path.read_text()
        assert "belongs to another connection" not in log
        assert not client.errors
        assert leases[2].outcome is None
        leases[2].release("completed")
        end = loop.time() + 10
        while loop.time() < end and (await asyncio.to_thread(_status, daemon)).active_leases != 0:
            await asyncio.sleep(0.1)
        assert (await asyncio.to_thread(_status, daemon)).active_leases == 0


async def test_a_release_in_flight_when_the_daemon_dies_is_applied_after_its_restart(daemon):
    """1. a router holds three leases, 2. the daemon is frozen (SIGSTOP), 3. the router releases two
    of them: the frames leave the client but the daemon never reads them, 4. the daemon is
    SIGKILLed (the frames die with it) and restarted. Result: the router re-sends those two releases
    after its Reattach, so they are applied well before the 30 s re-attach grace (was: held until it
    expired, and the policies were told `aborted`); the third lease is kept."""
    import os
    import signal

    async with SchedulerClient(daemon.endpoint, reconnect_deadline_s=120) as client:
        leases = [await client.schedule(f"fl-{i}", isl_tokens=100) for i in range(3)]
        for lease in leases:
            lease.dispatched()
        await asyncio.sleep(0.3)
        os.kill(daemon.pid, signal.SIGSTOP)
        leases[0].release("completed")
        leases[1].release("completed")
        await asyncio.sleep(0.5)  # sent: the frozen daemon's socket holds them unread
        assert client.connected
        await asyncio.to_thread(daemon.kill)
        await asyncio.to_thread(daemon.restart)
        loop = asyncio.get_running_loop()
        end = loop.time() + 15
        while loop.time() < end and (await asyncio.to_thread(_status, daemon)).active_leases != 1:
            await asyncio.sleep(0.1)
        assert (await asyncio.to_thread(_status, daemon)).active_leases == 1, daemon.log_tail(30)
        assert leases[2].outcome is None and not client.lost_leases
        leases[2].release("completed")
        end = loop.time() + 10
        while loop.time() < end and (await asyncio.to_thread(_status, daemon)).active_leases != 0:
            await asyncio.sleep(0.1)
        assert (await asyncio.to_thread(_status, daemon)).active_leases == 0
