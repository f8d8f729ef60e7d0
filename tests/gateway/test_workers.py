"""`kvsched-gateway --workers N`: N processes on one port (SO_REUSEPORT), each a router of the daemon."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from kvsched import protocol as p
from kvsched.client import AdminClient
from kvsched.gateway.local_fleet import LocalFleet

from .helpers import eventually, ledger, stream_chat, words

pytestmark = pytest.mark.timeout(240)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _connections(fleet: LocalFleet) -> int:
    with AdminClient(fleet.daemon.admin_endpoint) as admin:
        return admin.call(p.Status()).connections


async def _pids_and_chats(url: str, n: int) -> tuple[set[int], list[dict]]:
    """`n` /health calls and `n` chats, each on a new connection (the kernel picks a listener per connection)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        pids = set()
        for _ in range(n):
            async with s.get(url + "/health") as r:
                assert r.status == 200
                pids.add((await r.json())["pid"])
        chats = await asyncio.gather(*(stream_chat(s, url, words(i * 40, 40)) for i in range(n)))
    return pids, chats


def test_workers_share_the_port_each_with_its_own_daemon_connection_and_stop_together(tmp_path):
    fleet = LocalFleet.start(tmp_path, n_engines=2, n_gateways=1, speedup=20.0, gateway_extra="workers = 2")
    try:
        url = fleet.gateway_urls[0]
        # One SchedulerClient per worker process. Under load a link may say Hello on a second socket
        # before the first is answered; the daemon reaps the silent one within its liveness timeout.
        assert asyncio.run(eventually(lambda: _connections(fleet) == 2, 20, 0.2)), _connections(fleet)
        pids, chats = asyncio.run(_pids_and_chats(url, 40))
        assert len(pids) == 2, f"40 new connections all reached one worker: {pids}"  # 2**-39 by chance
        assert all(c["status"] == 200 and c["done"] and c["usage"]["completion_tokens"] == 8 for c in chats), chats
        assert asyncio.run(eventually(lambda: ledger(fleet.daemon.admin_endpoint) == (0, 0), 30))
        supervisor = fleet.gateways[0]
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(30) == 0
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in pids), "a worker outlived its supervisor"
    finally:
        fleet.stop()


def test_a_worker_that_dies_takes_the_group_down_with_its_status(tmp_path):
    fleet = LocalFleet.start(tmp_path, n_engines=1, n_gateways=1, speedup=20.0, gateway_extra="workers = 2")
    try:
        pids, _ = asyncio.run(_pids_and_chats(fleet.gateway_urls[0], 30))
        assert len(pids) == 2
        victim, other = sorted(pids)
        os.kill(victim, signal.SIGKILL)
        supervisor = fleet.gateways[0]
        assert supervisor.wait(30) == 128 + signal.SIGKILL  # the worker's fate, as a shell reports it
        deadline = time.monotonic() + 15
        while _alive(other) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(other), "the surviving worker was not stopped"
    finally:
        fleet.stop()
