"""`kvsched remove-worker` with live leases on that worker, against a real daemon process.

The contract (docs/PROTOCOL.md "Scheduling contracts"): the daemon releases the worker's bookings and
sends each lease's holder `rejected{no_endpoints, detail naming the worker}` as a revocation notice;
the Python client marks the lease "lost" with that reason, its progress calls raise `LeaseLost`,
its release is a quiet no-op. A version-1 peer receives the same (already known) frame.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from kvsched import protocol as p
from kvsched.client import AdminClient, LeaseLost, SchedulerClient
from tests.conftest import TWO_WORKERS, RawPeer, daemon_fixture, free_port, purge, start_daemon, wait_until
from tests.ops.test_metrics import scrape, value

pytestmark = pytest.mark.timeout(90)

daemon = daemon_fixture(TWO_WORKERS)


def _active(admin_endpoint: str) -> int:
    with AdminClient(admin_endpoint) as admin:
        return admin.call(p.Status()).active_leases


async def test_lease_on_a_removed_worker_is_lost_with_the_reason_and_release_is_quiet(daemon):
    """1. a lease pinned on worker 1 and one on worker 2, 2. `kvsched remove-worker 1` (the real CLI),
    Result: the first lease turns "lost" naming the removal, its progress calls raise LeaseLost,
    its release returns quietly and sends nothing the daemon refuses; the other lease is untouched."""
    async with SchedulerClient(daemon.endpoint, client_name="rm") as client:
        gone = await client.schedule("rm-gone", isl_tokens=100, pinned=(1, 0))
        kept = await client.schedule("rm-kept", isl_tokens=100, pinned=(2, 0))
        gone.dispatched()
        cli = await asyncio.to_thread(  # in a thread: a blocked event loop would get this router reaped
            subprocess.run,
            [sys.executable, "-m", "kvsched.cli", "--admin-endpoint", daemon.admin_endpoint, "remove-worker", "1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stderr
        assert await asyncio.to_thread(wait_until, lambda: gone.outcome == "lost", 10)
        assert "1:0" in gone.lost_reason and "removed" in gone.lost_reason
        assert client.lost_leases == ["rm-gone"]
        with pytest.raises(LeaseLost, match="removed"):
            gone.add_output_tokens(3)
        with pytest.raises(LeaseLost):
            gone.prefill_done()
        gone.release("completed")  # quiet no-op
        assert gone.outcome == "lost"
        assert kept.outcome is None
        kept.add_output_tokens(2)
        kept.release("completed")
        assert await asyncio.to_thread(wait_until, lambda: _active(daemon.admin_endpoint) == 0, 10)
        await asyncio.sleep(0.3)
        assert client.errors == []  # no update/release reached the daemon for the lost lease


def test_version_1_peer_gets_the_revocation_as_a_known_rejected_frame(daemon):
    with RawPeer(daemon.endpoint) as peer:
        peer.hello(version=1)
        peer.send(p.Enqueue("v1-gone", 32, pinned=(2, 0)))
        admitted = peer.recv()
        assert isinstance(admitted, p.Admitted) and admitted.worker_id == 2
        with AdminClient(daemon.admin_endpoint) as admin:
            assert isinstance(admin.call(p.RemoveWorker(worker_id=2)), p.OkReply)
        notice = peer.recv()
        assert isinstance(notice, p.Rejected), notice
        assert (notice.request_id, notice.reason) == ("v1-gone", "no_endpoints")
        assert "2:0" in notice.detail
        peer.send(p.Release("v1-gone", admitted.slot, admitted.generation, "completed", 40))  # stale: no-op
        peer.send(p.Heartbeat(7))
        assert peer.recv() == p.HeartbeatAck(7)  # nothing else was owed (no error for the stale release)


def test_revocation_notices_are_not_counted_as_rejections(tmp_path):
    """`kvsched_rejections_total` counts requests refused; a lease revoked because its worker was
    removed was admitted, so the removal of a busy worker must not inflate the rejection rate
    (the rejection-rate alert of deploy/). A waiting request stranded by the removal is counted."""
    port = free_port()
    d = start_daemon(tmp_path, TWO_WORKERS.replace("[daemon]", f"[daemon]\nmetrics_port = {port}"))
    try:
        with RawPeer(d.endpoint) as peer:
            peer.hello()
            for i in range(3):
                peer.send(p.Enqueue(f"m-{i}", 32, pinned=(1, 0)))
                assert isinstance(peer.recv(), p.Admitted)
            peer.send(p.Enqueue("m-big", 1500, pinned=(2, 0)))  # fills worker 2's prefill budget
            assert isinstance(peer.recv(), p.Admitted)
            peer.send(p.Enqueue("m-wait", 32, pinned=(2, 0)))  # waits for worker 2
            peer.send(p.Heartbeat(1))
            assert peer.recv() == p.HeartbeatAck(1)
            with AdminClient(d.admin_endpoint) as admin:
                admin.call(p.RemoveWorker(worker_id=2))
                admin.call(p.RemoveWorker(worker_id=1))
            got = [peer.recv() for _ in range(5)]
            assert sorted((f.request_id, f.reason) for f in got) == [
                ("m-0", "no_endpoints"),
                ("m-1", "no_endpoints"),
                ("m-2", "no_endpoints"),
                ("m-big", "no_endpoints"),
                ("m-wait", "no_endpoints"),
            ]
        assert wait_until(lambda: value(scrape(port), "kvsched_rejections_total", reason="no_endpoints") == 1, 10), (
            scrape(port)
        )
    finally:
        d.stop()
        purge(d.instance)
