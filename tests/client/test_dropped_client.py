"""A client's life ends with its owner: a client dropped unclosed inside a running event loop is
collected and ends its heartbeat thread and connection (docs/DESIGN.md §5.4, docs/PROTOCOL.md
"Liveness"); a client inherited by a forked child refuses to work there at once instead of hanging
on its parent's connection. Against a real daemon (liveness timeout 1.5 s), with the real client.
"""

from __future__ import annotations

import asyncio
import gc
import os
import select
import signal
import threading
import weakref
from collections.abc import Callable

import pytest

from kvsched import protocol as p
from kvsched.client import SchedulerClient, SyncSchedulerClient
from tests.conftest import admin_call, wait_until

pytestmark = pytest.mark.timeout(120)

THREAD_NAME = "kvsched-heartbeat"
FORK_MESSAGE = "create a client per process"


def _beaters() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == THREAD_NAME}


async def test_clients_dropped_unclosed_in_a_running_loop_end_their_threads_and_connections(session_daemon):
    """1. inside one running loop, 5 clients connect and are dropped without close() (gc.collect()
    after each), 2. the loop keeps running. Result: all 5 are collected, no heartbeat thread of theirs
    remains, and the daemon's connection count goes back to what it was (it reaps connections nobody
    heartbeats for any more)."""
    before_threads = _beaters()
    before_conns = (await asyncio.to_thread(admin_call, session_daemon, p.Status())).connections
    refs = []
    for i in range(5):
        client = await SchedulerClient(session_daemon.endpoint, client_name=f"dropped-{i}").connect()
        assert client.welcome.conn_token != 0
        refs.append(weakref.ref(client))
        del client
        gc.collect()
    await asyncio.sleep(0.5)  # the loop runs its readers and timers meanwhile
    gc.collect()
    assert [r() for r in refs] == [None] * 5
    assert await asyncio.to_thread(wait_until, lambda: not _beaters() - before_threads, 10)

    def conns_back() -> bool:
        return admin_call(session_daemon, p.Status()).connections <= before_conns

    assert await asyncio.to_thread(wait_until, conns_back, 15)


def _child(pipe_w: int, use: Callable[[], object]) -> None:
    """In the forked child: call `use()`, write what happened to the pipe, leave without cleanup."""
    signal.alarm(10)  # a hang must not outlive the test: the parent sees no answer
    try:
        use()
        outcome = "no error"
    except BaseException as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    os.write(pipe_w, outcome.encode()[:1000])
    os._exit(0)


def _fork_and_report(use: Callable[[], object]) -> str:
    """Fork; the child runs `use` (see `_child`); returns its report ("" when it wrote none within 5 s)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(w, use)
    os.close(w)
    try:
        ready = wait_until(lambda: bool(select.select([r], [], [], 0)[0]), 5)
        report = os.read(r, 1000).decode() if ready else ""
    finally:
        os.close(r)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return report


def test_a_forked_child_gets_a_clear_error_from_its_parents_sync_client(session_daemon):
    """1. a `SyncSchedulerClient` holds a lease, 2. the process forks and the child calls
    `schedule()`, then `close()`, on the inherited client. Result: the child's `schedule` raises at
    once an error saying to create a client per process; its `close` is a quiet no-op; the parent's
    lease stays on the daemon and the parent's client keeps working."""
    with SyncSchedulerClient(session_daemon.endpoint, client_name="fork-parent") as client:
        lease = client.schedule("fork-parent-lease", 32)

        def use() -> None:
            try:
                client.schedule("fork-child-lease", 32)
            finally:
                client.close()

        report = _fork_and_report(use)
        assert "KvschedError" in report and FORK_MESSAGE in report, report

        rows = admin_call(session_daemon, p.Leases()).leases
        assert [r.request_id for r in rows if r.request_id.startswith("fork-")] == ["fork-parent-lease"]
        lease.add_output_tokens(3)
        second = client.schedule("fork-parent-second", 32)
        second.release()
        lease.release()
        assert lease.outcome == "completed"


async def test_a_forked_child_gets_a_clear_error_from_its_parents_async_client(session_daemon):
    """1. an asyncio `SchedulerClient` is connected, 2. the process forks and the child calls
    `schedule()` and `close()` on it in a loop of its own. Result: `schedule` raises the
    client-per-process error at once, `close` does nothing; the parent's client still schedules."""
    client = await SchedulerClient(session_daemon.endpoint, client_name="fork-async").connect()
    try:

        async def child_use() -> None:
            try:
                await client.schedule("fork-async-child", 32)
            finally:
                await client.close()

        report = await asyncio.to_thread(_fork_and_report, lambda: asyncio.run(child_use()))
        assert "KvschedError" in report and FORK_MESSAGE in report, report
        lease = await client.schedule("fork-async-parent", 32)
        lease.release()
    finally:
        await client.close()
