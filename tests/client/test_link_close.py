"""Closing the client's link delivers what it already sent: the last Release before `close()`.

A router that releases its leases and closes at once (a process shutting down, a script's last
request) must not leave those leases to the daemon's liveness timeout: ZeroMQ had the frames queued,
and a linger-0 close discarded whatever its I/O thread had not written yet (more of it on a busy
machine, where that thread runs late).
"""

from __future__ import annotations

import time

from kvsched import protocol as p

from .link_helpers import stand_in_daemon, welcome


async def test_frames_queued_behind_a_backlog_still_reach_the_daemon_after_close(tmp_path, monkeypatch):
    """1. a link is welcomed by a stand-in daemon (a ROUTER) that then does not read for a while,
    2. the link sends ~2 MB of Enqueues (more than the kernel's socket buffers hold, so the rest waits
    in ZeroMQ's queue) and then a Release, 3. it closes; 4. the daemon reads. Result: the Release
    arrives (before: the close discarded everything still queued, the Release included). The linger
    is raised for the test so that a machine too busy to move 2 MB within the shipped 2 s cannot fail it."""
    monkeypatch.setattr("kvsched.client.link.CLOSE_LINGER_MS", 60_000, raising=False)
    async with stand_in_daemon(tmp_path, "closing") as (router, link):
        await welcome(router, link)
        hashes = b"\x01" * 8 * 1000  # 8 KB per Enqueue
        for i in range(250):
            assert link.send(p.Enqueue(f"bulk-{i}", 16 * 1000, block_hashes=hashes))
        assert link.send(p.Release("last", 3, 1, "completed", 7))
        link.close()  # at once, as `SchedulerClient.close()` does after a final release
        got_last, deadline = False, time.monotonic() + 30
        while not got_last and time.monotonic() < deadline:
            if router.poll(500):
                got_last = b"last" in router.recv_multipart()[1]
        assert got_last, "the Release sent before close() never reached the daemon"
