"""A Welcome that arrives while the link's reconnect timer looks at its socket is still read.

Found from outside: in a transport bench run (16 router processes reconnecting at once, 2 cores) one
router failed `connect()` with `DaemonUnavailable` after 30 s although the daemon had answered its
Hello. ZeroMQ's socket FD is edge-like: whatever processes the socket's pending commands (a
`getsockopt(EVENTS)`, a `zmq_poll`, a send) consumes the signal of a message that arrived, and the
loop's reader callback then never fires for it. The link's timer asked `EVENTS` for POLLOUT only
("is the connection still up?") while waiting for the Welcome, so a Welcome that landed just before
that check stayed unread until the Hello's patience (30 s) ran out.
"""

from __future__ import annotations

import time

import zmq

from kvsched import protocol as p

from .link_helpers import stand_in_daemon, until


async def test_a_welcome_whose_signal_the_timer_consumed_is_still_read(tmp_path):
    """1. a link says Hello to a stand-in daemon (a ROUTER); 2. the daemon answers Welcome and the
    test waits, without running the loop, until the Welcome is in the link's socket; 3. the link's
    timer check (`_hello_pending`, what `_on_timer` calls every 50 ms while not connected) runs first,
    as it does when the timer and the FD are due in the same loop iteration. Result: the link is
    connected within 10 s (before: not within its 30 s Hello patience, the FD never signalled again)."""
    async with stand_in_daemon(tmp_path, "racing") as (router, link):
        await until(lambda: router.poll(0), timeout_s=10)
        ident, raw = router.recv_multipart()
        assert isinstance(p.make_router_decoder().decode(raw), p.Hello)
        router.send_multipart(
            [ident, p.make_encoder().encode(p.Welcome(1, 1, 2, 16, "l", "p", 10_000, 60_000, 1 << 20))]
        )
        deadline = time.monotonic() + 10
        while not (link.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN) and time.monotonic() < deadline:
            time.sleep(0.01)  # not the loop's sleep: the reader callback must not run yet
        # The check above consumed the FD's signal too; the timer's own check is the one under test.
        assert link._hello_pending(time.monotonic())
        await until(lambda: link.connected, timeout_s=10)
