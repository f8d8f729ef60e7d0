"""`kvsched cancel` of a request the gateway is serving: the daemon revokes the lease, and the gateway
aborts the request at once: it closes the engine connection (vLLM aborts a request whose connection
closes) and ends the client's stream with an error event, or answers 503 `cancelled` when nothing
was sent yet. Nothing stays booked, and the next request is served normally."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvsched import protocol as p
from kvsched.client import AdminClient

from .conftest import scripted_daemon_fixture
from .helpers import eventually, health_stats, ledger, stream_chat

pytestmark = pytest.mark.timeout(120)


daemon = scripted_daemon_fixture({1: 1})


def _cancel_the_lease(admin_endpoint: str):
    """`kvsched cancel` of the one active lease (its request id read from `kvsched leases`)."""
    with AdminClient(admin_endpoint) as admin:
        rows = admin.call(p.Leases()).leases
        assert len(rows) == 1, rows
        return admin.call(p.Cancel(request_id=rows[0].request_id))


async def test_cancel_mid_stream_closes_the_engine_request_and_ends_the_stream_with_an_error(stack):
    """1. the engine streams 600 tokens 0.1 s apart, 2. after the first tokens reach the client,
    `kvsched cancel` its lease. Result: the client's stream ends with an error event (code 503), no
    `[DONE]`, far fewer than 600 tokens; the engine sees its connection closed; the ledger is zero."""
    gw, url, engines, d = stack
    engine = engines[1]
    engine.mode = "long"
    async with aiohttp.ClientSession() as s:
        call = asyncio.create_task(stream_chat(s, url, "w1 w2", max_tokens=600))
        assert await eventually(lambda: engine.seen, 20)
        assert await eventually(lambda: ledger(d.admin_endpoint)[1] == 1, 20)
        await asyncio.sleep(0.5)  # some tokens relayed
        assert isinstance(await asyncio.to_thread(_cancel_the_lease, d.admin_endpoint), p.OkReply)
        r = await asyncio.wait_for(call, 60)
        assert r["status"] == 200 and not r["done"], r
        assert r["error"] and r["error"]["error"]["code"] == 503, r
        assert "cancelled by an operator" in r["error"]["error"]["message"], r
        assert len(r["text"]) < 600, r
        assert await eventually(lambda: engine.disconnects == 1, 20)
        assert gw.stats["leases_revoked"] == 1
        assert (await health_stats(s, url))["leases_revoked"] == 1  # documented as readable there
        engine.mode = "ok"
        again = await stream_chat(s, url, "w3 w4")
        assert again["status"] == 200 and again["done"] and again["text"] == "ab", again
    assert await eventually(lambda: ledger(d.admin_endpoint) == (0, 0), 10)


async def test_cancel_before_the_engine_answers_gives_503_cancelled(stack):
    """The engine holds its response headers for 8 s; the lease is cancelled meanwhile. Result: the
    client gets 503 with code `cancelled` (not the engine's later answer), no Retry-After."""
    gw, url, engines, d = stack
    engines[1].mode = "stall_headers"
    async with aiohttp.ClientSession() as s:
        call = asyncio.create_task(stream_chat(s, url, "w5 w6"))
        assert await eventually(lambda: engines[1].seen, 20)
        assert isinstance(await asyncio.to_thread(_cancel_the_lease, d.admin_endpoint), p.OkReply)
        r = await asyncio.wait_for(call, 60)
    assert r["status"] == 503, r
    assert r["error"]["error"]["code"] == "cancelled", r
    assert gw.stats["leases_revoked"] == 1
    assert await eventually(lambda: ledger(d.admin_endpoint) == (0, 0), 10)


async def test_cancel_of_a_buffered_non_streaming_request_gives_503(stack):
    """A non-streaming client (the gateway collects the stream) whose lease is cancelled mid-way
    gets 503 `cancelled`, not a truncated 200."""
    _gw, url, engines, d = stack
    engines[1].mode = "long"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w7 w8"}], "max_tokens": 600}
    async with aiohttp.ClientSession() as s:

        async def post():
            async with s.post(url + "/v1/chat/completions", json=body) as resp:
                return resp.status, await resp.json()

        call = asyncio.create_task(post())
        assert await eventually(lambda: engines[1].seen, 20)
        assert await eventually(lambda: ledger(d.admin_endpoint)[1] == 1, 20)
        assert isinstance(await asyncio.to_thread(_cancel_the_lease, d.admin_endpoint), p.OkReply)
        status, answer = await asyncio.wait_for(call, 60)
    assert status == 503 and answer["error"]["code"] == "cancelled", answer
    assert await eventually(lambda: engines[1].disconnects == 1, 20)
