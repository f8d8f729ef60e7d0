"""A replay router process: every R-th trace request → `schedule()` → fleet → lease released.

Router k of R takes trace rows k, k+R, k+2R, ...; waits for each arrival (trace time / (load_scale
× speedup) wall seconds after the shared `t0`), asks the daemon through `SchedulerClient`, submits
the admitted request to the fleet worker named by the lease, reports `dispatched`, `prefill_done`
at the first token and output tokens as they stream, and leaves the lease context at the last token
(Release completed; any error → aborted). One `RequestResult` per request goes to its results file
(msgspec JSON Lines) when the router finishes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import msgspec
import numpy as np
import zmq

from .. import protocol as p
from ..client import SchedulerClient
from ..client.admin import AdminClient
from ..errors import KvschedError, RequestRejected
from ..protocol import WorkerKey
from .dynamo import DynamoRoute
from .fleet import SimBatch, SimDone, SimError, SimFirstToken, SimProgress, SimSubmit
from .summary import ABORTED, COMPLETED, REJECTED, RequestResult, write_results
from .tokens import token_ids_for
from .trace import Trace, load_trace

if TYPE_CHECKING:
    from ..client import Lease, SchedulerClient
    from .dynamo import DynamoRoute

log = logging.getLogger(__name__)

# How long the orchestrator waits for a spawned router to be ready (s; it imports numpy/zmq/client and
# parses the trace), and so how long a router waits for the daemon's first Welcome. With the client's
# former 5 s default, a router on a loaded machine gave up on a daemon that was up, and the replay lost
# all its rows.
ROUTER_READY_TIMEOUT_S = 120.0
CONNECT_TIMEOUT_S = ROUTER_READY_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class RouterParams:
    """What one router process needs (picklable, for multiprocessing spawn)."""

    index: int  # k in 0..routers-1
    routers: int  # R
    trace_path: str
    limit: int | None
    endpoint: str  # daemon data socket
    fleet_endpoint: str
    results_path: str
    speedup: float = 1.0
    load_scale: float = 1.0
    run_tag: str = "r"  # request ids are f"{run_tag}-{row}"
    block_size: int | None = None  # None = the trace's
    class_names: tuple[str, ...] = ()  # policy classes; row i's is class_names[class_codes[i]]
    class_codes: bytes = b""  # little-endian u32 per trace row (empty = every request sent without a class)
    dynamo_url: str | None = None  # a running Dynamo selection service (`kvsched.sim.dynamo`)
    route_via_dynamo: bool = False  # route with Dynamo's select_and_reserve instead of the daemon
    admin_endpoint: str | None = None  # the daemon's admin socket (overlap samples use `Explain`)
    overlap_sample_every: int = 0  # daemon routing + dynamo_url: compare overlaps on every N-th row (0 = off)
    overlap_path: str | None = None  # JSON Lines of those samples


class _FleetAbort(Exception):
    """The fleet could not run the request."""


class _DynamoLease:
    """A Dynamo reservation behind the lease interface `_on_event` drives: `prefill_done()` posts
    prefill_complete (in the background), output tokens are only counted, `release()` deletes it."""

    def __init__(self, route, rep: dict, loop) -> None:
        self.route, self.loop = route, loop
        self.selection_id = str(rep["selection_id"])
        self.worker = WorkerKey(int(rep["worker_id"]), int(rep.get("dp_rank") or 0))
        self.output_tokens = 0
        self._prefill: asyncio.Task | None = None

    def prefill_done(self) -> None:
        self._prefill = self.loop.create_task(self.route.prefill_complete(self.selection_id))

    def add_output_tokens(self, n: int) -> None:
        self.output_tokens += n

    async def release(self) -> None:
        if self._prefill is not None:
            await asyncio.gather(self._prefill, return_exceptions=True)
        await self.route.release(self.selection_id)


@dataclass(slots=True)
class _InFlight:
    lease: Lease | _DynamoLease
    result: RequestResult
    done: asyncio.Future


class Router:
    """One router's async work (module docstring)."""

    def __init__(self, params: RouterParams, trace: Trace, on_finished=None) -> None:
        self.p = params
        self.trace = trace
        self.arrivals = trace.scaled_arrivals_us(params.load_scale)
        self.rows = list(range(params.index, len(trace), params.routers))
        self.classes = np.frombuffer(params.class_codes, dtype="<u4") if params.class_codes else None
        self.results: list[RequestResult] = []
        self.inflight: dict[str, _InFlight] = {}
        self._on_finished = on_finished
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(SimBatch)
        self._ctx = zmq.Context()
        self.fleet = self._ctx.socket(zmq.DEALER)
        self.fleet.setsockopt(zmq.LINGER, 0)
        self.fleet.setsockopt(zmq.SNDHWM, 100_000)
        self.fleet.setsockopt(zmq.RCVHWM, 100_000)
        self.client: SchedulerClient | None = None
        self.dynamo: DynamoRoute | None = None
        self.overlap_samples: list[dict] = []
        self._sampling: set[asyncio.Task] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._poll_handle: asyncio.TimerHandle | None = None

    def _fleet_fd(self) -> int:
        return cast(int, self.fleet.getsockopt(zmq.FD))

    async def connect(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.fleet.connect(self.p.fleet_endpoint)
        self.loop.add_reader(self._fleet_fd(), self._on_fleet)
        self._poll_handle = self.loop.call_later(0.02, self._poll_fleet)
        if self.p.dynamo_url:
            self.dynamo = dynamo = DynamoRoute(self.p.dynamo_url)
            await dynamo.open()
        if not self.p.route_via_dynamo:
            self.client = client = SchedulerClient(
                self.p.endpoint,
                client_name=f"replay-{self.p.run_tag}-r{self.p.index}",
                connect_timeout_s=CONNECT_TIMEOUT_S,
            )
            await client.connect()

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        if self.dynamo is not None:
            await self.dynamo.close()
        if self._poll_handle is not None:
            self._poll_handle.cancel()
        if self.loop is not None and not self.fleet.closed:
            self.loop.remove_reader(self._fleet_fd())
        self.fleet.close(0)
        self._ctx.term()

    async def run(self, t0: float) -> list[RequestResult]:
        """Replay this router's rows against `t0` (monotonic seconds of simulated time 0)."""
        tasks: set[asyncio.Task] = set()
        scale = 1e6 * self.p.speedup
        for i in self.rows:
            delay = t0 + self.arrivals[i] / scale - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self._one(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks or self._sampling:
            await asyncio.gather(*list(tasks), *list(self._sampling))
        return self.results

    def _result(self, i: int) -> RequestResult:
        """The result record of trace row i, before it is routed."""
        return RequestResult(
            index=i,
            request_id=f"{self.p.run_tag}-{i}",
            arrival_us=int(self.arrivals[i]),
            isl=int(self.trace.isl[i]),
            osl=int(self.trace.osl[i]),
            policy_class=self.p.class_names[self.classes[i]] if self.classes is not None else "",
        )

    async def _one(self, i: int) -> None:
        if self.p.route_via_dynamo:
            return await self._one_dynamo(i)

        r = self._result(i)
        rid = r.request_id
        hashes = self.trace.hashes_of(i)
        t_a = time.perf_counter_ns()
        assert self.client is not None and self.loop is not None, "connect() first"
        try:
            lease = await self.client.schedule(rid, r.isl, hashes, policy_class=r.policy_class)
        except RequestRejected as exc:
            r.admission_latency_us = (time.perf_counter_ns() - t_a) / 1000.0
            r.outcome, r.reason, r.detail = REJECTED, exc.reason, exc.detail
            return self._finish(r)
        except KvschedError as exc:
            r.outcome, r.detail = ABORTED, f"schedule: {type(exc).__name__}: {exc}"
            return self._finish(r)
        r.admission_latency_us = (time.perf_counter_ns() - t_a) / 1000.0
        r.worker = str(lease.worker)
        r.queued_us = int(lease.queued_us)
        r.queue_wait_us = int(lease.queued_us * self.p.speedup)
        r.predicted_cached_tokens = int(lease.cached_tokens)
        if self.dynamo is not None and self.p.overlap_sample_every and i % self.p.overlap_sample_every == 0:
            # Beside the request, not before it: awaiting the two reads here held every sampled request
            # back from its engine for their round trip (tens of ms wall, times the speedup), which showed
            # up in the sampled run's TTFT and nowhere else.
            sample = asyncio.ensure_future(self._sample_overlap(i, rid, hashes))
            self._sampling.add(sample)
            sample.add_done_callback(self._sampling.discard)
        try:
            async with lease:
                fut = self.loop.create_future()
                self.inflight[rid] = _InFlight(lease, r, fut)
                w = lease.worker
                self._send(SimSubmit(rid, w.worker_id, w.dp_rank, r.isl, r.osl, hashes.astype("<u8").tobytes()))
                lease.dispatched()
                await fut
            r.outcome = COMPLETED
        except _FleetAbort as exc:
            r.outcome, r.detail = ABORTED, f"fleet: {exc}"
        except KvschedError as exc:
            r.outcome, r.detail = ABORTED, f"lease: {type(exc).__name__}: {exc}"
        finally:
            self.inflight.pop(rid, None)
        self._finish(r)

    async def _one_dynamo(self, i: int) -> None:
        """Route row i with Dynamo: select_and_reserve on its token ids, run it, prefill_complete at
        the first token (`_on_event`), DELETE the reservation at the end (or on any failure)."""
        r = self._result(i)
        rid = r.request_id
        hashes = self.trace.hashes_of(i)
        tokens = token_ids_for(hashes.tolist(), self.trace.block_size)
        t_a = time.perf_counter_ns()
        assert self.dynamo is not None and self.loop is not None, "connect() first"
        try:
            rep = await self.dynamo.select_and_reserve(tokens)
        except Exception as exc:  # the service refused or failed: the request is not run
            r.admission_latency_us = (time.perf_counter_ns() - t_a) / 1000.0
            r.outcome, r.detail = ABORTED, f"dynamo select_and_reserve: {type(exc).__name__}: {exc}"
            return self._finish(r)
        r.admission_latency_us = (time.perf_counter_ns() - t_a) / 1000.0
        lease = _DynamoLease(self.dynamo, rep, self.loop)
        r.worker = str(lease.worker)
        r.predicted_cached_tokens = int((rep.get("overlap") or {}).get("gpu", 0))  # Dynamo reports tokens
        try:
            fut = self.loop.create_future()
            self.inflight[rid] = _InFlight(lease, r, fut)
            w = lease.worker
            self._send(SimSubmit(rid, w.worker_id, w.dp_rank, r.isl, r.osl, hashes.astype("<u8").tobytes()))
            await fut
            r.outcome = COMPLETED
        except _FleetAbort as exc:
            r.outcome, r.detail = ABORTED, f"fleet: {exc}"
        finally:
            self.inflight.pop(rid, None)
            try:
                await lease.release()
            except Exception as exc:
                log.warning("router: dynamo release failed request_id=%s err=%s", rid, exc)
        self._finish(r)

    async def _sample_overlap(self, i: int, rid: str, hashes) -> None:
        """Record the daemon's per-worker overlap for this decision (`Explain`) beside Dynamo's
        `/overlap_scores` for the same token ids, taken at the same moment."""

        def explain():
            with AdminClient(self.p.admin_endpoint) as admin:
                return admin.call(p.Explain(request_id=rid))

        assert self.dynamo is not None and self.loop is not None, "connect() first"
        try:
            dyn, rep = await asyncio.gather(
                self.dynamo.overlap_blocks(token_ids_for(hashes.tolist(), self.trace.block_size)),
                self.loop.run_in_executor(None, explain),
            )
        except Exception as exc:  # a sample is evidence, not a reason to fail the request
            log.warning("router: overlap sample failed row=%d err=%s", i, exc)
            return
        if isinstance(rep, p.ExplainReply):
            daemon = {f"{row.worker_id}:{row.dp_rank}": int(row.overlap_blocks) for row in rep.rows}
            self.overlap_samples.append({"row": i, "blocks": len(hashes), "daemon": daemon, "dynamo": dyn})

    def _finish(self, r: RequestResult) -> None:
        self.results.append(r)
        if self._on_finished is not None:
            self._on_finished()

    # ------------------------------------------------------------------ fleet socket

    def _send(self, frame: SimSubmit) -> None:
        self.fleet.send(self._enc.encode(frame))
        # A send can consume the edge of ZeroMQ's level-less FD: look for input right away.
        assert self.loop is not None, "connect() first"
        self.loop.call_soon(self._on_fleet)

    def _poll_fleet(self) -> None:
        """Safety net for the edge-triggered FD: drain every 20 ms whatever happened."""
        self._on_fleet()
        assert self.loop is not None, "connect() first"
        self._poll_handle = self.loop.call_later(0.02, self._poll_fleet)

    def _on_fleet(self) -> None:
        if self.fleet.closed:
            return
        while cast(int, self.fleet.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                raw = self.fleet.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            for item in self._dec.decode(raw).items:
                self._on_event(item)

    def _on_event(self, ev) -> None:
        st = self.inflight.get(ev.request_id)
        if st is None or st.done.done():
            return
        lease, r = st.lease, st.result
        if isinstance(ev, SimFirstToken):
            r.ttft_us = ev.t_us - r.arrival_us
            r.cached_tokens = ev.cached_tokens
            r.overlap_blocks, r.best_overlap_blocks = ev.overlap_blocks, ev.best_overlap_blocks
            lease.prefill_done()
            self._add_tokens(lease, 1)
        elif isinstance(ev, SimProgress):
            self._add_tokens(lease, ev.output_tokens)
        elif isinstance(ev, SimDone):
            self._add_tokens(lease, ev.output_tokens)
            r.e2e_us = ev.t_us - r.arrival_us
            r.output_tokens = ev.output_tokens
            st.done.set_result(None)
        elif isinstance(ev, SimError):
            st.done.set_exception(_FleetAbort(ev.message))

    @staticmethod
    def _add_tokens(lease, total: int) -> None:
        delta = total - lease.output_tokens
        if delta > 0:
            lease.add_output_tokens(delta)


def router_main(params: RouterParams, ready, go, t0_value, done_counter) -> None:
    """Process entry (multiprocessing spawn): load the trace, connect, signal `ready`, wait for
    `go`, replay, write the results file. `done_counter`: a multiprocessing Value('i') incremented
    per finished request (the orchestrator's progress bar)."""
    import uvloop

    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s router{params.index} %(levelname)s %(message)s")
    trace = load_trace(params.trace_path, params.limit)
    if params.block_size is not None:
        trace.block_size = params.block_size

    def bump() -> None:
        with done_counter.get_lock():
            done_counter.value += 1

    async def main() -> None:
        router = Router(params, trace, bump)
        try:
            await router.connect()
            ready.set()
            while not go.is_set():
                await asyncio.sleep(0.01)
            await router.run(t0_value.value)
        finally:
            write_results(router.results, Path(params.results_path))
            if params.overlap_path and router.overlap_samples:
                Path(params.overlap_path).write_text("".join(json.dumps(x) + "\n" for x in router.overlap_samples))
            await router.close()

    uvloop.run(main())
