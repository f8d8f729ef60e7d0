"""A daemon whose own loop stalls does not reap the routers that kept talking to it (real processes).

Liveness is "nothing arrived from the peer for `liveness_timeout_ms`" (docs/PROTOCOL.md, "Liveness").
When the daemon cannot read (its loop blocked, or the process not scheduled on a loaded host), the
heartbeats peers send pile up unread; after the stall its periodic timer, and so the reaper, runs
before the socket is read. The stall is reproduced with SIGSTOP / SIGCONT.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvsched import protocol as p
from tests.conftest import RawPeer, admin_call, daemon_fixture

pytestmark = pytest.mark.timeout(120)

LIVENESS_S = 3.0  # heartbeats every 0.2 s: the test process may be a couple of seconds late
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


class Beater:
    """Heartbeats on `peer` every 0.2 s from a thread (which alone uses the socket meanwhile, and
    keeps what the daemon answers), so slow admin calls in the test do not delay them."""

    def __init__(self, peer: RawPeer) -> None:
        self.peer, self.answers, self.stop = peer, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        seq = 0
        while not self.stop.is_set():
            self.peer.send(p.Heartbeat(seq))
            seq += 1
            while (frame := self.peer.recv(timeout_s=0)) is not None:
                self.answers.append(frame)
            self.stop.wait(0.2)

    def __enter__(self) -> Beater:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)
        while (frame := self.peer.recv(timeout_s=0.5)) is not None:
            self.answers.append(frame)


def test_a_daemon_stalled_past_the_liveness_timeout_keeps_the_routers_that_kept_heartbeating(daemon):
    """1. two remote peers (no pid watch) take a lease each; one heartbeats every 0.2 s throughout,
    the other goes silent, 2. the daemon is stopped (SIGSTOP) for 2 liveness timeouts, then
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
        with Beater(beating) as beater:
            time.sleep(0.5)
            os.kill(daemon.pid, signal.SIGSTOP)
            try:
                time.sleep(2 * LIVENESS_S)
            finally:
                os.kill(daemon.pid, signal.SIGCONT)
            # The daemon answers again (so its timers have run) while the router keeps heartbeating;
            # the silent peer is reaped meanwhile.
            end = time.monotonic() + 30
            while "silent-1" in (ids := _lease_ids(daemon)):
                assert "beating-1" in ids, daemon.log_tail(20)
                assert time.monotonic() < end, "the silent peer was never reaped"
                time.sleep(0.2)
            time.sleep(1.0)
            assert _lease_ids(daemon) == {"beating-1"}, daemon.log_tail(20)
        assert beater.answers and all(isinstance(f, p.HeartbeatAck) for f in beater.answers), beater.answers[-3:]
        gone = [line for line in daemon.log_path.read_text().splitlines() if "router gone" in line]
        assert len(gone) == 1 and "client=silent" in gone[0], gone
