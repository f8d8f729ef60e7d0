"""A router's mapped progress words after a daemon restart that created new segments.

A daemon stopped with no live lease unlinks its segments; the next daemon of the instance creates
new ones under the same names. A router that kept its old mapping would store `dispatched`,
`prefill_done` and output tokens into the unlinked segment, which the new daemon never reads: its
leases would stay `admitted` with their prefill tokens booked until release (README, "When things
fail"; docs/PROTOCOL.md "Shared memory (local routers)").
"""

from __future__ import annotations

import asyncio

import pytest

from kvsched import protocol as p
from kvsched.client import AdminClient, SchedulerClient
from tests.conftest import purge, start_daemon, wait_until

pytestmark = pytest.mark.timeout(150)

CONFIG = """
[daemon]
block_size = 16
heartbeat_ms = 100
max_slots = 64

[[workers]]
worker_id = 1
"""


def _lease_row(admin_endpoint: str, request_id: str):
    with AdminClient(admin_endpoint) as admin:
        rows = [r for r in admin.call(p.Leases()).leases if r.request_id == request_id]
    return rows[0] if rows else None


def test_progress_stores_reach_a_daemon_that_recreated_its_segments(tmp_path):
    """1. a router completes one lease (its words are mapped), 2. the daemon stops cleanly with no
    lease live (segments unlinked), 3. a new daemon of the same instance starts (new segments),
    4. the router, reconnected, reports dispatched / prefill_done / 7 output tokens by stores.
    Result: the new daemon sees the lease prefill_done with 7 output tokens and no prefill booked."""
    daemon = start_daemon(tmp_path, CONFIG)
    instance = daemon.instance
    state = {"daemon": daemon}

    async def run() -> None:
        async with SchedulerClient(daemon.endpoint, reconnect_deadline_s=60) as client:
            lease = await client.schedule("before", isl_tokens=64, block_hashes=[1, 2, 3, 4])
            async with lease:
                lease.dispatched()
                lease.prefill_done()
                lease.add_output_tokens(5)
            await asyncio.to_thread(daemon.stop)
            state["daemon"] = second = await asyncio.to_thread(start_daemon, tmp_path, CONFIG, instance=instance)
            lease = await client.schedule("after", isl_tokens=64, block_hashes=[5, 6, 7, 8])
            lease.dispatched()
            lease.prefill_done()
            lease.add_output_tokens(7)

            def seen() -> bool:
                row = _lease_row(second.admin_endpoint, "after")
                return row is not None and row.state == "prefill_done" and row.output_tokens == 7

            ok = await asyncio.to_thread(wait_until, seen, 30, 0.1)
            row = await asyncio.to_thread(_lease_row, second.admin_endpoint, "after")
            lease.release("completed")
            assert ok, f"the restarted daemon never saw the router's stores: {row}"

    try:
        asyncio.run(run())
    finally:
        state["daemon"].stop()
        purge(instance)
