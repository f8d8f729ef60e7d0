"""Frames larger than the daemon's `max_frame_bytes` (real daemon, real sockets).

The daemon's transport (ZMQ_MAXMSGSIZE) drops a connection that sends a bigger message, and the
router reconnects at once. Before this was handled, a router that sent one (a request with many
block hashes, or the `Reattach` of many waiting requests after a daemon restart) dropped, said Hello,
got a Welcome, sent the same message and dropped again, forever: its callers never got an answer nor
an error (the reconnect deadline never fired, since every reconnect succeeded).
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from kvsched import protocol as p
from kvsched.client import FrameTooLarge, SchedulerClient
from kvsched.client.pending import split_reattach
from tests.conftest import RawPeer, admin_call, daemon_fixture, kill_and_wait_for_disconnect, wait_until

pytestmark = pytest.mark.timeout(150)

CONFIG = """
[daemon]
block_size = 16
max_frame_bytes = 4096
liveness_timeout_ms = 30000
heartbeat_ms = 200

[[workers]]
worker_id = 1
total_kv_blocks = 1000000
max_num_batched_tokens = 1000000
"""

daemon = daemon_fixture(CONFIG)


def _hashes(seed: int, n: int) -> list[int]:
    return [(seed << 20) + i + 1 for i in range(n)]


async def test_an_enqueue_over_the_limit_fails_its_caller_at_once_and_the_link_stays_up(daemon):
    """A request whose Enqueue encodes to ~9 KB against a 4 KiB limit raises FrameTooLarge without
    being sent; the connection is not dropped and the next request is admitted."""
    async with SchedulerClient(daemon.endpoint, reconnect_deadline_s=20) as client:
        with pytest.raises(FrameTooLarge, match="max_frame_bytes"):
            await asyncio.wait_for(client.schedule("big", isl_tokens=16 * 1000, block_hashes=_hashes(1, 1000)), 10)
        lease = await asyncio.wait_for(client.schedule("small", isl_tokens=100), 10)
        lease.release("completed")
        assert client.connected
        await asyncio.sleep(0.3)
    status = admin_call(daemon, p.Status())
    assert status.active_leases == 0
    assert daemon.log_path.read_text().count("router connected") == 1, daemon.log_tail(30)  # never reconnected


async def test_a_reattach_larger_than_the_limit_is_split_and_every_waiting_request_is_admitted(daemon):
    """40 requests (~430 bytes each, ~17 KB together) wait while the daemon is down; after its restart
    the client re-sends them in several Reattach frames under 4 KiB and all 40 are admitted."""
    async with SchedulerClient(daemon.endpoint, reconnect_deadline_s=120) as client:
        first = await client.schedule("warm", isl_tokens=100)
        first.release("completed")
        await kill_and_wait_for_disconnect(daemon, client)
        calls = [
            asyncio.ensure_future(client.schedule(f"w-{i}", isl_tokens=16 * 40, block_hashes=_hashes(i + 2, 40)))
            for i in range(40)
        ]
        await asyncio.sleep(0.2)
        await asyncio.to_thread(daemon.restart)
        leases = await asyncio.wait_for(asyncio.gather(*calls), 30)
        assert sorted(lease.request_id for lease in leases) == sorted(f"w-{i}" for i in range(40))
        for lease in leases:
            lease.release("completed")
        await asyncio.sleep(0.5)
    # Releases are not answered: the daemon applies them when its loop reads them (on a loaded machine
    # possibly after this test's admin call is answered); the 30 s liveness timeout cannot free them first.
    assert wait_until(lambda: admin_call(daemon, p.Status()).active_leases == 0, 20)


def test_split_reattach_keeps_the_order_stays_under_the_limit_and_sets_aside_what_cannot_fit():
    enc = msgspec.msgpack.Encoder()
    leases = [p.LeaseRef(f"l-{i}", i, 1) for i in range(300)]
    pending = [p.Enqueue(f"e-{i}", 16 * 20, block_hashes=b"\x01" * 8 * 20) for i in range(50)]
    pending.insert(7, p.Enqueue("huge", 16 * 600, block_hashes=b"\x02" * 8 * 600))
    requeues = [p.Requeued(p.LeaseRef(f"r-{i}", i, 2), p.Enqueue(f"r-{i}", 32)) for i in range(20)]
    frame = p.Reattach(leases, pending, requeues)
    limit = 2048
    frames, too_large = split_reattach(frame, limit, enc.encode)
    assert [rid for rid, _ in too_large] == ["huge"] and too_large[0][1] > limit
    assert len(frames) > 3
    assert all(len(enc.encode(f)) <= limit for f in frames)
    # in order: every lease, then every requeue, then every pending Enqueue (as one frame is handled)
    order = [
        (k, getattr(x, "request_id", None) or x.lease.request_id)
        for f in frames
        for k, xs in (("l", f.leases), ("r", f.requeues), ("e", f.pending))
        for x in xs
    ]
    assert order == [("l", x.request_id) for x in leases] + [("r", x.lease.request_id) for x in requeues] + [
        ("e", x.request_id) for x in pending if x.request_id != "huge"
    ]
    # a frame that fits is sent as it is
    small = p.Reattach(leases[:3], pending[:2], [])
    assert split_reattach(small, limit, enc.encode) == ([small], [])


def test_a_raw_peer_s_oversized_message_is_answered_oversized_and_the_connection_kept(daemon):
    """A peer not using the client library sends an Enqueue of ~6 KB to a daemon whose limit is 4 KiB.
    Result: error{code=4 oversized} naming the request and both sizes, on the same connection, and
    the next valid Enqueue is admitted (before: the transport dropped the connection unanswered)."""
    enc = p.make_encoder()
    with RawPeer(daemon.endpoint) as peer:
        peer.hello()
        peer.send(enc.encode(p.Enqueue("raw-big", 16 * 700, block_hashes=b"\x01" * 8 * 700)))
        err = peer.recv()
        assert isinstance(err, p.Error) and err.code == p.ErrorCode.OVERSIZED, err
        assert err.request_id == "raw-big" and "4,096" in err.message, err
        peer.send(enc.encode(p.Enqueue("raw-small", 10)))
        got = peer.recv()
        assert isinstance(got, p.Admitted) and got.request_id == "raw-small", got
        peer.send(enc.encode(p.Release("raw-small", got.slot, got.generation)))
