"""A restarted daemon keeps its cache view: the event-fed overlap index and each KV-event stream's
last applied seq live in shared memory, and the restart asks every engine for what it missed.

Real processes: a simulated fleet (`kvsched.sim.fleet`, engines publishing vLLM KV events with a
replay ROUTER each), a real daemon subscribed to them, SIGKILLed and restarted.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
import time

import msgspec
import numpy as np
import pytest
import zmq

from kvsched import protocol as p
from kvsched.client import SchedulerClient
from kvsched.shm.segments import segment_names
from kvsched.sim.fleet import FleetParams, SimBatch, SimDone, SimSubmit, fleet_main, kv_event_endpoints
from kvsched.sim.fleet_spec import FleetSpec, config_toml
from tests.conftest import admin_call, start_daemon, wait_until

pytestmark = pytest.mark.timeout(240)

BS, DEPTH, W = 16, 4, 2


@pytest.fixture
def fleet(tmp_path):
    """The fleet process; yields (spec, kv-event endpoints, submit(jobs))."""
    spec = FleetSpec(workers=W, block_size=BS, kv_blocks=4096, max_blocks_per_request=16, max_slots=64)
    eps = kv_event_endpoints(spec, tmp_path)
    ctx = mp.get_context("spawn")
    ready, go, stop, t0 = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Value("d", 0.0)
    proc = ctx.Process(
        target=fleet_main,
        args=(FleetParams(f"ipc://{tmp_path}/fleet.sock", spec, speedup=50.0, kv_events=eps), ready, go, t0, stop),
        daemon=True,
    )
    proc.start()
    assert ready.wait(60), "fleet did not start"
    t0.value = time.monotonic()
    go.set()
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{tmp_path}/fleet.sock")
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(SimBatch)
    count = iter(range(1 << 30))

    def submit(jobs: list[tuple[int, list[int]]]) -> None:
        """Run each (worker, hashes) on its engine and wait until all are done (cached, published)."""
        waiting = set()
        for worker, hashes in jobs:
            rid = f"direct-{next(count)}"
            waiting.add(rid)
            sock.send(enc.encode(SimSubmit(rid, worker, 0, len(hashes) * BS, 2, np.array(hashes, "<u8").tobytes())))
        while waiting:
            assert sock.poll(30_000), f"fleet silent; waiting for {waiting}"
            waiting -= {it.request_id for it in dec.decode(sock.recv()).items if isinstance(it, SimDone)}

    yield spec, eps, submit
    sock.close(0)
    zctx.term()
    stop.set()
    proc.join(10)


async def _decisions(endpoint: str, prefixes: dict[int, list[int]], tag: str) -> dict[int, tuple[int, int]]:
    """One decision per prefix (prefix + a fresh block), one at a time, each released at once.
    Returns prefix -> (worker_id, overlap_blocks)."""
    rng = random.Random(tag)
    out = {}
    async with SchedulerClient(endpoint, client_name=tag) as client:
        for i, prefix in prefixes.items():
            lease = await client.schedule(
                f"{tag}-{i}", isl_tokens=(DEPTH + 1) * BS, block_hashes=[*prefix, rng.getrandbits(63)]
            )
            lease.release("completed")
            out[i] = (lease.worker.worker_id, lease.overlap_blocks)
    return out


def test_restart_keeps_the_cache_view_and_catches_up_without_new_events(tmp_path, fleet):
    """1. engines cache 6 prefixes (3 each) and publish them; the daemon learns them from the events;
    2. the daemon is SIGKILLed; its KV-index segment stays; 3. while it is down the engines cache 4
    more prefixes (published to nobody); 4. it restarts, and from the very first request after
    READY every old prefix goes to its holder with full overlap; the 4 new ones are learnt through
    the catch-up replay, with no engine publishing anything after the restart; 5. a clean stop with
    no live lease removes every segment, the KV index included. The old daemon started with an
    empty index (overlap 0 everywhere) and asked for replay only when an engine published again."""
    spec, eps, submit = fleet
    rng = random.Random(7)
    warm = {i: [rng.getrandbits(63) for _ in range(DEPTH)] for i in range(6)}
    holders = {i: i % W for i in range(10)}
    submit([(holders[i], [*p, rng.getrandbits(63)]) for i, p in warm.items()])
    # dynamo_cost: with nothing in flight the deepest overlap always wins, so a decision shows
    # exactly what the index knows (the default kv selector also weighs recently admitted work,
    # which the repeated learning rounds pile onto each holder: it failed ~1 run in 12 under load).
    daemon = start_daemon(tmp_path, config_toml(spec, "dynamo_cost", kv_events=eps))
    instance = daemon.instance
    try:
        deadline = time.monotonic() + 30
        while True:  # the daemon learns them (replay of the engines' history on their next publish)
            submit([(w, [rng.getrandbits(63)]) for w in range(W)])  # make each engine publish
            got = asyncio.run(_decisions(daemon.endpoint, warm, f"learn{time.monotonic_ns()}"))
            if all(got[i] == (holders[i], DEPTH) for i in warm) or time.monotonic() > deadline:
                break
        assert all(got[i] == (holders[i], DEPTH) for i in warm), got
        # the last releases land: no lease is live at the crash (a re-adopted lease would load its worker)
        assert wait_until(lambda: admin_call(daemon, p.Status()).active_leases == 0, 30)
        daemon.kill()
        assert os.path.exists(f"/dev/shm/kvsched-{instance}-kvindex")
        down = {i: [rng.getrandbits(63) for _ in range(DEPTH)] for i in range(6, 10)}
        submit([(holders[i], [*p, rng.getrandbits(63)]) for i, p in down.items()])
        daemon.restart()
        first = asyncio.run(_decisions(daemon.endpoint, warm, "after"))
        assert first == {i: (holders[i], DEPTH) for i in warm}, first
        deadline = time.monotonic() + 15  # nothing is published from here on: only a replay can tell
        while True:
            late = asyncio.run(_decisions(daemon.endpoint, down, f"down{time.monotonic_ns()}"))
            if late == {i: (holders[i], DEPTH) for i in down} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert late == {i: (holders[i], DEPTH) for i in down}, late
        time.sleep(0.5)
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log_tail()
    left = [n for n in segment_names(instance) if os.path.exists(f"/dev/shm/{n}")]
    assert left == [], left
