"""A daemon whose own loop stalls does not reap the routers that kept talking to it (real processes).

Liveness is "nothing arrived from the peer for `liveness_timeout_ms`" (docs/PROTOCOL.md, "Liveness").
When the daemon cannot read (its loop blocked, or the process not scheduled on a loaded host), the
heartbeats peers send pile up unread; after the stall its periodic timer, and so the reaper, runs
before the socket is read. The stall is reproduced with SIGSTOP / SIGCONT.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvsched import protocol as p
from tests.conftest import admin_call, daemon_fixture, RawPeer

pytestmark = pytest.mark.timeout(120)

LIVENESS_S = 2.0
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

daemon = daemon_fixture(CONFIG)


def _lease_ids(d) -> set[str]:
    return {row.request_id for row in admin_call(d, p.Leases()).leases}


def _beat(peer: RawPeer, seconds: float, seq: int) -> int:
    """Send a Heartbeat every 0.2 s for `seconds` (acks are read later); returns the next seq."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        peer.send(p.Heartbeat(seq))
        seq += 1
        time.sleep(0.2)
    return seq


def test_a_daemon_stalled_past_the_liveness_timeout_keeps_the_routers_that_kept_heartbeating(daemon):
    """1. two remote peers (no pid watch) take a lease each; one heartbeats every 0.2 s throughout,
    the other goes silent, 2. the daemon is stopped (SIGSTOP) for 2.5 liveness timeouts, then
    continued. Result: the heartbeating peer keeps its lease and its connection (its heartbeats are
    answered, never "send Hello first"); the silent peer is still reaped, its lease released.
    Before: the first timer after the stall reaped both (their heartbeats were unread)."""
    with RawPeer(daemon.endpoint) as beating, RawPeer(daemon.endpoint) as silent:
        beating.hello("beating")
        beating.send(p.Enqueue("beating-1", 100))
        assert isinstance(beating.recv(), p.Admitted)
        silent.hello("silent")
        silent.send(p.Enqueue("silent-1", 100))
        assert isinstance(silent.recv(), p.Admitted)
        seq = _beat(beating, 0.5, 0)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            seq = _beat(beating, 2.5 * LIVENESS_S, seq)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        # The daemon answers again (so its timers have run) while the router keeps heartbeating; the
        # silent peer is reaped meanwhile.
        end = time.monotonic() + 30
        while "silent-1" in (ids := _lease_ids(daemon)):
            assert "beating-1" in ids, daemon.log_tail(20)
            assert time.monotonic() < end, "the silent peer was never reaped"
            seq = _beat(beating, 0.2, seq)
        seq = _beat(beating, 1.0, seq)
        assert _lease_ids(daemon) == {"beating-1"}, daemon.log_tail(20)
        answers = []
        while (frame := beating.recv(timeout_s=0.5)) is not None:
            answers.append(frame)
        assert answers and all(isinstance(f, p.HeartbeatAck) for f in answers), answers[-3:]
        gone = [line for line in daemon.log_path.read_text().splitlines() if "router gone" in line]
        assert len(gone) == 1 and "client=silent" in gone[0], gone
