"""The replay router's overlap sampling (daemon routing with Dynamo watching) must not delay the
request it samples: the wall-clock cross-check compares TTFTs, and a sampled request held back from
its engine for the sample's two reads made `kv`'s sampled run look slower than it routes."""

from __future__ import annotations

import asyncio
from importlib.resources import files

from kvsched.protocol import WorkerKey
from kvsched.sim.router import Router, RouterParams
from kvsched.sim.trace import load_trace

SLICE = str(files("kvsched") / "data" / "mooncake_slice.jsonl")


class _Lease:
    worker = WorkerKey(0, 0)
    queued_us = 0
    cached_tokens = 0
    output_tokens = 0

    def dispatched(self) -> None:
        pass

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        return None


class _Client:
    async def schedule(self, request_id, isl_tokens, hashes, policy_class=""):
        return _Lease()


def test_a_sampled_request_reaches_its_engine_before_the_overlap_sample_returns():
    """Row 0 sampled (every 1st row) with a sample that takes 2 s: the engine submit is sent while the
    sample is still running, the request completes when the engine says so, and `run`-style draining
    waits for the sample before the samples are written."""

    async def main() -> None:
        params = RouterParams(
            index=0,
            routers=1,
            trace_path=SLICE,
            limit=4,
            endpoint="inproc://unused",
            fleet_endpoint="inproc://unused",
            results_path="/dev/null",
            overlap_sample_every=1,
        )
        router = Router(params, load_trace(SLICE, 4))
        router.loop = asyncio.get_running_loop()
        router.client, router.dynamo = _Client(), object()
        sent, sample_done = [], asyncio.Event()

        async def slow_sample(i, rid, hashes):
            await asyncio.sleep(2.0)
            router.overlap_samples.append({"row": i})
            sample_done.set()

        router._sample_overlap = slow_sample
        router._send = sent.append
        try:
            task = asyncio.create_task(router._one(0))
            for _ in range(100):
                if sent:
                    break
                await asyncio.sleep(0.01)
            assert sent and sent[0].request_id == "r-0", "the submit waited for the overlap sample"
            assert not sample_done.is_set()
            router.inflight["r-0"].done.set_result(None)
            await asyncio.wait_for(task, 1.0)
            assert router.results[-1].outcome == "completed"
            assert router._sampling, "the sample is still tracked until it ends"
            await asyncio.wait_for(asyncio.gather(*router._sampling), 5.0)
            assert router.overlap_samples == [{"row": 0}]
        finally:
            router.fleet.close(0)
            router._ctx.term()

    asyncio.run(main())
