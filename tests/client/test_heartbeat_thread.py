"""A client heartbeats from a thread of its own while it is open, and that thread ends with it.

The thread (named "kvsched-heartbeat") owns its DEALER and holds only a weak reference to its client:
closing the client stops it, and so does dropping a client nobody closed (docs/PROTOCOL.md "Liveness").
Against a real daemon, whose `Welcome` names the data connection's `conn_token`.
"""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest

from kvsched.client import SchedulerClient, SyncSchedulerClient
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(120)

THREAD_NAME = "kvsched-heartbeat"


def _beaters() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == THREAD_NAME}


async def test_an_open_client_heartbeats_from_its_own_thread_and_close_ends_it(session_daemon):
    """1. a client connects, 2. it closes. Result: while open, one heartbeat thread more runs; after
    `close()` it is gone (joined: no thread leak)."""
    before = _beaters()
    client = await SchedulerClient(session_daemon.endpoint).connect()
    try:
        assert client.welcome.conn_token != 0
        assert await asyncio.to_thread(wait_until, lambda: len(_beaters() - before) == 1, 10)
    finally:
        await client.close()
    assert not _beaters() - before


def test_a_client_nobody_closed_ends_its_thread_once_collected(session_daemon):
    """1. a client connects inside `asyncio.run` and is never closed, 2. the run ends (its loop is
    closed) and the client is collected. Result: its heartbeat thread ends too (it does not keep the
    client alive)."""
    before = _beaters()
    started: list[int] = []

    async def forget() -> None:
        client = await SchedulerClient(session_daemon.endpoint).connect()  # never closed
        await asyncio.to_thread(wait_until, lambda: len(_beaters() - before) == 1, 10)
        started.append(len(_beaters() - before) if client.connected else 0)

    asyncio.run(forget())
    assert started == [1]
    gc.collect()
    assert wait_until(lambda: not _beaters() - before, 10)


def test_a_sync_client_ends_its_threads_when_closed_or_collected(session_daemon):
    """1. a `SyncSchedulerClient` connects and closes; 2. another connects and is dropped unclosed.
    Result: while open, each runs one heartbeat thread; closing ends it, and so does collecting the
    dropped one (with its loop thread)."""
    before = _beaters()
    with SyncSchedulerClient(session_daemon.endpoint) as client:
        assert client.welcome.conn_token != 0
        assert wait_until(lambda: len(_beaters() - before) == 1, 10)
    assert not _beaters() - before
    loops = {t for t in threading.enumerate() if t.name == "kvsched-client"}
    dropped = SyncSchedulerClient(session_daemon.endpoint)
    assert wait_until(lambda: len(_beaters() - before) == 1, 10)
    del dropped
    gc.collect()
    assert wait_until(lambda: not _beaters() - before, 10)
    assert wait_until(lambda: not {t for t in threading.enumerate() if t.name == "kvsched-client"} - loops, 10)
