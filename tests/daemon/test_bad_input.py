"""Bad input is always answered, and a caller never waits forever on an error (real daemon, real sockets)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from kvsched import protocol as p
from kvsched.client import SchedulerClient
from kvsched.errors import ProtocolError
from tests.conftest import RawPeer

pytestmark = pytest.mark.timeout(120)

DEEP = b"\x91" * 30_000 + b"\xc0"  # MessagePack: 30,000 nested one-element arrays around nil


def test_thirty_thousand_nested_arrays_are_answered_and_the_peer_keeps_working(session_daemon):
    """1. a peer says Hello, 2. sends a frame of 30,000 nested arrays (an untyped decode of it raises
    RecursionError), 3. sends a valid Enqueue. Result: an Error(MALFORMED) for the frame, then Admitted."""
    with RawPeer(session_daemon.endpoint) as peer:
        peer.hello()
        peer.send(DEEP)
        err = peer.recv()
        assert isinstance(err, p.Error) and err.code == p.ErrorCode.MALFORMED
        peer.send(p.make_encoder().encode(p.Enqueue("deep-after", 10)))
        got = peer.recv()
        assert isinstance(got, p.Admitted) and got.request_id == "deep-after"
        peer.send(p.Release("deep-after", got.slot, got.generation))


def test_an_error_names_the_request_id_when_it_can_be_read(session_daemon):
    """1. a peer sends an Enqueue whose isl_tokens is a string and one whose hashes are too many.
    Result: each Error carries the request id, so a client can fail that caller."""
    enc = p.make_encoder()
    with RawPeer(session_daemon.endpoint) as peer:
        peer.hello()
        peer.send(enc.encode(["enqueue", "named-1", "10"]))
        err = peer.recv()
        assert isinstance(err, p.Error) and err.request_id == "named-1", err
        peer.send(enc.encode(["enqueue", "named-2", 10, b"\0" * (8 * p.MAX_BLOCK_HASHES + 8)]))
        err = peer.recv()
        assert isinstance(err, p.Error) and err.request_id == "named-2", err
        peer.send(enc.encode(["heartbeat", "not-an-int"]))
        err = peer.recv()
        assert isinstance(err, p.Error) and err.request_id is None


async def test_client_fails_the_caller_at_once_when_the_daemon_answers_error(session_daemon):
    """1. a frame the daemon cannot decode is sent on behalf of a waiting caller (the local checks
    bypassed). Result: the caller gets ProtocolError instead of waiting forever."""
    async with SchedulerClient(session_daemon.endpoint) as client:
        bad = p.Enqueue("undecodable-1", "10")  # a str token count: wrong on purpose
        with pytest.raises(ProtocolError):
            await asyncio.wait_for(client._await_admission("undecodable-1", 10, bad), 10)
        lease = await asyncio.wait_for(client.schedule("decodable-1", 10), 10)
        lease.release()


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        ({"request_id": 42, "isl_tokens": 10}, TypeError),
        ({"request_id": "r", "isl_tokens": "10"}, TypeError),
        ({"request_id": "r", "isl_tokens": 0}, ValueError),
        ({"request_id": "x" * 200, "isl_tokens": 10}, ValueError),
        ({"request_id": "é" * 100, "isl_tokens": 10}, ValueError),  # 100 characters, 200 UTF-8 bytes
        ({"request_id": "r", "isl_tokens": 10, "priority": 2**40}, ValueError),
        ({"request_id": "r", "isl_tokens": 10, "pinned": (1, 2**20)}, ValueError),
        ({"request_id": "r", "isl_tokens": 10, "deadline_ms": -1}, ValueError),
        ({"request_id": "r", "isl_tokens": 10, "do_not_queue": "yes"}, TypeError),
        ({"request_id": "r", "isl_tokens": True}, TypeError),
    ],
)
async def test_bad_schedule_arguments_raise_before_sending(session_daemon, kwargs, exc):
    """A bad argument raises TypeError/ValueError at the call (never a wait on an Error)."""
    async with SchedulerClient(session_daemon.endpoint) as client:
        with pytest.raises(exc):
            await asyncio.wait_for(client.schedule(**kwargs), 10)


async def test_lease_release_refuses_an_unknown_outcome_and_stays_open(session_daemon):
    """1. lease.release("bogus"). Result: ValueError, the lease is still open and a valid release
    frees it on the daemon."""
    from kvsched.client import AdminClient

    async with SchedulerClient(session_daemon.endpoint) as client:
        lease = await client.schedule("bogus-outcome", 10)
        with pytest.raises(ValueError):
            lease.release("bogus")
        assert not lease.closed
        lease.release("completed")

        def leases() -> int:
            with AdminClient(session_daemon.admin_endpoint) as admin:
                return admin.call(p.Status()).active_leases

        for _ in range(100):
            if await asyncio.to_thread(leases) == 0:
                break
            await asyncio.sleep(0.05)
        assert await asyncio.to_thread(leases) == 0


def test_admin_frame_with_deeply_nested_unknown_field_is_answered_and_the_next_one_too(session_daemon):
    """1. one DEALER sends the admin socket a `status` map whose unknown field holds 200,000 nested
    arrays (skipping it raised RecursionError out of the admin handler: no reply, and the admin
    reader was left un-rearmed), then at once a valid `status`. Result: an `admin_error` MALFORMED,
    then a `status_reply`."""
    import msgspec
    import zmq

    deep_status = b"\x82\xa1t\xa6status\xa4junk" + b"\x91" * 200_000 + b"\xc0"
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(session_daemon.admin_endpoint)
    try:
        sock.send(deep_status)
        sock.send(msgspec.msgpack.encode({"t": "status"}))
        replies = []
        for _ in range(2):
            assert sock.poll(10_000), f"no admin reply after {replies}"
            replies.append(msgspec.msgpack.decode(sock.recv()))
    finally:
        sock.close()
    assert replies[0]["t"] == "admin_error" and replies[0]["code"] == int(p.ErrorCode.MALFORMED), replies[0]
    assert replies[1]["t"] == "status_reply", replies[1]


def test_a_frame_nested_too_deep_inside_a_batch_fails_alone_and_the_rest_is_handled(session_daemon):
    """Found from outside: 1. a version-2 peer sends one Batch of [a frame of 1,200 nested arrays, a
    valid Heartbeat, a valid Enqueue]. msgspec cannot even skip the deep frame (RecursionError), so
    the whole message failed: one Error without `batch_index`, and the Enqueue was never answered (a
    third-party client's caller waited forever). Result: Error(MALFORMED, batch_index=0), then the
    HeartbeatAck, then Admitted."""
    enc = p.make_encoder()
    deep = b"\x91" * 1_200 + b"\xc0"
    with RawPeer(session_daemon.endpoint) as peer:
        peer.hello()
        peer.send(p.encode_batch([deep, enc.encode(p.Heartbeat(77)), enc.encode(p.Enqueue("after-deep", 10))]))
        err, ack, got = peer.recv(), peer.recv(), peer.recv()
        assert isinstance(err, p.Error) and err.code == p.ErrorCode.MALFORMED and err.batch_index == 0, err
        assert isinstance(ack, p.HeartbeatAck) and ack.seq == 77, ack
        assert isinstance(got, p.Admitted) and got.request_id == "after-deep", got
        peer.send(p.Release("after-deep", got.slot, got.generation))


def test_an_error_names_the_request_id_even_when_a_later_field_is_nested_too_deep(session_daemon):
    """Found from outside: an Enqueue whose `pinned` field is 1,200 arrays deep got an Error with
    request_id None (the id peek could not skip the rest either). Result: the Error names the id."""
    enc = p.make_encoder()
    deep = msgspec.Raw(b"\x91" * 1_200 + b"\xc0")
    with RawPeer(session_daemon.endpoint) as peer:
        peer.hello()
        peer.send(enc.encode(["enqueue", "deep-pinned", 10, b"", "", 0, 0, None, None, deep]))
        err = peer.recv()
        assert isinstance(err, p.Error) and err.code == p.ErrorCode.MALFORMED, err
        assert err.request_id == "deep-pinned", err


def test_a_frame_that_is_not_an_array_is_told_what_a_frame_is(session_daemon):
    """Found from outside: random bytes got `Expected array, got object` (msgspec's words alone).
    Result: the message says the frame is undecodable and what a frame is, naming docs/PROTOCOL.md."""
    with RawPeer(session_daemon.endpoint) as peer:
        peer.hello()
        peer.send(msgspec.msgpack.encode({"kind": "enqueue"}))
        err = peer.recv()
        assert isinstance(err, p.Error) and err.code == p.ErrorCode.MALFORMED, err
        assert err.message.startswith("undecodable frame: ") and "docs/PROTOCOL.md" in err.message, err.message
