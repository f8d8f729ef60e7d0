"""Client behaviour when the daemon is absent: fail (default) or bypass with degraded leases."""

from __future__ import annotations

import pytest

from kvsched.client import SchedulerClient
from kvsched.errors import DaemonUnavailable, LeaseError

pytestmark = pytest.mark.timeout(30)


async def test_fail_mode_raises_daemon_unavailable_naming_endpoint(tmp_path):
    endpoint = f"ipc://{tmp_path}/absent.sock"
    with pytest.raises(DaemonUnavailable, match=r"absent.sock"):
        await SchedulerClient(endpoint, connect_timeout_s=0.2).connect()


async def test_bypass_mode_returns_counted_degraded_leases_on_bypass_workers(tmp_path):
    endpoint = f"ipc://{tmp_path}/absent.sock"
    client = await SchedulerClient(
        endpoint, connect_timeout_s=0.2, on_unavailable="bypass", bypass_workers=[(4, 0), (5, 1)]
    ).connect()
    try:
        leases = [await client.schedule(f"b{i}", isl_tokens=100) for i in range(20)]
        assert all(lease.degraded for lease in leases)
        assert {lease.worker for lease in leases} <= {(4, 0), (5, 1)}
        assert client.degraded_total == 20
        pinned = await client.schedule("pinned", isl_tokens=10, pinned=(5, 1))
        assert pinned.worker == (5, 1)
        async with leases[0] as lease:
            lease.dispatched()
            lease.add_output_tokens(3)
        assert lease.outcome == "completed"
        with pytest.raises(LeaseError):
            await leases[1].requeue()
    finally:
        await client.close()


def test_bypass_needs_workers():
    with pytest.raises(ValueError):
        SchedulerClient("ipc:///nowhere", on_unavailable="bypass")


@pytest.mark.parametrize("endpoint", ["http://nope", "nope", "tcp://nohostport", "ipc://"])
def test_a_malformed_endpoint_is_refused_at_construction_naming_the_schemes(endpoint):
    """Before: accepted, then a raw ZMQError at connect(). After: ValueError naming ipc:// and tcp://."""
    with pytest.raises(ValueError, match=r"ipc://PATH or tcp://HOST:PORT"):
        SchedulerClient(endpoint)


async def test_a_missing_ipc_socket_file_is_waited_for_up_to_the_timeout_but_bypass_is_at_once(tmp_path):
    """The socket file does not exist (no daemon bound it yet): fail mode waits up to
    `connect_timeout_s` for a daemon to bind it (a router started before its daemon, as over TCP;
    tests/daemon/test_router_before_daemon.py), then names the file; bypass mode returns degraded
    leases at once."""
    import time

    endpoint = f"ipc://{tmp_path}/absent.sock"
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable, match="does not exist"):
        await SchedulerClient(endpoint, connect_timeout_s=1.0).connect()
    assert 1.0 <= time.monotonic() - t0 < 20
    t0 = time.monotonic()
    client = await SchedulerClient(
        endpoint, connect_timeout_s=60, on_unavailable="bypass", bypass_workers=[(0, 0)]
    ).connect()
    try:
        lease = await client.schedule("b", isl_tokens=10)
        assert lease.degraded
        assert time.monotonic() - t0 < 20
    finally:
        await client.close()
