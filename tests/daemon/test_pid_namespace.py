"""A router in another PID namespace (a sidecar container sharing IPC and host name) keeps its leases.

Its pids mean nothing in the daemon's namespace, so the daemon must judge it on heartbeats only.
Reproduced with `unshare -pf --mount-proc` (needs root or user namespaces); skipped where unshare
cannot create a PID namespace.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from kvsched import protocol as p
from tests.conftest import ROOT, RawPeer, admin_call, daemon_fixture, wait_until

pytestmark = pytest.mark.timeout(120)

# Liveness 4 s, heartbeats every 0.2 s: a router that keeps heartbeating is not reaped even when a
# loaded 2-core machine delays it by a few seconds (the pid watch, when wrongly applied, acts in ~0.1 s).
LIVENESS_S = 4.0
CONFIG = f"""
[daemon]
block_size = 16
liveness_timeout_ms = {int(LIVENESS_S * 1000)}
heartbeat_ms = 200

[[workers]]
worker_id = 1
total_kv_blocks = 100000
max_num_batched_tokens = 100000
"""

ROUTER = textwrap.dedent("""
    import asyncio, os, sys
    from kvsched.client import SchedulerClient

    async def main(endpoint):
        async with SchedulerClient(endpoint, client_name="sidecar") as client:
            lease = await client.schedule("sidecar-1", isl_tokens=100)
            print("LEASED", os.getpid(), flush=True)
            await asyncio.to_thread(sys.stdin.readline)  # hold the lease (heartbeating) until told
            print("STATE", lease.outcome, client._link.reconnecting_since is None, len(client.lost_leases), flush=True)
            lease.release()

    asyncio.run(main(sys.argv[1]))
""")


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "-pf", "--mount-proc", "true"], timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


daemon = daemon_fixture(CONFIG)
# Liveness far longer than any wait below: whatever drops a lease here is the pid watch.
long_daemon = daemon_fixture(
    CONFIG.replace(f"liveness_timeout_ms = {int(LIVENESS_S * 1000)}", "liveness_timeout_ms = 120000"),
    name="long_daemon",
)


def _leases(d) -> int:
    return admin_call(d, p.Status()).active_leases


@pytest.mark.skipif(not _unshare_works(), reason="unshare cannot create a PID namespace here")
def test_router_in_another_pid_namespace_keeps_its_lease(daemon, tmp_path):
    """1. a router runs in its own PID namespace (same host name, same ipc socket) and takes a lease,
    2. it holds the lease for twice the liveness timeout while heartbeating.
    Result: the daemon never declares it gone; the lease stays live and the client never reconnects."""
    script = tmp_path / "router.py"
    script.write_text(ROUTER)
    # Burn some pids inside the namespace so the router's pid is not a low one that also exists here.
    shell = f"i=0; while [ $i -lt 300 ]; do /bin/true; i=$((i+1)); done; {sys.executable} {script} {daemon.endpoint}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        ["unshare", "-pf", "--mount-proc", "sh", "-c", shell],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline().split()
        assert line and line[0] == "LEASED", line
        inner_pid = int(line[1])
        assert not os.path.exists(f"/proc/{inner_pid}"), "premise: the namespaced pid must not exist here"
        assert _leases(daemon) == 1
        time.sleep(2 * LIVENESS_S)  # twice the liveness timeout; a wrong pid watch drops it within ~0.1 s
        assert _leases(daemon) == 1
        proc.stdin.write("go\n")
        proc.stdin.flush()
        state = proc.stdout.readline().split()
        assert state == ["STATE", "None", "True", "0"], state
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert wait_until(lambda: _leases(daemon) == 0, 30)
    assert "router gone" not in daemon.log_path.read_text()


def _dead_pid() -> int:
    """A pid that no longer exists."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    return dead.pid


def test_foreign_namespace_hello_is_judged_on_heartbeats_only(daemon):
    """1. a raw peer says Hello with this host's name, a pid that does not exist here and a foreign
    pid_ns, takes a lease and keeps heartbeating. Result: the lease stays live past the liveness
    timeout. 2. it goes silent: the lease is freed by liveness."""
    import socket

    with RawPeer(daemon.endpoint) as peer:
        peer.send(p.Hello(p.PROTOCOL_VERSION, "foreign", _dead_pid(), socket.gethostname(), _pid_namespace_id() + 1))
        assert isinstance(peer.recv(), p.Welcome)
        peer.send(p.Enqueue("foreign-1", 100))
        assert isinstance(peer.recv(), p.Admitted)
        end = time.monotonic() + 1.25 * LIVENESS_S
        seq = 0
        while time.monotonic() < end:
            peer.send(p.Heartbeat(seq))
            assert isinstance(peer.recv(), p.HeartbeatAck)
            seq += 1
            time.sleep(0.25)
        assert _leases(daemon) == 1
    assert wait_until(lambda: _leases(daemon) == 0, 30)  # silent now: reaped on liveness


def test_same_namespace_hello_with_a_dead_pid_is_dropped_by_the_pid_watch(long_daemon):
    """The same Hello with this namespace's id, to a daemon whose liveness timeout is 120 s: the
    dead pid is noticed and the lease freed long before liveness could (within 30 s; ~0.1 s)."""
    import socket

    with RawPeer(long_daemon.endpoint) as peer:
        peer.send(p.Hello(p.PROTOCOL_VERSION, "local", _dead_pid(), socket.gethostname(), _pid_namespace_id()))
        assert isinstance(peer.recv(), p.Welcome)
        peer.send(p.Enqueue("local-1", 100))
        # The pid watch (~0.1 s) may drop this router before its Enqueue is read — then nothing is
        # admitted: the Enqueue gets nothing, or (the first frame after the drop) the notice that the
        # connection was closed because its Hello's process is dead; either way no lease survives.
        reply = peer.recv(timeout_s=10)
        dead_notice = (
            isinstance(reply, p.Error) and reply.code == p.ErrorCode.NOT_HELLO and "closed because" in reply.message
        )
        assert reply is None or dead_notice or isinstance(reply, p.Admitted), reply
        assert wait_until(lambda: _leases(long_daemon) == 0, 30)
    assert "router gone" in long_daemon.log_path.read_text()


def _pid_namespace_id() -> int:
    return os.stat("/proc/self/ns/pid").st_ino
