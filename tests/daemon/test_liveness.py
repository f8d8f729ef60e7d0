"""Client liveness against a live daemon, and requeues in flight across a daemon crash (real processes).

The client heartbeats when it has sent nothing or received nothing for `heartbeat_ms`; the daemon is
presumed gone only when no frame at all arrived for the liveness timeout. `Reattach.requeues` re-sends
a requeue the daemon never answered.
"""

from __future__ import annotations

import asyncio

import pytest

from kvsched import protocol as p
from kvsched.client import SchedulerClient
from tests.conftest import admin_call, daemon_fixture

pytestmark = pytest.mark.timeout(150)

# One worker; the class is busy once 1000 prefill tokens run on it, so later requests wait.
BUSY_CONFIG = """
[daemon]
block_size = 16
liveness_timeout_ms = 1500
heartbeat_ms = 200

[[workers]]
worker_id = 1
total_kv_blocks = 100000
max_num_batched_tokens = 100000

[[classes]]
name = "default"
prefill_busy_threshold = 1000
"""


daemon = daemon_fixture(BUSY_CONFIG)
# A longer liveness timeout where the test must not see a reconnect: on a loaded 2-core machine a
# heartbeat's answer was once later than 1.5 s (the router reconnected against a live daemon).
SLOW_LIVENESS_MS = 3000
slow_daemon = daemon_fixture(
    BUSY_CONFIG.replace("liveness_timeout_ms = 1500", f"liveness_timeout_ms = {SLOW_LIVENESS_MS}"), name="slow_daemon"
)


async def _status(d) -> p.StatusReply:
    return await asyncio.to_thread(admin_call, d, p.Status())


async def test_a_router_whose_requests_wait_never_reconnects_to_a_live_daemon(slow_daemon):
    """1. a router holds a lease that makes the worker busy, 2. it sends a new request every 100 ms
    for twice the liveness timeout (it never stops sending; every request waits, so the daemon
    answers nothing). Result: the client never presumes the daemon gone (no reconnect, no Reattach,
    one connection), and every waiting request is admitted once the blocker is released."""
    daemon = slow_daemon
    async with SchedulerClient(daemon.endpoint) as client:
        blocker = await client.schedule("blocker", isl_tokens=2000)
        waiting = []
        loop = asyncio.get_running_loop()
        end = loop.time() + 2 * SLOW_LIVENESS_MS / 1000
        while loop.time() < end:
            waiting.append(asyncio.ensure_future(client.schedule(f"wait-{len(waiting)}", isl_tokens=100)))
            await asyncio.sleep(0.1)
        assert not any(w.done() for w in waiting)
        assert "reattach" not in daemon.log_path.read_text()
        assert client._link.reconnects == 0
        assert (await _status(daemon)).connections == 1
        blocker.release()
        for fut in asyncio.as_completed(waiting, timeout=30):
            (await fut).release()


async def test_a_requeue_in_flight_survives_a_daemon_crash(daemon):
    """1. lease B is admitted, then a blocker makes the worker busy, 2. B is requeued (it now waits in
    the daemon), 3. the daemon is SIGKILLed and restarted, 4. the client reconnects and Reattaches,
    5. the blocker is released. Result: B's requeue is answered with a new lease (it was re-sent in
    Reattach.requeues) instead of waiting forever."""
    async with SchedulerClient(daemon.endpoint, reconnect_deadline_s=60) as client:
        b = await client.schedule("requeued-b", isl_tokens=10)
        blocker = await client.schedule("blocker", isl_tokens=2000)
        requeue = asyncio.ensure_future(b.requeue())
        await asyncio.sleep(0.5)
        assert not requeue.done()
        await asyncio.to_thread(daemon.kill)
        await asyncio.to_thread(daemon.restart)
        loop = asyncio.get_running_loop()
        end = loop.time() + 20
        while "kept=1" not in daemon.log_path.read_text() and loop.time() < end:
            await asyncio.sleep(0.1)  # the Reattach kept the blocker's lease
        assert not requeue.done()
        blocker.release()
        new_b = await asyncio.wait_for(requeue, 20)
        assert new_b.request_id == "requeued-b" and not new_b.closed
        new_b.release()


async def test_hello_is_the_first_frame_on_every_new_connection(daemon):
    """1. a router holds a lease and the daemon is SIGKILLed and restarted while heartbeats fall due,
    2. the router reconnects. Result: the reconnect says Hello first — the daemon never rejects a frame
    with NOT_HELLO (before: a heartbeat or a lease frame went out on the old connection first). The
    same after a reap for silence: tests/daemon/test_busy_router.py (a SIGSTOPped router)."""
    async with SchedulerClient(daemon.endpoint, reconnect_deadline_s=60) as client:
        lease = await client.schedule("kept", isl_tokens=10)
        await asyncio.to_thread(daemon.kill)
        await asyncio.sleep(1.0)  # heartbeats fall due while no daemon runs
        await asyncio.to_thread(daemon.restart)
        loop = asyncio.get_running_loop()
        end = loop.time() + 20
        while "kept=1" not in daemon.log_path.read_text() and loop.time() < end:
            await asyncio.sleep(0.1)
        assert "kept=1" in daemon.log_path.read_text()
        lease.dispatched()
        await asyncio.sleep(1.0)
        assert lease.outcome is None and client.connected
        assert "NOT_HELLO" not in daemon.log_path.read_text()


async def test_a_frame_from_a_connection_reaped_for_silence_is_told_why(daemon):
    """1. a raw peer says Hello, then stays silent past the liveness timeout (reaped: "router
    gone"), 2. it sends an Enqueue on the same connection. Result: error NOT_HELLO whose message
    says the connection was declared dead after the liveness timeout and what was released (was
    the bare "send Hello first", which does not say why)."""
    from tests.conftest import RawPeer, wait_until

    with RawPeer(daemon.endpoint) as peer:
        peer.hello(client_name="silent-raw")
        assert await asyncio.to_thread(
            wait_until,
            lambda: (
                "router gone" in daemon.log_path.read_text()
                and "client=silent-raw" in daemon.log_path.read_text().split("router gone", 1)[1]
            ),
            60,
        )
        peer.send(p.Enqueue("after-reap", 32))
        err = await asyncio.to_thread(peer.recv)
    assert isinstance(err, p.Error) and err.code == p.ErrorCode.NOT_HELLO, err
    assert "declared dead after more than 1500 ms without a frame" in err.message, err.message
    assert "leases" in err.message


async def test_a_connection_whose_hello_named_a_dead_pid_is_told_why_once(daemon):
    """1. a raw peer on this host and PID namespace says Hello with the pid of a process that has
    exited (a client reporting a wrong pid), 2. the daemon reaps it at its next liveness check,
    3. the peer sends a Heartbeat, then another. Result: one error NOT_HELLO naming the pid, then
    silence (before: silence from the first frame on)."""
    import socket
    import subprocess
    import sys

    from kvsched.daemon.connections import pid_namespace_id
    from tests.conftest import RawPeer, wait_until

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with RawPeer(daemon.endpoint) as peer:
        peer.send(p.Hello(p.PROTOCOL_VERSION, "wrong-pid", gone.pid, socket.gethostname(), pid_namespace_id()))
        assert isinstance(await asyncio.to_thread(peer.recv), p.Welcome)
        assert await asyncio.to_thread(
            wait_until,
            lambda: (
                "router gone" in daemon.log_path.read_text()
                and "client=wrong-pid" in daemon.log_path.read_text().split("router gone", 1)[1]
            ),
            30,
        )
        peer.send(p.Heartbeat(1))
        err = await asyncio.to_thread(peer.recv, 10)
        assert isinstance(err, p.Error) and err.code == p.ErrorCode.NOT_HELLO, err
        assert f"pid {gone.pid}" in err.message, err.message
        peer.send(p.Heartbeat(2))
        assert await asyncio.to_thread(peer.recv, 1.5) is None
