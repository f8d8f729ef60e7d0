"""Lease guard semantics against a live daemon: exception → aborted, GC → aborted, requeue."""

from __future__ import annotations

import asyncio
import gc

import pytest

from kvsched import protocol as p
from kvsched.client import AdminClient, SchedulerClient, SyncSchedulerClient
from kvsched.errors import LeaseError
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(60)


def active_leases(admin_endpoint: str) -> int:
    with AdminClient(admin_endpoint) as admin:
        return admin.call(p.Status()).active_leases


async def test_lease_aborted_when_body_raises(session_daemon):
    async with SchedulerClient(session_daemon.endpoint) as client:
        with pytest.raises(RuntimeError):
            async with await client.schedule("guard-exc", isl_tokens=32) as lease:
                raise RuntimeError("backend failed")
        assert lease.outcome == "aborted"
        with pytest.raises(LeaseError):
            lease.add_output_tokens(1)
    assert wait_until(lambda: active_leases(session_daemon.admin_endpoint) == 0)


async def test_lease_aborted_when_task_cancelled_inside_guard(session_daemon):
    async with SchedulerClient(session_daemon.endpoint) as client:
        holder = {}

        async def body():
            async with await client.schedule("guard-cancel", isl_tokens=32) as lease:
                holder["lease"] = lease
                await asyncio.sleep(30)

        task = asyncio.create_task(body())
        assert await asyncio.to_thread(wait_until, lambda: "lease" in holder, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert holder["lease"].outcome == "aborted"
    assert wait_until(lambda: active_leases(session_daemon.admin_endpoint) == 0)


async def test_lease_released_when_garbage_collected_open(session_daemon):
    async with SchedulerClient(session_daemon.endpoint) as client:
        lease = await client.schedule("guard-gc", isl_tokens=32)
        assert await asyncio.to_thread(wait_until, lambda: active_leases(session_daemon.admin_endpoint) >= 1, 30)
        del lease
        gc.collect()
        await asyncio.sleep(0.05)  # let the loop send the queued Release
        assert await asyncio.to_thread(wait_until, lambda: active_leases(session_daemon.admin_endpoint) == 0, 30)


async def test_requeue_returns_new_lease_with_new_generation(session_daemon):
    async with SchedulerClient(session_daemon.endpoint) as client:
        lease = await client.schedule("guard-requeue", isl_tokens=32)
        again = await lease.requeue()
        assert lease.outcome == "requeued"
        assert (again.slot, again.generation) != (lease.slot, lease.generation)
        async with again:
            pass
    assert wait_until(lambda: active_leases(session_daemon.admin_endpoint) == 0)


def test_sync_client_schedules_and_releases(session_daemon):
    with SyncSchedulerClient(session_daemon.endpoint) as client:
        with client.schedule("sync-1", isl_tokens=48, block_hashes=[5, 6, 7]) as lease:
            lease.dispatched()
            lease.add_output_tokens(3)
        assert lease.outcome == "completed"
    assert wait_until(lambda: active_leases(session_daemon.admin_endpoint) == 0)


async def test_connect_raises_daemon_unavailable_naming_endpoint_when_nobody_listens(tmp_path):
    from kvsched.errors import DaemonUnavailable

    endpoint = f"ipc://{tmp_path}/nobody.sock"
    with pytest.raises(DaemonUnavailable, match=r"nobody.sock"):
        await SchedulerClient(endpoint, connect_timeout_s=0.3).connect()


async def test_bad_token_counts_raise_at_the_call_and_the_lease_still_releases(session_daemon):
    """A float output count, a context count out of the wire's bounds or a total past 2**31 - 1 used to
    reach the Release, which the daemon refused: the lease stayed booked until the router exited
    while the client said "completed". They raise at the call now and nothing is counted."""
    async with SchedulerClient(session_daemon.endpoint) as client:
        lease = await client.schedule("bad-counts", isl_tokens=812)
        lease.add_output_tokens(3)
        with pytest.raises(TypeError, match="n must be an int"):
            lease.add_output_tokens(len("some generated text") / 4)
        with pytest.raises(TypeError):
            lease.add_output_tokens(True)
        with pytest.raises(ValueError, match="bound"):
            lease.add_output_tokens(2**31 - 812)  # 812 + 3 + this > 2**31 - 1
        with pytest.raises(ValueError, match="outside"):
            lease.add_output_tokens(-1)
        assert lease.output_tokens == 3
        for bad, err in ((-5, ValueError), ("x", TypeError), (2**40, ValueError), (1.0, TypeError)):
            with pytest.raises(err):
                lease.release(context_tokens=bad)
            assert lease.outcome is None  # still open: the caller can release it properly
        lease.release()
        assert lease.outcome == "completed"
        assert not client.errors, client.errors
    assert await asyncio.to_thread(wait_until, lambda: active_leases(session_daemon.admin_endpoint) == 0, 30)


async def test_an_int_subclass_context_count_is_sent_and_the_lease_released(session_daemon):
    """Found from outside: `release(context_tokens=MyInt(120))` marked the lease completed, then the
    frame encoder refused the int subclass: nothing was sent and the daemon held the lease."""

    class MyInt(int):
        pass

    async with SchedulerClient(session_daemon.endpoint) as client:
        lease = await client.schedule("myint-rel", isl_tokens=100)
        lease.release(context_tokens=MyInt(120))
        assert lease.outcome == "completed"
    assert await asyncio.to_thread(wait_until, lambda: active_leases(session_daemon.admin_endpoint) == 0, 30)
