"""Client link: a send reads the socket's EVENTS instead of scheduling a read every loop turn, and a
reply already waiting when the link sends is still delivered (the ZeroMQ FD is edge-like)."""

from __future__ import annotations

import asyncio

import zmq

from kvsched import protocol as p
from kvsched.client.link import Link

from .link_helpers import until, welcome


async def test_sends_schedule_no_read_unless_a_frame_waits(tmp_path):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/d.sock"
    router.bind(endpoint)
    enc = p.make_encoder()
    got: list = []
    link = Link(ctx, endpoint, "t", got.append, lambda w, r: None)
    loop = asyncio.get_running_loop()
    link.open(loop)
    try:
        ident = await welcome(router, link)
        await asyncio.sleep(0.05)  # the Welcome's own turn is over
        calls = []
        real = loop.call_soon
        loop.call_soon = lambda cb, *a, **k: (calls.append(getattr(cb, "__name__", "")), real(cb, *a, **k))[1]
        try:
            assert link.send(p.Heartbeat(7))
            link._flush_out()  # the batched send happens now, nothing is waiting for us
            assert "_recheck" not in calls  # old code: one read scheduled per loop turn that sent
            # a reply that is already waiting when the link sends is read without another FD event
            router.send_multipart([ident, enc.encode(p.HeartbeatAck(1))])
            router.send_multipart([ident, enc.encode(p.Rejected("r1", "invalid", "x", ""))])
            await asyncio.sleep(0.05)
            assert link.send(p.Heartbeat(8))
            link._flush_out()
        finally:
            loop.call_soon = real
        await until(lambda: any(isinstance(f, p.Rejected) for f in got))
    finally:
        link.close()
        router.close(0)
        ctx.term()
