"""`max_waiting_share` is work-conserving, through a real daemon process and real clients.

Every request asks for more prefill tokens (1200) than a worker's busy threshold (1000), so a worker
runs one request at a time and the rest wait in the class, under its queue limit. A lone router may fill
that limit and is then refused `queue_full`, never `overloaded`; two routers flooding the same class
end up holding their shares (docs/DESIGN.md §5.9).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from kvsched import protocol as p
from kvsched.client import SchedulerClient
from kvsched.errors import DaemonOverloaded, QueueFull, RequestRejected
from tests.conftest import admin_call, purge, start_daemon

pytestmark = pytest.mark.timeout(180)

ISL = 1200  # prompt tokens of every request: above the busy threshold, so one request makes its worker busy

CONFIG = """
[daemon]
block_size = 16
heartbeat_ms = 200
max_waiting_share = 0.5
{workers}
[[classes]]
name = "default"
prefill_busy_threshold = 1000
{limit}
"""

WORKER = """
[[workers]]
worker_id = {w}
total_kv_blocks = 1000000
max_num_batched_tokens = 1000000
"""


def _config(n_workers: int, limit: str) -> str:
    return CONFIG.format(workers="".join(WORKER.format(w=w) for w in range(1, n_workers + 1)), limit=limit)


@pytest.fixture
def make_daemon(tmp_path):
    """Start a daemon from `_config(n_workers, limit)`; stopped and purged after the test."""
    started = []

    def make(n_workers: int, limit: str):
        d = start_daemon(tmp_path, _config(n_workers, limit))
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop()
        purge(d.instance)


def _depth(d) -> int:
    return sum(row.depth + row.deferred for row in admin_call(d, p.Queues()).classes)


def _burst(client: SchedulerClient, prefix: str, n: int) -> list[asyncio.Task]:
    """`n` requests sent at once by one router (pipelined on its one connection)."""
    return [asyncio.create_task(client.schedule(f"{prefix}-{i}", isl_tokens=ISL)) for i in range(n)]


async def _settle(tasks: list[asyncio.Task], waiting: int, timeout_s: float = 60.0) -> list[asyncio.Task]:
    """Wait until all but `waiting` of `tasks` (one router's burst) are answered; returns the tasks
    still waiting. One connection's frames are decided in order, so once as many as expected are
    answered, the rest were decided too: they wait in the class."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while sum(not t.done() for t in tasks) > waiting and loop.time() < end:
        await asyncio.sleep(0.02)
    pending = [t for t in tasks if not t.done()]
    reasons = Counter(e.reason for e in _refusals(tasks))
    assert len(pending) == waiting, (
        f"{len(pending)} of {len(tasks)} requests wait, expected {waiting}; refused: {dict(reasons)}"
    )
    return pending


async def _reap(tasks: list[asyncio.Task]) -> None:
    """Cancel what still waits and collect every outcome (a failed test leaves no task unread)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _refusals(tasks: list[asyncio.Task]) -> list[RequestRejected]:
    out = [t.exception() for t in tasks if t.done() and t.exception() is not None]
    assert all(isinstance(e, RequestRejected) for e in out), out
    return out


async def _refused(coro) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        await asyncio.wait_for(coro, 30)
    return info.value


async def _next_admitted(*waiting: list[asyncio.Task]):
    """The lease of the next waiting request to be admitted (its task is removed from its list)."""
    done, _ = await asyncio.wait([t for w in waiting for t in w], timeout=30, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1, f"{len(done)} requests answered at once"
    task = done.pop()
    for w in waiting:
        if task in w:
            w.remove(task)
    return task.result()


async def _drain(pending: list[asyncio.Task], leases: list) -> None:
    """Release every lease and each waiting request once admitted, until nothing waits."""
    for lease in leases:
        lease.release()
    while pending:
        done, _ = await asyncio.wait(pending, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert done, f"{len(pending)} waiting requests never ran"
        for task in done:
            pending.remove(task)
            task.result().release()


async def _wait_depth(d, n: int, timeout_s: float = 30.0) -> None:
    """Wait until the daemon's classes hold `n` waiting requests."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while await asyncio.to_thread(_depth, d) != n and loop.time() < end:
        await asyncio.sleep(0.02)
    assert await asyncio.to_thread(_depth, d) == n


@pytest.mark.parametrize(
    ("limit", "fills"),
    [
        ("request_queue_limit_per_worker = 1", 3),  # 1 x 3 worker ids; its share would be 1
        ("isl_token_queue_limit_per_worker = 2400", 6),  # 7200 tokens = 6 x 1200; its share would be 3
    ],
    ids=["requests", "isl_tokens"],
)
async def test_a_lone_routers_burst_fills_the_class_and_is_refused_only_queue_full(make_daemon, limit, fills):
    """A gateway-like burst: 1. one router (one connection), 3 workers, a class limit of 1 request (or
    2400 ISL tokens) per worker, 2. a burst of 40 requests. Result: a request runs on each worker, the
    class fills to its whole limit (not just this connection's share), every other request is refused
    `queue_full` with the class full (current = limit), none `overloaded`; releasing the leases runs
    every waiting request."""
    d = make_daemon(3, limit)
    async with SchedulerClient(d.endpoint) as router:
        tasks = _burst(router, "burst", 40)
        try:
            pending = await _settle(tasks, fills)
            assert await asyncio.to_thread(_depth, d) == fills
            refused = _refusals(tasks)
            leases = [t.result() for t in tasks if t.done() and t.exception() is None]
            assert len(leases) == 3 and len({lease.worker for lease in leases}) == 3  # one on each worker
            assert [e.reason for e in refused] == ["queue_full"] * (40 - 3 - fills)
            kind, total = ("requests", 3) if "request_" in limit else ("isl_tokens", 7200)
            assert {(e.limit_kind, e.current, e.limit) for e in refused} == {(kind, total, total)}
            await _drain(pending, leases)
        finally:
            await _reap(tasks)


async def test_two_flooding_routers_converge_to_their_shares(make_daemon):
    """1. router A holds a lease (the one worker is busy) and sends 8: the class (limit 4) fills, the
    rest `queue_full`; 2. router B sends 4: it gets its share (2, one share past the full limit), then
    `overloaded`; A is `overloaded` now that B waits; a third router C gets `queue_full` (the overrun is
    spent); 3. leases end one by one: A's requests run first (FCFS) and A is `overloaded` until it
    holds less than its share; 4. A sends one more. Result: A and B each hold their share (2 of 4):
    both are `overloaded` for more, and C still gets `queue_full` (full, nobody above its share)."""
    d = make_daemon(1, "request_queue_limit_per_worker = 4")
    async with SchedulerClient(d.endpoint) as a, SchedulerClient(d.endpoint) as b, SchedulerClient(d.endpoint) as c:
        tasks: list[asyncio.Task] = []
        try:
            leases = [await a.schedule("blocker", isl_tokens=ISL)]
            a_tasks = _burst(a, "a", 8)
            tasks += a_tasks
            a_waiting = await _settle(a_tasks, 4)
            assert [(e.reason, e.current, e.limit) for e in _refusals(a_tasks)] == [("queue_full", 4, 4)] * 4

            b_tasks = _burst(b, "b", 4)
            tasks += b_tasks
            b_waiting = await _settle(b_tasks, 2)
            assert [(e.reason, e.current, e.limit) for e in _refusals(b_tasks)] == [("overloaded", 2, 2)] * 2
            assert await asyncio.to_thread(_depth, d) == 6
            got = await _refused(a.schedule("a-late", isl_tokens=ISL))
            assert (got.reason, got.current, got.limit) == ("overloaded", 4, 2)
            got = await _refused(c.schedule("c-0", isl_tokens=ISL))
            assert (got.reason, got.current, got.limit) == ("queue_full", 6, 4)

            for held_after in (3, 2, 1):  # each release runs A's next request (FCFS, ahead of B's)
                leases.pop().release()
                lease = await _next_admitted(a_waiting, b_waiting)
                assert lease.request_id.startswith("a-")
                leases.append(lease)
                if held_after >= 2:
                    got = await _refused(a.schedule(f"a-held-{held_after}", isl_tokens=ISL))
                    assert (got.reason, got.current, got.limit) == ("overloaded", held_after, 2)
            a_waiting.append(asyncio.create_task(a.schedule("a-again", isl_tokens=ISL)))  # 1 < its share of 2
            tasks.append(a_waiting[-1])
            await _wait_depth(d, 4)  # A 2 + B 2: the class limit, each at its share
            assert not any(t.done() for t in a_waiting + b_waiting)

            for router, name in ((a, "a-more"), (b, "b-more")):
                got = await _refused(router.schedule(name, isl_tokens=ISL))
                assert isinstance(got, DaemonOverloaded) and (got.current, got.limit) == (2, 2)
            got = await _refused(c.schedule("c-1", isl_tokens=ISL))
            assert isinstance(got, QueueFull) and (got.current, got.limit) == (4, 4)
            await _drain(a_waiting + b_waiting, leases)
        finally:
            await _reap(tasks)
