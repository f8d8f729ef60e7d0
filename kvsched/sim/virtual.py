"""The virtual-time discrete-event driver: trace arrivals → in-process `Scheduler` → `SimEngine`s.

No sockets, no clock: one loop pops the earliest of (next arrival, next engine step end, next
scheduler tick), feeds the scheduler exactly what a router would send (`enqueue`, `update`
dispatched / prefill_done / progress, `release` completed), calls `drain_cleanup` once per event
batch, and submits every `Admit` to its engine at that instant. Deterministic for a given seed, and
fast enough for the whole conversation trace in well under a minute: the engines advance per event,
not per token (see `engine.py`, macro steps). Policy comparisons (`SelectorConfig.type` = kv |
round_robin | random | least_loaded | power_of_two) use this driver.

Overlap modes (`overlap_mode`), the in-process equivalent of the daemon's KV-event path:
"events" = each engine's prefix-cache changes are applied directly to the scheduler's event-fed
device index (no sockets; every row fresh), plus the speculative entries at routing time;
"approx" = the approximate index learnt from routing decisions only; "none" = no overlap index
(every depth is 0).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..config import Config
from ..core.create import create_scheduler
from ..core.types import Admit, Reject, RequestSpec
from ..protocol import WorkerKey
from .classes import ClassAssignment
from .engine import DONE, FIRST_TOKEN, SeqRecord, SimEngine, SimRequest
from .fleet_spec import FleetSpec, build_config, make_engines
from .summary import ABORTED, COMPLETED, REJECTED, UNFINISHED, RequestResult
from .trace import Trace

INF = np.iinfo(np.int64).max
OWNER = 1  # the one in-process "connection" that owns every request
TICK_US = 50_000  # scheduler tick period while work is outstanding (virtual µs)
PROGRESS_EVERY_TOKENS = 32  # report decode progress to the scheduler in steps of at least this
IDLE_TICKS_BEFORE_GIVING_UP = 200  # ticks with queued requests, nothing running and no arrivals left


OVERLAP_MODES = ("events", "approx", "none")


class _NoIndex:
    """Stand-in for the approximate index in overlap mode "none": learns nothing, every depth 0."""

    def __init__(self, max_workers: int) -> None:
        self.max_workers = max_workers

    def insert(self, hashes, row: int, now_us: int, ttl_us) -> None:
        pass

    def remove(self, hashes, row: int) -> None:
        pass

    def clear_row(self, row: int) -> None:
        pass

    def depth(self, hashes, now_us: int, out: np.ndarray) -> None:
        out[:] = 0


class EngineEventSink:
    """An engine's `cache_listener` that applies its cache changes to an event-fed index row directly
    (the virtual driver's equivalent of publisher → SUB → `KvEventApplier`)."""

    __slots__ = ("applied", "index", "row")

    def __init__(self, index, row: int) -> None:
        self.index = index
        self.row = row
        self.applied = 0  # events applied

    def block_stored(self, hashes, parent=None, block_size: int = 16) -> None:
        self.index.insert(np.asarray(hashes, dtype=np.uint64), self.row, 0, None)
        self.applied += 1

    def block_removed(self, hashes) -> None:
        self.index.remove(np.asarray(hashes, dtype=np.uint64), self.row)
        self.applied += 1


def make_inprocess_scheduler(config: Config, overlap_mode: str = "approx"):
    """A `Scheduler` over private (process-memory) ledger arrays, with the config's workers added.

    Built by `create_scheduler`, as the daemon's is, minus shared memory and sockets. With
    `overlap_mode="events"` the scheduler gets an event-fed device index and every row is marked
    event-fed (attach the engines with `attach_engines`); "none" gives it an index that learns nothing.
    """
    if overlap_mode not in OVERLAP_MODES:
        raise ValueError(f"unknown overlap mode {overlap_mode!r} (expected one of {OVERLAP_MODES})")

    d = config.daemon
    overlap = _NoIndex(d.max_workers) if overlap_mode == "none" else None
    scheduler = create_scheduler(config, overlap=overlap, events=overlap_mode == "events")
    scheduler.set_max_waiting_share(1.0)  # one in-process owner stands for every router: no per-connection cap
    if scheduler.event_device is not None:
        for row in scheduler.ledger.live_rows().tolist():
            scheduler.set_event_fed(row, True)
    return scheduler


def attach_engines(scheduler, engines: dict[WorkerKey, SimEngine]) -> None:
    """Feed each engine's cache changes into the scheduler's event-fed device index (if it has one)."""
    device = getattr(scheduler, "event_device", None)
    if device is None:
        return
    for key, engine in engines.items():
        row = scheduler.ledger.row_of(key)
        if row is not None:
            engine.cache_listener = EngineEventSink(device, row)


@dataclass(slots=True)
class _Live:
    result: RequestResult
    slot: int
    generation: int
    admit_us: int
    reported: int = 0  # output tokens last reported as progress


@dataclass(slots=True)
class VirtualRun:
    """Outcome of `run_virtual`: per-request results, the scheduler (for ledger checks) and engines."""

    results: list[RequestResult]
    scheduler: object
    engines: dict[WorkerKey, SimEngine]
    wall_time_s: float
    events: int


class VirtualDriver:
    """Discrete-event loop over one trace (module docstring). Use `run_virtual()`."""

    def __init__(
        self,
        trace: Trace,
        spec: FleetSpec,
        config: Config,
        load_scale: float = 1.0,
        progress: Callable[[int], None] | None = None,
        scheduler=None,
        classes: ClassAssignment | None = None,
        overlap_mode: str = "approx",
    ) -> None:
        self.trace = trace
        self.spec = spec
        self.scheduler = scheduler if scheduler is not None else make_inprocess_scheduler(config, overlap_mode)
        self.engines = make_engines(spec)
        attach_engines(self.scheduler, self.engines)
        self.arrivals = trace.scaled_arrivals_us(load_scale)
        self.results = [
            RequestResult(
                index=i,
                request_id=f"r{i}",
                arrival_us=int(self.arrivals[i]),
                isl=int(trace.isl[i]),
                osl=int(trace.osl[i]),
                policy_class=classes.name_of(i) if classes is not None else "",
            )
            for i in range(len(trace))
        ]
        self.by_id = {r.request_id: r for r in self.results}
        self.live: dict[str, _Live] = {}
        self.waiting: set[str] = set()  # enqueued, not yet admitted or rejected
        self.finished = 0
        self.events = 0
        self._progress = progress

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        n = len(self.trace)
        i = 0
        now = 0
        next_tick = INF
        idle_ticks = 0
        while True:
            t_arr = int(self.arrivals[i]) if i < n else INF
            t_eng = min((t for t in (e.next_step_end() for e in self.engines.values()) if t is not None), default=INF)
            t = min(t_arr, t_eng)
            if self.waiting:  # ticks only matter while something waits (timeouts); skip them otherwise
                if next_tick <= now or next_tick == INF:
                    next_tick = now + TICK_US
                t = min(t, next_tick)
            if t == INF:
                break
            self.events += 1
            outs: list = []
            if t_eng == t:
                for key, engine in self.engines.items():
                    if engine.next_step_end() == t:
                        self._on_engine_events(key, engine, engine.step(), t)
            while i < n and self.arrivals[i] == t:
                outs.extend(self._enqueue(i, t))
                i += 1
            if self.waiting and next_tick == t:
                outs.extend(self.scheduler.tick(t))
                next_tick += TICK_US
                idle = i >= n and not self.live and self.waiting
                idle_ticks = idle_ticks + 1 if idle else 0
                if idle_ticks > IDLE_TICKS_BEFORE_GIVING_UP:
                    self._give_up(t)
            outs.extend(self.scheduler.drain_cleanup(t))
            self._apply(outs, t)
            now = t

    # ------------------------------------------------------------------ scheduler side

    def _enqueue(self, i: int, now_us: int) -> list:
        r = self.results[i]
        spec = RequestSpec(
            request_id=r.request_id,
            isl_tokens=r.isl,
            block_hashes=self.trace.hashes_of(i),
            policy_class=r.policy_class,
            owner=OWNER,
        )
        self.waiting.add(r.request_id)
        t0 = time.perf_counter_ns()
        outs = self.scheduler.enqueue(spec, now_us)
        r.admission_latency_us = (time.perf_counter_ns() - t0) / 1000.0 if outs else -1.0
        return outs

    def _apply(self, outs: list, now_us: int) -> None:
        while outs:
            more: list = []
            for o in outs:
                if isinstance(o, Admit):
                    more.extend(self._admit(o, now_us))
                elif isinstance(o, Reject):
                    self._reject(o)
            outs = more

    def _admit(self, a: Admit, now_us: int) -> list:
        r = self.by_id[a.request_id]
        self.waiting.discard(a.request_id)
        r.worker = str(a.worker)
        r.queued_us = r.queue_wait_us = int(a.queued_us)
        r.predicted_cached_tokens = int(a.cached_tokens)
        r.overlap_blocks = int(a.overlap_blocks)
        admitter = getattr(self.scheduler, "admitter", None)  # the explain ring of the composed Scheduler
        for rec in reversed(getattr(admitter, "explain", ())):  # this decision: (id, row, now, elig, depth, ...)
            if rec[0] == a.request_id:
                elig, depth = rec[3], rec[4]
                r.best_overlap_blocks = int(depth[elig != 0].max()) if elig.any() else 0
                break
        self.live[a.request_id] = _Live(r, a.slot, a.generation, now_us)
        engine = self.engines.get(WorkerKey(*a.worker))
        if engine is None:
            r.outcome, r.detail = ABORTED, f"no simulated engine for worker {a.worker}"
            del self.live[a.request_id]
            self.scheduler.release(a.request_id, a.slot, a.generation, "aborted", r.isl, now_us)
            self.finished += 1
            return []
        hashes = tuple(self.trace.hashes_of(r.index).tolist())
        engine.submit(SimRequest(a.request_id, r.isl, r.osl, hashes), now_us)
        return list(self.scheduler.update(a.request_id, a.slot, a.generation, "dispatched", None, now_us) or [])

    def _reject(self, rj: Reject) -> None:
        r = self.by_id[rj.request_id]
        self.waiting.discard(rj.request_id)
        if r.request_id in self.live:  # a requeue that was rejected
            del self.live[r.request_id]
        r.outcome, r.reason, r.detail = REJECTED, rj.reason, rj.detail
        self._done_one()

    def _give_up(self, now_us: int) -> None:
        for rid in sorted(self.waiting):
            self.scheduler.release(rid, -1, 0, "cancelled", 0, now_us)
            self.by_id[rid].outcome = UNFINISHED
            self.by_id[rid].detail = "still queued after the trace ended with an idle fleet"
        self.waiting.clear()

    def _done_one(self) -> None:
        self.finished += 1
        if self._progress is not None:
            self._progress(self.finished)

    # ------------------------------------------------------------------ engine side

    def _on_engine_events(
        self, key: WorkerKey, engine: SimEngine, events: list[tuple[int, SeqRecord]], now_us: int
    ) -> None:
        sched = self.scheduler
        for kind, rec in events:
            rid = rec.request.request_id
            lv = self.live[rid]
            r = lv.result
            if kind == FIRST_TOKEN:
                r.ttft_us = rec.first_token_us - r.arrival_us
                r.cached_tokens = rec.cached_tokens
                sched.update(rid, lv.slot, lv.generation, "prefill_done", None, now_us)
            elif kind == DONE:
                r.e2e_us = rec.done_us - r.arrival_us
                r.output_tokens = rec.output_tokens
                r.outcome = COMPLETED
                sched.release(rid, lv.slot, lv.generation, "completed", r.isl + rec.output_tokens, now_us)
                del self.live[rid]
                self._done_one()
        for rec in engine.running():
            running = self.live.get(rec.request.request_id)
            if running is not None and rec.output_tokens - running.reported >= PROGRESS_EVERY_TOKENS:
                running.reported = rec.output_tokens
                sched.update(
                    rec.request.request_id, running.slot, running.generation, "progress", rec.output_tokens, now_us
                )


def run_virtual(
    trace: Trace,
    spec: FleetSpec,
    *,
    selector: str = "kv",
    load_scale: float = 1.0,
    seed: int | None = 0,
    config: Config | None = None,
    progress: Callable[[int], None] | None = None,
    scheduler=None,
    classes: ClassAssignment | None = None,
    overlap_mode: str = "approx",
) -> VirtualRun:
    """Replay `trace` through an in-process scheduler and simulated engines in virtual time.

    Args:
        trace: requests (arrival order).
        spec: fleet shape; `config` (default: `build_config(spec, selector, seed)`) must declare the
            same workers.
        load_scale: arrivals compressed by this factor (> 1 = more load); engine speed unchanged.
        progress: called with the number of finished requests after each one finishes.
        scheduler: an object with the `Scheduler` methods the driver calls (default:
            `make_inprocess_scheduler(config, overlap_mode)`); tests pass stand-ins.
        overlap_mode: "events" | "approx" | "none" (module docstring).
        classes: each row's policy class (`classes.assign_classes`); None = every request sent
            without a class (the config's default class). The names must be classes of `config`.
    Returns:
        A `VirtualRun` with one `RequestResult` per trace request.
    """
    cfg = config if config is not None else build_config(spec, selector, seed)
    driver = VirtualDriver(trace, spec, cfg, load_scale, progress, scheduler, classes, overlap_mode)
    t0 = time.perf_counter()
    driver.run()
    return VirtualRun(driver.results, driver.scheduler, driver.engines, time.perf_counter() - t0, driver.events)
