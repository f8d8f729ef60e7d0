"""The KV-event SUB socket sends ZMTP heartbeats (a stopped or partitioned publisher is noticed,
docs/KV_EVENTS.md "Staleness"); libzmq 4.3 aborts the process when a heartbeat times out on a
connection whose reading it has paused because the receive queue is full (zeromq/libzmq#3937,
#4767, still open). A daemon whose loop is busy while its engines publish must survive that: the
SUB's receive queue is unbounded, so libzmq never pauses reading it.

Real processes: a daemon subscribed to a publisher that floods; the daemon's loop is blocked for
longer than the heartbeat timeout (the `KVSCHED_DEBUG_STALL_S` + SIGUSR2 debug aid), then resumes.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import zmq

from tests.conftest import admin_call, free_port, purge, start_daemon

pytestmark = pytest.mark.timeout(120)

STALL_S = 5  # > the SUB's heartbeat timeout (3 s)
ROUNDS = 4


def test_a_flood_of_kv_events_during_a_blocked_loop_never_aborts_the_daemon(tmp_path):
    from kvsched import protocol as p

    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    config = f"""
[daemon]
block_size = 16
[[workers]]
worker_id = 1
total_kv_blocks = 1000
kv_events_endpoint = "tcp://127.0.0.1:{port}"
"""
    os.environ["KVSCHED_DEBUG_STALL_S"] = str(STALL_S)
    try:
        d = start_daemon(tmp_path, config)
    finally:
        del os.environ["KVSCHED_DEBUG_STALL_S"]
    stop = threading.Event()
    sent = [0]

    def flood() -> None:  # small multipart messages, as fast as a Python PUB goes: far past 100,000 in STALL_S
        seq = 0
        while not stop.is_set():
            for _ in range(1000):
                seq += 1
                pub.send_multipart([b"", seq.to_bytes(8, "big"), b"\x93\x00\x90\x00"])
            sent[0] = seq
            time.sleep(0)

    t = threading.Thread(target=flood, daemon=True)
    try:
        time.sleep(1.5)  # connected and subscribed
        t.start()
        time.sleep(0.5)
        for _ in range(ROUNDS):  # the abort is a race: give it several chances
            os.kill(d.pid, signal.SIGUSR2)  # the loop blocks STALL_S; libzmq's I/O thread keeps receiving
            time.sleep(STALL_S + 1.5)
            if d.proc.poll() is not None:
                break
        stop.set()
        t.join()
        print(f"published {sent[0]:,} messages")
        assert d.proc.poll() is None, f"the daemon exited with {d.proc.returncode}:\n{d.log_path.read_text()[-2000:]}"
        reply = admin_call(d, p.Status())
        assert reply is not None
    finally:
        stop.set()
        pub.close(0)
        ctx.term()
        d.stop()
        purge(d.instance)
