"""Scheduling guardrails through a real daemon process and the public client: a released id re-sent
in the same wake is served in order (never two leases of one session), overload vs queueing
(docs/PROTOCOL.md "Scheduling contracts")."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from kvsched import protocol as p
from kvsched.client import AdminClient, SchedulerClient
from kvsched.daemon.process import DaemonProcess
from kvsched.errors import AllOverloaded, NoEndpoints
from tests.conftest import purge, unique_instance, wait_until, write_config

pytestmark = pytest.mark.timeout(120)

BASE = """
[daemon]
block_size = 16
liveness_timeout_ms = 5000
heartbeat_ms = 200

[[workers]]
worker_id = 1
total_kv_blocks = 1000
max_num_batched_tokens = 1000
"""

OVERLOAD = (
    'default_class = "fast"\n'
    + BASE
    + """
[overload]
overload_prefill_tokens = 100

[[classes]]
name = "fast"

[[classes]]
name = "batch"
prefill_busy_threshold = 100000
"""
)

SESSIONS = (
    BASE
    + """
[[classes]]
name = "default"
admission = { type = "session_cap", max_active_per_session = 1 }
"""
)


def _start(tmp_path, text: str, env: dict | None = None) -> DaemonProcess:
    instance = unique_instance("g")
    cfg = write_config(tmp_path / f"{instance}.toml", text)
    return DaemonProcess.start(cfg, instance=instance, runtime_dir=tmp_path, env=env)


def _stop(d: DaemonProcess) -> None:
    d.stop()
    purge(d.instance)


def _queues(d: DaemonProcess):
    with AdminClient(d.admin_endpoint) as admin:
        return {row.name: row for row in admin.call(p.Queues()).classes}


async def test_non_queueing_class_rejected_all_overloaded_at_once_and_queueing_class_dispatched_on_recovery(tmp_path):
    d = _start(tmp_path, OVERLOAD)
    try:
        async with SchedulerClient(d.endpoint, client_name="overload") as client:
            big = await client.schedule("big", isl_tokens=600, policy_class="batch")  # worker 1 overloaded now
            with pytest.raises(AllOverloaded) as err:
                await asyncio.wait_for(client.schedule("fast-1", isl_tokens=10, policy_class="fast"), 20)
            assert err.value.reason == "all_overloaded"
            with pytest.raises(NoEndpoints):  # the two reasons stay distinct
                await asyncio.wait_for(client.schedule("nowhere", isl_tokens=10, pinned=(9, 0)), 20)
            waiter = asyncio.create_task(client.schedule("slow-1", isl_tokens=10, policy_class="batch"))
            assert await asyncio.to_thread(wait_until, lambda: _queues(d)["batch"].depth == 1, 20)
            assert not waiter.done()
            big.prefill_done()  # the worker recovers: the queueing class is dispatched
            lease = await asyncio.wait_for(waiter, 20)
            assert (lease.worker.worker_id, lease.worker.dp_rank) == (1, 0)
            lease.release()
            big.release()
    finally:
        _stop(d)


async def test_released_id_resent_in_the_same_wake_is_served_after_its_cleanup(tmp_path):
    env = dict(os.environ, KVSCHED_DEBUG_STALL_S="2")
    d = _start(tmp_path, SESSIONS, env)
    try:
        async with SchedulerClient(d.endpoint, client_name="sessions") as client:
            a = await client.schedule("a", isl_tokens=10, session_id="s")
            b_task = asyncio.create_task(client.schedule("b", isl_tokens=10, session_id="s"))
            assert await asyncio.to_thread(wait_until, lambda: _queues(d)["default"].deferred == 1, 20)
            os.kill(d.pid, signal.SIGUSR2)  # the daemon's loop sleeps 2 s: the next frames share one wake
            await asyncio.sleep(0.5)
            a.release()
            again = asyncio.create_task(client.schedule("a", isl_tokens=10, session_id="s"))
            b = await asyncio.wait_for(b_task, 20)  # b was deferred first: it runs first
            await asyncio.sleep(0.5)
            assert not again.done(), "two leases of one session (max 1)"
            b.release()
            lease = await asyncio.wait_for(again, 20)  # served in order, never duplicate_request
            lease.release()
    finally:
        _stop(d)
