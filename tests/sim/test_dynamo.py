"""NVIDIA Dynamo's selection service as a replay router (`kvsched.sim.dynamo`), against the real
service from the `bench-dynamo` extra; skipped when `ai-dynamo-runtime` is not installed."""

from __future__ import annotations

import asyncio
import socket
import time
from importlib.resources import files

import pytest
import zmq

from kvsched.core.types import WorkerKey
from kvsched.sim.dynamo import DynamoRoute, DynamoService, dynamo_unavailable_reason
from kvsched.sim.kv_publisher import KvEventPublisher
from kvsched.sim.tokens import TokenIdPublisher, token_ids_for

REASON = dynamo_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
SLICE = files("kvsched") / "data" / "mooncake_slice.jsonl"
B = 16


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_service_sees_a_stored_block_and_routes_the_request_to_the_engine_holding_it():
    """1. the service starts; two engines register with their KV-event endpoints (kvsched's
       vLLM-format publisher, synthetic token ids per block);
    2. engine 1 publishes BlockStored for 4 blocks (resent until seen: PUB/SUB joins late);
    3. a request extending those blocks asks /overlap_scores, then /select_and_reserve.
    Result: the service sees 4 blocks on engine 1 and 0 on engine 0, picks engine 1 reporting 4
    cached blocks' tokens, and prefill_complete and DELETE of the reservation succeed (async client)."""
    ctx = zmq.Context()
    eps = [f"tcp://127.0.0.1:{_port()}" for _ in range(2)]
    pubs = [TokenIdPublisher(KvEventPublisher(ctx, ep)) for ep in eps]
    stored = [0x5EED0 + k for k in range(4)]
    query = token_ids_for([*stored, 0xF00D, 0xF00E], B)
    try:
        with DynamoService() as svc:
            svc.register_fleet([WorkerKey(0, 0), WorkerKey(1, 0)], eps, B)
            seen: dict = {}
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and seen.get((1, 0), 0) < 4:
                pubs[1].block_stored(stored, None, B)
                pubs[1].flush()
                time.sleep(0.5)
                seen = svc.overlap_blocks(query)
            assert seen.get((1, 0)) == 4 and seen.get((0, 0), 0) == 0, seen

            async def route() -> dict:
                r = DynamoRoute(svc.base)
                await r.open()
                try:
                    assert (await r.overlap_blocks(query))["1:0"] == 4
                    rep = await r.select_and_reserve(query)
                    await r.prefill_complete(rep["selection_id"])
                    await r.release(rep["selection_id"])
                    return rep
                finally:
                    await r.close()

            rep = asyncio.run(route())
            assert rep["worker_id"] == 1 and int(rep["overlap"]["gpu"]) == 4 * B, rep  # overlap in tokens
    finally:
        for p in pubs:
            p.close()
        ctx.term()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wall_replay_routed_by_dynamo_completes_every_request_and_agrees_on_overlap(tmp_path):
    """1. a wall-clock replay of 150 Mooncake requests on 4 engines routed by Dynamo (router
       processes call select_and_reserve / prefill_complete / DELETE); every request completes on an
       engine Dynamo named, and its hits come from prefixes Dynamo learnt from the KV events;
    2. the same slice routed by the daemon with Dynamo watching: on every 5th request Dynamo's
       /overlap_scores is compared with the daemon's per-worker overlap for the same decision.
    Result: 1. all completed, some prompt tokens served from cache; 2. most (request, worker) pairs agree."""
    import json

    from kvsched.sim.replay import ReplayOptions, run_replay
    from kvsched.sim.summary import COMPLETED, read_results

    out = tmp_path / "dyn"
    summary = run_replay(
        ReplayOptions(trace=SLICE, routers=2, workers=4, speedup=20.0, limit=150, out=out, router_via="dynamo")
    )
    results = read_results(out / "results.jsonl")
    assert summary.selector == "dynamo"
    assert all(r.outcome == COMPLETED and r.worker for r in results), [r.detail for r in results if r.detail][:3]
    assert sum(r.cached_tokens for r in results) > 0
    assert all(r.best_overlap_blocks >= r.overlap_blocks for r in results)
    kv = tmp_path / "kv"
    run_replay(
        ReplayOptions(trace=SLICE, routers=2, workers=4, speedup=20.0, limit=150, out=kv, overlap_sample_every=5)
    )
    samples = [json.loads(x) for x in (kv / "overlap_samples.jsonl").read_text().splitlines()]
    assert len(samples) >= 20
    pairs = [(s["daemon"].get(k, 0), s["dynamo"].get(k, 0)) for s in samples for k in s["daemon"]]
    assert any(d > 0 for d, _ in pairs)
    assert sum(d == y for d, y in pairs) / len(pairs) >= 0.8, pairs
