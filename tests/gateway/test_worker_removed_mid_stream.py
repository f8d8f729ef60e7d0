"""`kvsched remove-worker` while the gateway streams from that worker: the daemon revokes the lease
(LeaseLost on the gateway's next progress report) but the engine is still answering, so the user's
stream is relayed to its end, and the gateway keeps serving on the other worker."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvsched import protocol as p
from kvsched.client import AdminClient

from .conftest import scripted_daemon_fixture
from .helpers import eventually, health_stats, ledger, stream_chat

pytestmark = pytest.mark.timeout(120)


daemon = scripted_daemon_fixture({1: 1, 2: 1})


def _remove(admin_endpoint: str, worker_id: int):
    with AdminClient(admin_endpoint) as admin:
        return admin.call(p.RemoveWorker(worker_id=worker_id))


async def test_stream_on_a_removed_worker_is_relayed_to_its_end(stack):
    gw, url, engines, d = stack
    for e in engines.values():
        e.mode = "slow"  # six tokens, 0.3 s apart
    async with aiohttp.ClientSession() as s:
        call = asyncio.create_task(stream_chat(s, url, "w1 w2"))
        assert await eventually(lambda: any(e.seen for e in engines.values()), 10)
        serving = next(w for w, e in engines.items() if e.seen)
        assert isinstance(await asyncio.to_thread(_remove, d.admin_endpoint, serving), p.OkReply)
        r = await asyncio.wait_for(call, 30)
        assert r["status"] == 200 and r["text"] == "abcdef" and r["done"] and not r["error"], r
        assert gw.stats["leases_lost_mid_stream"] == 1
        assert (await health_stats(s, url))["leases_lost_mid_stream"] == 1  # documented as readable there
        for e in engines.values():
            e.mode = "ok"
        again = await stream_chat(s, url, "w3 w4")
        assert again["status"] == 200 and again["done"], again
    other = 3 - serving
    assert len(engines[other].seen) == 1 and len(engines[serving].seen) == 1  # the next one went elsewhere
    assert await eventually(lambda: ledger(d.admin_endpoint) == (0, 0), 10)
