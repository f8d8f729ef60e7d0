"""Lifecycle words against a real daemon: a local router's dispatched / prefill_done / tokens are
shared-memory stores (no Update frame); the fold frees capacity for a waiting request; a stale store
never touches a reused slot; a restart folds words stored while no daemon ran; a router that does not
map the segments still works with frames; older-layout segments with live leases stop the start."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import numpy as np
import pytest

from kvsched import protocol as p
from kvsched.client import AdminClient, SchedulerClient
from kvsched.daemon.process import DaemonProcess
from kvsched.errors import DaemonUnavailable
from kvsched.shm.layout import H_VERSION
from kvsched.shm.segments import attach_segments, create_segments
from kvsched.shm.words import STATE_PREFILL_DONE, pack_state
from tests.conftest import free_port, purge, start_daemon, unique_instance, write_config

pytestmark = pytest.mark.timeout(120)

ONE_WORKER = """
[daemon]
block_size = 16
liveness_timeout_ms = 3000
heartbeat_ms = 200
metrics_port = {port}

[[workers]]
worker_id = 1
total_kv_blocks = 1000
max_num_batched_tokens = 1000

[[classes]]
name = "default"
prefill_busy_threshold = 1000
"""


def metric(port: int, name: str, label: str = "") -> float:
    """Sum of the samples of `name` (optionally those whose labels contain `label`); 0 when absent."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def admin_call(endpoint: str, req):
    with AdminClient(endpoint) as admin:
        return admin.call(req)


async def until(pred, timeout_s: float = 20.0) -> bool:
    """Poll a blocking predicate off the loop (the client's loop keeps running) until true."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await asyncio.to_thread(pred):
            return True
        await asyncio.sleep(0.02)
    return bool(await asyncio.to_thread(pred))


def lease_state(admin_endpoint: str, request_id: str) -> str | None:
    rows = admin_call(admin_endpoint, p.Leases()).leases
    return next((r.state for r in rows if r.request_id == request_id), None)


def prefill_tokens(admin_endpoint: str) -> int:
    return sum(w.active_prefill_tokens for w in admin_call(admin_endpoint, p.Workers()).workers)


def _daemon(tmp_path, config: str):
    port = free_port()
    d = start_daemon(tmp_path, config.format(port=port))
    d.port = port
    return d


@pytest.fixture
def daemon(tmp_path):
    d = _daemon(tmp_path, ONE_WORKER)
    yield d
    d.stop()
    purge(d.instance)


@pytest.fixture
def quiet_daemon(tmp_path):
    """Heartbeats every 10 s: within a short test every frame the daemon counts is a lifecycle frame."""
    d = _daemon(
        tmp_path,
        ONE_WORKER.replace("liveness_timeout_ms = 3000", "liveness_timeout_ms = 30000").replace(
            "heartbeat_ms = 200", "heartbeat_ms = 10000"
        ),
    )
    yield d
    d.stop()
    purge(d.instance)


async def test_local_lifecycle_sends_no_update_frames_and_prefill_done_admits_waiting_request(quiet_daemon):
    daemon = quiet_daemon
    async with SchedulerClient(daemon.endpoint, client_name="local") as client:
        a = await client.schedule("w-a", isl_tokens=1200)  # 1200 prefill tokens: the worker is busy
        a.dispatched()
        waiting = asyncio.ensure_future(client.schedule("w-b", isl_tokens=100))
        assert await until(lambda: admin_call(daemon.admin_endpoint, p.Status()).queued == 1)
        assert await until(lambda: lease_state(daemon.admin_endpoint, "w-a") == "dispatched")
        a.prefill_done()  # a store: the fold timer runs while w-b waits
        b = await asyncio.wait_for(waiting, 20)
        assert await until(lambda: prefill_tokens(daemon.admin_endpoint) == 100)
        a.add_output_tokens(7)
        assert await until(lambda: lease_state(daemon.admin_endpoint, "w-a") == "prefill_done")
        async with b:
            b.dispatched()
            b.prefill_done()
        a.release()
        assert await until(lambda: admin_call(daemon.admin_endpoint, p.Status()).active_leases == 0)
    assert metric(daemon.port, "kvsched_update_frames_total") == 0
    # Hello + 2 x (Enqueue, Release): two frames in per lifecycle
    assert await until(lambda: metric(daemon.port, "kvsched_frames_received_total") >= 5)
    assert metric(daemon.port, "kvsched_frames_received_total") == 5
    assert metric(daemon.port, "kvsched_word_folds_total") >= 2


async def test_stale_generation_store_after_release_does_not_touch_reused_slot(daemon):
    instance = daemon.instance
    segs = attach_segments(instance)
    try:
        async with SchedulerClient(daemon.endpoint, client_name="stale") as client:
            a = await client.schedule("s-a", isl_tokens=300)
            a.release()
            assert await until(lambda: admin_call(daemon.admin_endpoint, p.Status()).active_leases == 0)
            b = await client.schedule("s-b", isl_tokens=300)
            assert b.slot == a.slot and b.generation != a.generation
            segs.state[a.slot] = np.uint64(pack_state(a.generation, STATE_PREFILL_DONE))  # late, stale
            b.dispatched()  # stored after the stale word: once folded, the stale one was seen too
            assert await until(lambda: lease_state(daemon.admin_endpoint, "s-b") == "dispatched")
            await asyncio.sleep(0.05)  # a few more idle folds
            assert lease_state(daemon.admin_endpoint, "s-b") == "dispatched"
            assert prefill_tokens(daemon.admin_endpoint) == 300
            b.release()
    finally:
        segs.close()


async def test_restart_folds_words_stored_while_daemon_was_down(daemon):
    async with SchedulerClient(daemon.endpoint, client_name="restart", reconnect_deadline_s=60) as client:
        a = await client.schedule("r-a", isl_tokens=300)
        a.dispatched()
        assert await until(lambda: lease_state(daemon.admin_endpoint, "r-a") == "dispatched")
        await asyncio.to_thread(daemon.kill)
        a.prefill_done()  # stores into the surviving segment; no daemon folds them now
        a.add_output_tokens(5)
        await asyncio.to_thread(daemon.restart)
        # folded at start, before any Reattach: the re-adopted lease carries the words
        rows = (await asyncio.to_thread(admin_call, daemon.admin_endpoint, p.Leases())).leases
        assert [(r.request_id, r.state, r.output_tokens) for r in rows] == [("r-a", "prefill_done", 5)]
        assert await asyncio.to_thread(prefill_tokens, daemon.admin_endpoint) == 0
        assert await until(lambda: client.connected)
        await asyncio.sleep(0.3)
        assert a.outcome is None and client.lost_leases == []
        a.release()
        assert await until(lambda: admin_call(daemon.admin_endpoint, p.Status()).active_leases == 0)


async def test_router_without_segments_uses_update_frames(daemon):
    async with SchedulerClient(daemon.endpoint, client_name="remote", attach_progress=False) as client:
        a = await client.schedule("f-a", isl_tokens=1200)
        a.dispatched()
        waiting = asyncio.ensure_future(client.schedule("f-b", isl_tokens=100))
        assert await until(lambda: admin_call(daemon.admin_endpoint, p.Status()).queued == 1)
        a.prefill_done()
        b = await asyncio.wait_for(waiting, 20)
        a.add_output_tokens(3)
        assert await until(lambda: lease_state(daemon.admin_endpoint, "f-a") == "prefill_done")
        b.release()
        a.release()
    # The daemon writes its metric tally every ~100 ms, and the three kinds may arrive in different
    # wakes on either side of a write: wait for each.
    for kind in ("prefill_done", "dispatched", "progress"):
        assert await until(
            lambda kind=kind: metric(daemon.port, "kvsched_update_frames_total", f'kind="{kind}"') == 1
        ), kind


def _old_layout_segments(instance: str, live: bool) -> None:
    """Segments as a layout-1 daemon would leave them (header version 1), with or without a lease."""
    segs = create_segments(
        instance, max_workers=64, max_slots=8192, max_blocks_per_request=1024, block_size=16, epoch=1
    )
    segs.ledger.header[H_VERSION] = 1
    if live:
        segs.ledger.s_state[0] = 1
    segs.close()


def test_daemon_refuses_old_layout_with_live_leases_and_names_purge(tmp_path):
    instance = unique_instance("old")
    _old_layout_segments(instance, live=True)
    cfg = write_config(tmp_path / "d.toml", "[[workers]]\nworker_id = 1\n")
    try:
        with pytest.raises(DaemonUnavailable) as info:
            DaemonProcess.start(cfg, instance=instance, runtime_dir=tmp_path, ready_timeout_s=60)
        assert "kvsched-daemon --purge" in str(info.value) and "layout version 1" in str(info.value)
    finally:
        purge(instance)


def test_daemon_replaces_old_layout_without_live_leases(tmp_path):
    instance = unique_instance("old")
    _old_layout_segments(instance, live=False)
    cfg = write_config(tmp_path / "d.toml", "[[workers]]\nworker_id = 1\n")
    d = DaemonProcess.start(cfg, instance=instance, runtime_dir=tmp_path, ready_timeout_s=60)
    try:
        assert admin_call(d.admin_endpoint, p.Status()).workers == 1
    finally:
        d.stop()
        purge(instance)


async def test_client_that_does_not_know_the_layout_falls_back_to_update_frames(daemon, monkeypatch):
    import kvsched.shm.layout as layout

    monkeypatch.setattr(layout, "LAYOUT_VERSION", layout.LAYOUT_VERSION + 1)  # a client of another layout
    async with SchedulerClient(daemon.endpoint, client_name="other-layout") as client:
        assert not client._words.mapped
        a = await client.schedule("l-a", isl_tokens=100)
        a.dispatched()
        a.prefill_done()
        a.add_output_tokens(2)
        assert await until(lambda: lease_state(daemon.admin_endpoint, "l-a") == "prefill_done")
        a.release()
    assert await until(lambda: metric(daemon.port, "kvsched_update_frames_total") == 3)
