"""A busy router is not a dead one (real daemon process, real clients).

Every client heartbeats from a thread of its own on a DEALER of its own, naming its data connection by
`Welcome.conn_token` (docs/PROTOCOL.md "Liveness"): a router whose event loop is blocked — a synchronous
call, a pure-Python loop, a burst it is busy sending — keeps its leases; a router whose process stops
or dies loses them after the liveness timeout (sooner by the pid watch when it dies).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import zmq

from kvsched import protocol as p
from kvsched.client import SchedulerClient, SyncSchedulerClient
from tests.conftest import ROOT, RawPeer, admin_call, daemon_fixture, wait_until

pytestmark = pytest.mark.timeout(180)

LIVENESS_S = 2.0  # short on purpose: every stall below lasts 2.5 times as long
STALL_S = 2.5 * LIVENESS_S
CONFIG = f"""
[daemon]
block_size = 16
liveness_timeout_ms = {int(LIVENESS_S * 1000)}
heartbeat_ms = 200

[[workers]]
worker_id = 1
total_kv_blocks = 1000000
max_num_batched_tokens = 1000000

[[workers]]
worker_id = 2
total_kv_blocks = 1000000
max_num_batched_tokens = 1000000

[[classes]]
name = "default"
prefill_busy_threshold = 1000
request_queue_limit_per_worker = 100
"""

daemon = daemon_fixture(CONFIG)


def _lease_ids(d) -> set[str]:
    return {row.request_id for row in admin_call(d, p.Leases()).leases}


def _gone_lines(d, client_name: str) -> list[str]:
    """The daemon's "router gone" log lines about `client_name`."""
    return [
        line
        for line in d.log_path.read_text().splitlines()
        if "router gone" in line and f"client={client_name} " in line
    ]


@pytest.mark.parametrize("stall", ["sleep", "busy_loop"])
async def test_a_router_keeps_its_leases_when_its_loop_stalls_past_the_liveness_timeout(daemon, stall):
    """1. a plain client (no gateway) holds two leases, 2. its event loop stalls for 2.5 times the
    liveness timeout — `time.sleep` (the GIL released) or a pure-Python busy loop (the GIL held,
    handed over every switch interval), 3. the loop runs again. Result: the daemon still holds both
    leases right after the stall and never logs the router gone; the client never reconnects; progress
    frames are accepted (no error) and the releases free the leases. Before the heartbeat thread the
    daemon reaped the router after 2 s and aborted both leases while their engines ran on."""
    name = f"stalled-{stall}"
    async with SchedulerClient(daemon.endpoint, client_name=name, attach_progress=False) as client:
        leases = [await client.schedule(f"{stall}-{i}", isl_tokens=100) for i in range(2)]
        ids = {lease.request_id for lease in leases}
        end = time.monotonic() + STALL_S
        if stall == "sleep":
            time.sleep(STALL_S)
        else:
            spins = 0
            while time.monotonic() < end:
                spins += 1
        assert ids <= _lease_ids(daemon)  # the daemon's view before this loop runs again
        assert not _gone_lines(daemon, name)
        for lease in leases:
            lease.add_output_tokens(3)  # Update frames (progress segment not mapped)
        await asyncio.sleep(1.0)  # the frames reach the daemon; an Error would come back meanwhile
        assert client.errors == [] and all(lease.outcome is None for lease in leases)
        assert client._link.reconnects == 0
        for lease in leases:
            lease.release()
    assert wait_until(lambda: not ids & _lease_ids(daemon), 30)
    assert not _gone_lines(daemon, name)


def test_a_sync_client_keeps_its_leases_when_its_loop_thread_stalls(daemon):
    """1. a `SyncSchedulerClient` holds a lease, 2. a call on its loop thread blocks that thread for 2.5
    times the liveness timeout. Result: the lease stays held and is released normally; the daemon never
    logs the router gone."""
    with SyncSchedulerClient(daemon.endpoint, client_name="sync-stalled") as client:
        lease = client.schedule("sync-stalled-1", isl_tokens=100)
        client.call(time.sleep, STALL_S)  # runs on the client's loop thread: that loop is blocked
        assert "sync-stalled-1" in _lease_ids(daemon)
        assert not _gone_lines(daemon, "sync-stalled")
        lease.release()
    assert wait_until(lambda: "sync-stalled-1" not in _lease_ids(daemon), 30)


async def test_a_routers_leases_survive_a_flood_its_own_process_sends(daemon):
    """1. a router holds two leases, 2. the same process floods the daemon on another connection — as
    many Enqueues as it can send for 2.5 times the liveness timeout, its event loop busy with nothing
    else meanwhile (as a gateway forwarding a burst), 3. the flood stops. Result: the router's leases
    survive and it is never logged gone, though the daemon read tens of thousands of frames meanwhile."""
    async with SchedulerClient(daemon.endpoint, client_name="beside-flood") as client:
        leases = [await client.schedule(f"beside-{i}", isl_tokens=100, pinned=(2, 0)) for i in range(2)]
        with RawPeer(daemon.endpoint) as flooder:
            flooder.hello("flooder")
            enc = p.make_encoder()
            sent = 0
            end = time.monotonic() + STALL_S
            while time.monotonic() < end:  # never blocks: a full queue only spins the loop
                try:
                    flooder.sock.send(enc.encode(p.Enqueue(f"flood-{sent}", 100, pinned=(1, 0))), zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    pass
            assert sent > 10_000, sent
            assert {"beside-0", "beside-1"} <= _lease_ids(daemon)
        assert not _gone_lines(daemon, "beside-flood")
        await asyncio.sleep(0.5)
        assert all(lease.outcome is None for lease in leases) and client._link.reconnects == 0
        for lease in leases:
            lease.release()


def test_a_flood_past_the_receive_queue_never_aborts_the_daemon(daemon):
    """1. one connection sends Enqueues as fast as it can for 2.5 times the liveness timeout — far more
    than the data socket's receive queue holds (100,000), so ZeroMQ pauses reading it while the actor
    catches up, 2. again on a new connection. Result: the daemon process is alive and answers after
    each round. Before, libzmq aborted the daemon ("Assertion failed: !_io_error") in most such runs:
    a paused connection's ZMTP heartbeat timed out and was then resumed (zeromq/libzmq issue 3937)."""
    enc = p.make_encoder()
    for round_ in range(2):
        with RawPeer(daemon.endpoint) as flooder:
            flooder.hello(f"flooder-{round_}")
            sent, end = 0, time.monotonic() + STALL_S
            while time.monotonic() < end:
                try:
                    flooder.sock.send(enc.encode(p.Enqueue(f"r{round_}-{sent}", 100)), zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    pass
        time.sleep(1.0)  # the actor drains the queue, and ZeroMQ resumes reading the connection
        assert daemon.proc.poll() is None, [
            line for line in daemon.log_path.read_text().splitlines() if "Assertion" in line
        ]
        assert admin_call(daemon, p.Status()).workers == 2


ROUTER = textwrap.dedent("""
    import asyncio, logging, os, signal, sys, time
    from kvsched.client import SchedulerClient
    from kvsched.errors import LeaseLost

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    async def main(endpoint):
        logged = Lines()
        logging.getLogger("kvsched.client").addHandler(logged)
        client = await SchedulerClient(endpoint, client_name="stopped-router", attach_progress=False,
                                       reconnect_deadline_s=60).connect()
        epoch = client.welcome.daemon_epoch
        held = await client.schedule("held", isl_tokens=10)
        print("HELD", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # the test now holds the blocker
        late = asyncio.ensure_future(client.schedule("late", isl_tokens=10))  # waits behind it
        await asyncio.sleep(0.5)
        reconnects = client._link.reconnects
        print("STOPPING", flush=True)
        time.sleep(0.3)  # nothing more leaves this loop; ZeroMQ writes what it has queued
        os.kill(os.getpid(), signal.SIGSTOP)  # the whole process stops here, its heartbeat thread too
        held.add_output_tokens(1)  # resumed: a frame at once (progress segment not mapped)
        late_lease = await asyncio.wait_for(late, 30)  # answered while stopped, read after the resume
        for _ in range(600):
            if held.outcome is not None and late_lease.outcome is not None:
                break
            await asyncio.sleep(0.05)
        assert client._link.reconnects > reconnects and client.welcome.daemon_epoch == epoch
        for lease in (held, late_lease):
            assert lease.outcome == "lost", lease.outcome
            for call in (lambda: lease.add_output_tokens(1), lease.dispatched, lease.prefill_done):
                try:
                    call()
                except LeaseLost as exc:
                    assert "declared this router dead" in str(exc), exc
                else:
                    raise AssertionError("a progress call on a lost lease did not raise")
            try:
                await lease.requeue()
            except LeaseLost:
                pass
            else:
                raise AssertionError("requeue of a lost lease did not raise")
            lease.release("completed")  # quiet no-ops, logged once
            lease.release("completed")
            async with lease:
                pass
        releases = [line for line in logged.lines if "release(completed) of lost lease" in line]
        assert len(releases) == 2, releases  # once per lease
        print("LOST", held.lost_reason, flush=True)
        await asyncio.sleep(1.0)
        await client.close()

    asyncio.run(main(sys.argv[1]))
""")


def _stopped(pid: int) -> bool:
    """The process is stopped (state T in /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


async def test_a_stopped_router_is_declared_dead_and_told_so_when_it_resumes(daemon):
    """1. a router process holds lease "held" and waits for "late" behind the test's blocker, 2. it is
    stopped (SIGSTOP; its heartbeat thread stops with it), 3. the blocker is released, so "late" is
    admitted to the stopped router, 4. past the liveness timeout the daemon declares it dead and frees
    both, 5. SIGCONT. Result: silence still kills (no pid watch needed: the process exists); on resuming
    the router says Hello on a new connection before any other frame (the daemon never answers
    NOT_HELLO, though a progress frame is sent at once and the late Admitted sat unread), and both
    leases are "lost" with a reason saying it was declared dead: their progress calls and requeue()
    raise LeaseLost naming it, release() and the guard's exit are quiet no-ops (logged once per
    lease), and the daemon holds nothing for the router afterwards. (The router stops itself, between
    two loop turns, so that no frame it sent before is still in flight when it stops.)"""
    proc = subprocess.Popen(
        [sys.executable, "-c", ROUTER, daemon.endpoint],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        assert (await asyncio.to_thread(proc.stdout.readline)).strip() == "HELD"
        async with SchedulerClient(daemon.endpoint, client_name="blocker") as client:
            blocker = await client.schedule("blocker", isl_tokens=2000, pinned=(1, 0))
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert (await asyncio.to_thread(proc.stdout.readline)).strip() == "STOPPING"
            assert await asyncio.to_thread(wait_until, lambda: _stopped(proc.pid), 30)
            try:
                blocker.release()
                assert await asyncio.to_thread(wait_until, lambda: _gone_lines(daemon, "stopped-router"), 30)
                assert not {"held", "late"} & await asyncio.to_thread(_lease_ids, daemon)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            out, err = await asyncio.to_thread(proc.communicate, None, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "LOST" in out and "declared this router dead after 2.0 s" in out, out
    assert "restart" not in out.replace("did not restart", ""), out
    assert "NOT_HELLO" not in daemon.log_path.read_text()
    assert not {"held", "late"} & _lease_ids(daemon)


def test_heartbeats_on_a_dealer_of_their_own_keep_a_silent_data_connection_alive(daemon):
    """The wire contract, with bare sockets: 1. a data connection says Hello (the Welcome names a
    non-zero `conn_token`, another one per connection) and takes a lease, then sends nothing more,
    2. a second DEALER sends `heartbeat{seq, conn_token}` every 0.2 s for 2.5 times the liveness timeout,
    each answered `heartbeat_ack{seq}`, 3. the heartbeats stop. Result: the lease lives while they
    come, the heartbeat DEALER is no connection of its own (`status` counts one), and silence then
    frees the lease after the liveness timeout."""
    with RawPeer(daemon.endpoint) as data, RawPeer(daemon.endpoint) as other, RawPeer(daemon.endpoint) as beat:
        connections = admin_call(daemon, p.Status()).connections
        data.send(p.Hello(p.PROTOCOL_VERSION, "token-data"))
        welcome = data.recv()
        other.send(p.Hello(p.PROTOCOL_VERSION, "token-other"))
        other_welcome = other.recv()
        assert isinstance(welcome, p.Welcome) and welcome.conn_token != 0
        assert isinstance(other_welcome, p.Welcome) and other_welcome.conn_token not in (0, welcome.conn_token)
        data.send(p.Enqueue("token-lease", 100))
        assert isinstance(data.recv(), p.Admitted)
        end, seq = time.monotonic() + STALL_S, 0
        while time.monotonic() < end:
            seq += 1
            beat.send(p.Heartbeat(seq, welcome.conn_token))
            ack = beat.recv(10)
            assert isinstance(ack, p.HeartbeatAck) and ack.seq == seq, ack
            if seq == 1:  # data and other (not yet reaped for its silence); never beat
                assert admin_call(daemon, p.Status()).connections == connections + 2
            time.sleep(0.2)
        assert "token-lease" in _lease_ids(daemon)
        assert wait_until(lambda: "token-lease" not in _lease_ids(daemon), 30)
        assert _gone_lines(daemon, "token-data")


async def test_a_heartbeat_naming_no_open_connection_is_answered_and_changes_nothing(daemon):
    """1. a router holds a lease, 2. a bare peer takes a lease and goes away (reaped after the liveness
    timeout), 3. a stray DEALER sends heartbeats whose `conn_token` names no open connection: a random
    one, the largest one, and the reaped connection's. Result: each is answered `error{code=3}` naming
    the token; none opens a connection (the count stays) or revives the reaped one, and the router's
    lease is untouched. Before, each such heartbeat opened a connection of its own."""
    async with SchedulerClient(daemon.endpoint, client_name="bystander") as client:
        lease = await client.schedule("bystander-1", isl_tokens=100)
        with RawPeer(daemon.endpoint) as gone:
            gone.send(p.Hello(p.PROTOCOL_VERSION, "gone-peer"))
            stale = gone.recv().conn_token
            gone.send(p.Enqueue("gone-lease", 100))
            assert isinstance(gone.recv(), p.Admitted)
        assert await asyncio.to_thread(wait_until, lambda: _gone_lines(daemon, "gone-peer"), 30)
        connections = (await asyncio.to_thread(admin_call, daemon, p.Status())).connections
        with RawPeer(daemon.endpoint) as stray:
            for seq, token in enumerate((0x5EED_0000_0001, 2**63 - 1, stale) * 3, start=1):
                stray.send(p.Heartbeat(seq, token))
                err = await asyncio.to_thread(stray.recv, 10)
                assert isinstance(err, p.Error) and err.code == p.ErrorCode.NOT_HELLO, err
                assert "conn_token" in err.message, err.message
            status = await asyncio.to_thread(admin_call, daemon, p.Status())
            assert status.connections == connections
        assert lease.outcome is None and "bystander-1" in await asyncio.to_thread(_lease_ids, daemon)
        lease.release()
        await asyncio.sleep(0.2)
        assert client.errors == [] and client._link.reconnects == 0
