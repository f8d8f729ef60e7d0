"""Helpers of the link tests: wait for a condition, and welcome a link from a stand-in daemon."""

from __future__ import annotations

import asyncio
import contextlib

import zmq

from kvsched import protocol as p
from kvsched.client.link import Link


async def until(pred, timeout_s: float = 30.0) -> None:
    """Await `pred()` true, polling every 5 ms; AssertionError after `timeout_s` (s)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def welcome(router, link) -> bytes:
    """Answer the link's Hello on the stand-in daemon's ROUTER `router` with a Welcome (liveness 60 s,
    1 MiB frames); wait until the link is connected. Returns the link's ZeroMQ identity."""
    enc, dec = p.make_encoder(), p.make_router_decoder()
    await until(lambda: router.poll(0))
    ident, raw = router.recv_multipart()
    assert isinstance(dec.decode(raw), p.Hello)
    router.send_multipart([ident, enc.encode(p.Welcome(1, 1, 2, 16, "l", "p", 10_000, 60_000, 1 << 20))])
    await until(lambda: link.connected)
    return ident


@contextlib.asynccontextmanager
async def stand_in_daemon(tmp_path, client_name: str):
    """A stand-in daemon (a ROUTER bound on an ipc path in `tmp_path`, its own context) and an open
    `Link` to it (a second context, as a router process has). Yields (router, link); closes both."""
    server_ctx, client_ctx = zmq.Context(), zmq.Context()
    router = server_ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/d.sock"
    router.bind(endpoint)
    link = Link(client_ctx, endpoint, client_name, lambda frame: None, lambda welcome, again: None)
    link.open(asyncio.get_running_loop())
    try:
        yield router, link
    finally:
        link.close()
        router.close(0)
        client_ctx.term()
        server_ctx.term()
