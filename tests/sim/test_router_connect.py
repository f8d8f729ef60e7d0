"""A replay router waits for a daemon that answers later than the client library's default 5 s
connect timeout (a loaded machine): the orchestrator itself waits up to 120 s for its routers."""

from __future__ import annotations

import asyncio
from importlib.resources import files

import zmq

from kvsched import protocol as p
from kvsched.sim.router import Router, RouterParams
from kvsched.sim.trace import load_trace

SLICE = str(files("kvsched") / "data" / "mooncake_slice.jsonl")


async def test_a_router_connects_to_a_daemon_that_answers_after_six_seconds(tmp_path):
    """1. a router starts connecting to an ipc endpoint nobody has bound yet, 2. 6 s later a stand-in
    daemon binds it and welcomes the router's Hello. Result: the router is connected (before: it
    gave up after the client's 5 s default, and its process exited with its rows unreplayed)."""
    endpoint = f"ipc://{tmp_path}/d.sock"
    params = RouterParams(
        index=0,
        routers=1,
        trace_path=SLICE,
        limit=4,
        endpoint=endpoint,
        fleet_endpoint=f"ipc://{tmp_path}/fleet.sock",
        results_path="/dev/null",
    )
    router = Router(params, load_trace(SLICE, 4))
    ctx = zmq.Context()
    daemon = ctx.socket(zmq.ROUTER)
    daemon.setsockopt(zmq.LINGER, 0)
    connecting = asyncio.create_task(router.connect())
    try:
        await asyncio.sleep(6.0)
        assert not connecting.done(), connecting.exception()
        daemon.bind(endpoint)
        enc, dec = p.make_encoder(), p.make_router_decoder()
        loop = asyncio.get_running_loop()
        end = loop.time() + 60
        while not connecting.done():
            assert loop.time() < end, "the router never said Hello"
            if daemon.poll(0):
                ident, raw = daemon.recv_multipart()
                if isinstance(dec.decode(raw), p.Hello):
                    daemon.send_multipart(
                        [ident, enc.encode(p.Welcome(1, 1, 2, 16, "l", "p", 10_000, 60_000, 1 << 20))]
                    )
            await asyncio.sleep(0.01)
        await connecting
        assert router.client is not None and router.client.connected
    finally:
        if not connecting.done():
            connecting.cancel()
        await router.close()
        daemon.close(0)
        ctx.term()
