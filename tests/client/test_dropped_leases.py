"""Leases garbage-collected while open go through one batched cleanup queue: one loop wake per batch,
one Release(aborted) each, never a callback per lease (Dynamo kv-router: one bounded wake covers a
batch of dropped requests)."""

from __future__ import annotations

import asyncio
import gc
import threading

from kvsched import protocol as p
from kvsched.client import SchedulerClient
from kvsched.client.lease import Lease
from kvsched.protocol import WorkerKey


class CountingLoop:
    """The running loop, counting `call_soon_threadsafe` (the wakes other threads can cause)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.wakes = 0

    def is_closed(self) -> bool:
        return self.loop.is_closed()

    def call_soon_threadsafe(self, cb, *args):
        self.wakes += 1
        return self.loop.call_soon_threadsafe(cb, *args)


class RecordingLink:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, frame, **_):
        self.sent.append(frame)
        return True


def _client() -> tuple[SchedulerClient, CountingLoop, RecordingLink]:
    client = SchedulerClient("ipc:///nonexistent/kvsched-test.sock")
    loop, link = CountingLoop(asyncio.get_running_loop()), RecordingLink()
    client._loop, client._link = loop, link  # as after connect(), without a daemon
    return client, loop, link


def _drop_open_leases(client: SchedulerClient, n: int, prefix: str) -> None:
    for i in range(n):
        Lease(client._channel, f"{prefix}{i}", WorkerKey(1, 0), i, 1, 0, 0, 0, 16)  # dropped at once, still open
    gc.collect()


async def test_thousand_dropped_leases_cost_one_loop_wake_and_one_release_each():
    client, loop, link = _client()
    _drop_open_leases(client, 1000, "gc-")
    assert loop.wakes == 1
    for _ in range(3):
        await asyncio.sleep(0)
    assert [f.request_id for f in link.sent] == [f"gc-{i}" for i in range(1000)]
    assert all(
        isinstance(f, p.Release) and f.outcome == "aborted" and f.slot == i and f.generation == 1
        for i, f in enumerate(link.sent)
    )
    _drop_open_leases(client, 10, "next-")  # a later batch: one more wake
    await asyncio.sleep(0)
    assert loop.wakes == 2 and len(link.sent) == 1010
    client._ctx.term()


async def test_leases_dropped_on_another_thread_are_released_on_the_loop():
    client, _loop, link = _client()
    t = threading.Thread(target=_drop_open_leases, args=(client, 200, "thr-"))
    t.start()
    await asyncio.to_thread(t.join)
    for _ in range(3):
        await asyncio.sleep(0)
    assert sorted(f.request_id for f in link.sent) == sorted(f"thr-{i}" for i in range(200))
    assert len(client._dropped) == 0
    client._ctx.term()
