"""Sim fleet + daemon over real KV events: the overlap the daemon reports equals the engines' truth.

The quiescent test runs a real `kvsched-daemon` subprocess subscribed to the KV-event PUB sockets
of an in-process `Fleet` (its engines publish through `KvEventPublisher`); requests sharing
prefixes are scheduled through the daemon and run on the engine each lease names (small caches, so
some prefixes are evicted). Once every published event has been applied (the daemon's
`kvsched_kv_events_applied` + `_replayed` counters), `Explain` of a probe request gives, per worker,
exactly the leading blocks that engine still holds. The approximate TTL is short, so the answer
cannot come from routing history.
"""

from __future__ import annotations

import re
import shutil
import socket
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import zmq

from kvsched import protocol as p
from kvsched.client.admin import AdminClient
from kvsched.client.sync import SyncSchedulerClient
from kvsched.config import config_from_dict
from kvsched.core.types import RequestSpec, WorkerKey
from kvsched.sim.engine import SimEngine, SimRequest
from kvsched.sim.fleet import Fleet, FleetParams, kv_event_endpoints
from kvsched.sim.fleet_spec import FleetSpec, config_toml
from kvsched.sim.virtual import attach_engines, make_inprocess_scheduler
from tests.conftest import start_daemon, wait_until

BLOCK = 16

# Prompts as block-hash chains; several share prefixes. Engines hold 12 blocks, a request of
# 6 blocks + 1 output token needs 7, so later requests on a worker evict earlier leaves.
PROMPTS = [
    [1, 2, 3, 4, 5, 6],
    [1, 2, 3, 7, 8, 9],
    [20, 21, 22, 23, 24, 25],
    [1, 2, 3, 4, 30, 31],
    [20, 21, 40, 41, 42, 43],
    [1, 2, 50, 51, 52, 53],
]
PINS = {0: (0, 0), 2: (1, 0)}
PROBES = [
    [1, 2, 3, 4, 5, 6],
    [1, 2, 3, 7, 8, 9],
    [20, 21, 22, 23, 24, 25],
    [1, 2, 3, 4, 30, 31],
    [20, 21, 40, 41, 42, 43],
    [1, 2, 50, 51, 52, 53],
    [1, 2, 99],
]


class _Counting:
    """Forwards an engine's cache changes to its publisher, counting the events."""

    def __init__(self, inner, counter: list[int]) -> None:
        self.inner, self.counter = inner, counter

    def block_stored(self, hashes, parent=None, block_size=16) -> None:
        self.counter[0] += 1
        self.inner.block_stored(hashes, parent, block_size)

    def block_removed(self, hashes) -> None:
        self.counter[0] += 1
        self.inner.block_removed(hashes)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    m = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _run_to_idle(engine: SimEngine) -> None:
    while engine.next_step_end() is not None:
        engine.step()


@pytest.fixture
def short_dir():
    d = tempfile.mkdtemp(prefix="kvsim", dir="/tmp")  # ipc paths are limited to ~107 bytes
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("encoding", ["array", "map"])
def test_daemon_overlap_equals_engine_cache_when_quiescent(short_dir, encoding):
    spec = FleetSpec(workers=2, block_size=BLOCK, kv_blocks=12, max_num_batched_tokens=4096, max_blocks_per_request=64)
    eps = kv_event_endpoints(spec, short_dir)
    ctx = zmq.Context()
    fleet = Fleet(FleetParams(f"ipc://{short_dir}/fleet.sock", spec, kv_events=eps, kv_encoding=encoding), ctx)
    published = [0]
    for engine in fleet.engines.values():
        engine.cache_listener = _Counting(engine.cache_listener, published)
    port = _free_port()
    # approx_ttl_s = 24 ms: routing history is gone by the probes, speculative entries live 1 ms
    toml = config_toml(spec, kv_events=eps).replace("[selector]", "[selector]\napprox_ttl_s = 0.024")
    toml = toml.replace("[daemon]", f"[daemon]\nmetrics_port = {port}")
    daemon = start_daemon(short_dir, toml)
    admin = AdminClient(daemon.admin_endpoint)
    client = SyncSchedulerClient(daemon.endpoint)

    def applied() -> float:
        fleet.publish_kv_events()  # also answers replay requests
        return _metric(port, "kvsched_kv_events_applied") + _metric(port, "kvsched_kv_events_replayed")

    try:
        for i, hashes in enumerate(PROMPTS):
            pin = PINS.get(i)  # every engine publishes (an engine that never did stays stale)
            lease = client.schedule(f"req-{i}", len(hashes) * BLOCK, np.array(hashes, np.uint64), pinned=pin)
            engine = fleet.engines[WorkerKey(*lease.worker)]
            engine.submit(SimRequest(f"req-{i}", len(hashes) * BLOCK, 1, tuple(hashes)), engine.clock_us)
            _run_to_idle(engine)
            fleet.publish_kv_events()
            lease.release("completed")
        assert published[0] > len(PROMPTS)  # stores and evictions happened
        assert wait_until(lambda: applied() >= published[0], timeout_s=20), (applied(), published[0])
        assert wait_until(lambda: _metric(port, "kvsched_stale_workers") == 0, timeout_s=5)
        workers = admin.call(p.Workers())
        assert not any(w.stale for w in workers.workers)
        for k, hashes in enumerate(PROBES):
            rid = f"probe-{k}"
            lease = client.schedule(rid, len(hashes) * BLOCK, np.array(hashes, np.uint64))
            lease.release("aborted")
            reply = admin.call(p.Explain(request_id=rid))
            assert isinstance(reply, p.ExplainReply)
            got = {(r.worker_id, r.dp_rank): r.overlap_blocks for r in reply.rows}
            truth = {tuple(key): e.cached_prefix_blocks(hashes) for key, e in fleet.engines.items()}
            assert got == truth, (hashes, got, truth)
            lapsed = time.monotonic() + 0.002  # the probe's own speculative entry (1 ms) must not count
            assert wait_until(lambda lapsed=lapsed: time.monotonic() > lapsed)
    finally:
        client.close()
        admin.close()
        daemon.stop(timeout_s=10)
        fleet.close()
        ctx.destroy(linger=0)


def _scheduler(mode: str):
    spec = FleetSpec(workers=2, block_size=BLOCK, kv_blocks=12, max_blocks_per_request=64)
    raw = {
        "daemon": {"block_size": BLOCK, "max_workers": 2, "max_slots": 64, "max_blocks_per_request": 64},
        "workers": [{"worker_id": w, "total_kv_blocks": 12} for w in range(2)],
    }
    return spec, make_inprocess_scheduler(config_from_dict(raw, where="test"), mode)


def _depths(sched, hashes, now_us: int) -> list[int]:
    return sched.view.depth(np.array(hashes, np.uint64), now_us)[:2].tolist()


def test_event_rows_ignore_routing_history_when_engine_evicted():
    _, sched = _scheduler("events")
    engine = SimEngine(4, BLOCK)
    attach_engines(sched, {WorkerKey(0, 0): engine})
    first = [1, 2, 3]
    engine.submit(SimRequest("a", 3 * BLOCK, 1, tuple(first)), 0)
    _run_to_idle(engine)
    sched.overlap.insert(np.array(first, np.uint64), 1, 0, 10**9)  # routing history says row 1 too
    assert _depths(sched, first, 1) == [3, 0]  # fresh event-fed rows: events only
    engine.submit(SimRequest("b", 3 * BLOCK, 1, (7, 8, 9)), engine.clock_us)
    _run_to_idle(engine)  # evicts the first prompt's blocks (4-block cache)
    assert _depths(sched, first, 2)[0] < 3
    assert _depths(sched, first, 2)[0] == engine.cached_prefix_blocks(first)


def test_stale_row_falls_back_to_approximate_index():
    _, sched = _scheduler("events")
    h = np.array([5, 6], np.uint64)
    sched.overlap.insert(h, 0, 0, 10**9)
    assert _depths(sched, h, 1) == [0, 0]
    sched.ledger.set_stale(0, True)
    assert _depths(sched, h, 1) == [2, 0]
    sched.event_device.insert(h, 1, 0, None)
    sched.ledger.set_stale(1, True)
    assert _depths(sched, h, 1) == [2, 0]  # stale: its event entries may be outdated
    sched.ledger.set_stale(1, False)
    assert _depths(sched, h, 1) == [2, 2]


def test_speculative_entry_counts_until_its_ttl():
    _, sched = _scheduler("events")
    spec = RequestSpec(request_id="r", isl_tokens=2 * BLOCK, block_hashes=np.array([11, 12], np.uint64), owner=1)
    out = sched.enqueue(spec, 0)
    row = sched.ledger.row_of(out[0].worker)
    assert _depths(sched, [11, 12], 1)[row] == 2  # routed, not yet confirmed by events
    ttl_us = sched.view.spec_ttl_us
    assert ttl_us == int(sched.config.selector.approx_ttl_s * 1e6 / 24)
    assert _depths(sched, [11, 12], ttl_us + 1)[row] == 0  # never confirmed: gone


def test_none_mode_reports_no_overlap():
    _, sched = _scheduler("none")
    spec = RequestSpec(request_id="r", isl_tokens=2 * BLOCK, block_hashes=np.array([11, 12], np.uint64), owner=1)
    sched.enqueue(spec, 0)
    assert _depths(sched, [11, 12], 1) == [0, 0]


@pytest.mark.timeout(90)
def test_add_worker_subscribes_and_remove_worker_forgets_when_admin(short_dir):
    """1. daemon without workers; 2. AddWorker with the engine's KV endpoints; 3. the engine caches a
    prompt and publishes; 4. overlap follows the events, the row turns fresh; 5. RemoveWorker, then
    AddWorker again without endpoints. Result: the re-added worker has no event-fed overlap."""
    spec = FleetSpec(workers=1, block_size=BLOCK, kv_blocks=64, max_blocks_per_request=64)
    eps = kv_event_endpoints(spec, short_dir, "tcp")
    ctx = zmq.Context()
    fleet = Fleet(FleetParams(f"ipc://{short_dir}/fleet.sock", spec, kv_events=eps, kv_encoding="map"), ctx)
    daemon = start_daemon(short_dir, "[daemon]\nblock_size = 16\nmax_workers = 4\n[selector]\napprox_ttl_s = 0.024\n")
    admin = AdminClient(daemon.admin_endpoint)
    client = SyncSchedulerClient(daemon.endpoint)
    hashes = [1, 2, 3, 4]
    n = [0]

    def probe_overlap() -> int:
        n[0] += 1
        lease = client.schedule(f"p{n[0]}", len(hashes) * BLOCK, np.array(hashes, np.uint64))
        lease.release("aborted")
        reply = admin.call(p.Explain(request_id=f"p{n[0]}"))
        return reply.rows[0].overlap_blocks

    try:
        ok = admin.call(p.AddWorker(worker_id=0, kv_events_endpoint=eps[0][0], kv_replay_endpoint=eps[0][1]))
        assert isinstance(ok, p.OkReply)
        engine = fleet.engines[WorkerKey(0, 0)]
        engine.submit(SimRequest("a", 4 * BLOCK, 1, tuple(hashes)), 0)
        _run_to_idle(engine)

        nudges = [0]

        def fresh_and_known() -> bool:
            stale = admin.call(p.Workers()).workers[0].stale
            if stale:
                # Batches published before the SUB joined are lost to it (ZeroMQ slow joiner); a live
                # engine keeps publishing, and the next live batch makes the daemon replay from seq 0.
                nudges[0] += 1
                engine.submit(SimRequest(f"nudge{nudges[0]}", BLOCK, 1, (1000 + nudges[0],)), 0)
                _run_to_idle(engine)
            fleet.publish_kv_events()
            return not stale and probe_overlap() == 4

        assert wait_until(fresh_and_known, timeout_s=40)
        assert isinstance(admin.call(p.RemoveWorker(worker_id=0)), p.OkReply)
        assert isinstance(admin.call(p.AddWorker(worker_id=0)), p.OkReply)
        lapsed = time.monotonic() + 0.05  # past the approximate TTL of the earlier probes
        assert wait_until(lambda lapsed=lapsed: time.monotonic() > lapsed)
        assert probe_overlap() == 0
        assert not admin.call(p.Workers()).workers[0].stale
    finally:
        client.close()
        admin.close()
        daemon.stop(timeout_s=10)
        fleet.close()
        ctx.destroy(linger=0)
