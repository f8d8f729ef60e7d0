"""Virtual-time driver: every request completes or is rejected with a reason; ledger back to zero."""

from __future__ import annotations

import importlib.util
from importlib.resources import files
from pathlib import Path

import msgspec
import pytest

from kvsched.core.types import Admit, Reject, WorkerKey
from kvsched.sim.classes import assign_classes, parse_class_rule
from kvsched.sim.fleet_spec import FleetSpec
from kvsched.sim.replay import ReplayOptions, ledger_is_zero_inprocess, run_replay
from kvsched.sim.summary import COMPLETED, REJECTED, Summary, read_results, summarize
from kvsched.sim.trace import load_trace
from kvsched.sim.virtual import run_virtual

SLICE = str(files("kvsched") / "data" / "mooncake_slice.jsonl")
HAVE_SCHEDULER = importlib.util.find_spec("kvsched.core.scheduler") is not None


class CappedRoundRobin:
    """Stand-in scheduler: round robin, at most `cap` running per worker, FIFO queue, a bounded
    queue that rejects `queue_full` past `max_queue`. Checks the driver's call protocol."""

    def __init__(self, workers: int, cap: int = 2, max_queue: int = 10_000) -> None:
        self.keys = [WorkerKey(w, 0) for w in range(workers)]
        self.cap, self.max_queue = cap, max_queue
        self.running: dict[str, tuple[WorkerKey, int]] = {}
        self.load = {k: 0 for k in self.keys}
        self.queue: list[tuple[str, int]] = []
        self.calls: dict[str, list[str]] = {}
        self.slot = 0
        self.rr = 0

    def enqueue(self, spec, now_us):
        self.calls[spec.request_id] = ["enqueue"]
        if len(self.queue) >= self.max_queue:
            return [Reject(spec.request_id, 1, "queue_full", "test cap")]
        self.queue.append((spec.request_id, now_us))
        return []

    def update(self, request_id, slot, generation, kind, output_tokens, now_us):
        assert self.running[request_id][1] == slot
        self.calls[request_id].append(kind)
        return []

    def release(self, request_id, slot, generation, outcome, context_tokens, now_us):
        key, s = self.running.pop(request_id)
        assert s == slot and outcome == "completed"
        self.load[key] -= 1
        self.calls[request_id].append("release")

    def tick(self, now_us):
        return []

    def drain_cleanup(self, now_us):
        out = []
        while self.queue:
            free = [k for k in self.keys if self.load[k] < self.cap]
            if not free:
                break
            rid, t = self.queue.pop(0)
            key = free[self.rr % len(free)]
            self.rr += 1
            self.slot += 1
            self.load[key] += 1
            self.running[rid] = (key, self.slot)
            out.append(Admit(rid, 1, key, self.slot, 1, 0, 0, now_us - t))
        return out


def test_driver_follows_lease_protocol_when_scheduler_queues():
    trace = load_trace(SLICE, limit=200)
    spec = FleetSpec(workers=3)
    fake = CappedRoundRobin(3, cap=2, max_queue=40)
    run = run_virtual(trace, spec, scheduler=fake)
    outcomes = {r.outcome for r in run.results}
    assert outcomes <= {COMPLETED, REJECTED}
    assert any(r.outcome == REJECTED and r.reason == "queue_full" for r in run.results)
    waited = [r.queue_wait_us for r in run.results if r.outcome == COMPLETED]
    assert max(waited) > 0  # the cap made requests queue
    for r in run.results:
        calls = fake.calls[r.request_id]
        if r.outcome == COMPLETED:
            assert calls[:3] == ["enqueue", "dispatched", "prefill_done"] and calls[-1] == "release"
            assert 0 < r.ttft_us <= r.e2e_us and r.output_tokens == r.osl
        else:
            assert calls == ["enqueue"]
    assert not fake.running and all(v == 0 for v in fake.load.values())
    for e in run.engines.values():
        assert e.num_live == 0


def test_hit_ratio_never_exceeds_infinite_cache_bound():
    trace = load_trace(SLICE, limit=300)
    run = run_virtual(trace, FleetSpec(workers=2), scheduler=CappedRoundRobin(2, cap=8))
    s = summarize(
        run.results,
        mode="virtual",
        trace="slice",
        workers=2,
        routers=0,
        selector="fake",
        speedup=1,
        load_scale=1,
        wall_time_s=run.wall_time_s,
        infinite_cache_hit_tokens=trace.infinite_cache_hit_tokens(),
    )
    assert s.completed == 300
    assert 0 < s.prefix_hit_ratio <= s.infinite_cache_hit_ratio


@pytest.mark.skipif(not HAVE_SCHEDULER, reason="kvsched.core.scheduler is not available")
@pytest.mark.parametrize("selector", ["kv", "round_robin"])
def test_every_request_completes_or_is_rejected_when_replayed_in_virtual_time(selector):
    trace = load_trace(SLICE, limit=300)
    run = run_virtual(trace, FleetSpec(workers=4), selector=selector, load_scale=2.0)
    for r in run.results:
        assert r.outcome == COMPLETED or (r.outcome == REJECTED and r.reason), r
    assert sum(r.outcome == COMPLETED for r in run.results) > 0
    assert ledger_is_zero_inprocess(run.scheduler) is True
    s = summarize(
        run.results,
        mode="virtual",
        trace="slice",
        workers=4,
        routers=0,
        selector=selector,
        speedup=1,
        load_scale=2,
        wall_time_s=run.wall_time_s,
        infinite_cache_hit_tokens=trace.infinite_cache_hit_tokens(),
    )
    assert s.prefix_hit_ratio <= s.infinite_cache_hit_ratio
    assert sum(s.requests_per_worker.values()) == s.completed


PROFILE = Path(__file__).resolve().parents[2] / "examples" / "profile-multiclass.toml"


class RecordingScheduler(CappedRoundRobin):
    """CappedRoundRobin that remembers the policy class of each Enqueue."""

    def __init__(self, workers: int, **kw) -> None:
        super().__init__(workers, **kw)
        self.classes: dict[str, str] = {}

    def enqueue(self, spec, now_us):
        self.classes[spec.request_id] = spec.policy_class
        return super().enqueue(spec, now_us)


def test_driver_sends_each_rows_class_when_given_an_assignment():
    trace = load_trace(SLICE, limit=100)
    classes = assign_classes(parse_class_rule("hash:latency=60,agents=30,batch=10"), trace.isl, "latency")
    fake = RecordingScheduler(2, cap=4)
    run = run_virtual(trace, FleetSpec(workers=2), scheduler=fake, classes=classes)
    for r in run.results:
        assert fake.classes[r.request_id] == r.policy_class == classes.name_of(r.index)


@pytest.mark.skipif(not HAVE_SCHEDULER, reason="kvsched.core.scheduler is not available")
def test_per_class_figures_sum_to_the_total_when_replayed_with_the_example_profile(tmp_path):
    opts = ReplayOptions(
        trace=Path(SLICE),
        limit=400,
        virtual=True,
        load_scale=3.0,
        out=tmp_path,
        profile=PROFILE,
        class_rule="hash:latency=60,agents=30,batch=10",
    )
    s = run_replay(opts)
    assert list(s.classes) == ["latency", "agents", "batch"] and s.class_rule == opts.class_rule
    per = s.classes.values()
    assert sum(c.requests for c in per) == s.requests == 400
    assert sum(c.completed for c in per) == s.completed
    assert sum(sum(c.rejected.values()) for c in per) == sum(s.rejected.values())
    assert all(c.requests > 0 for c in per)
    admitted = sum(c.admitted for c in per)
    assert admitted > 0
    assert sum(c.dispatch_share for c in per) == pytest.approx(1.0, abs=1e-3)
    assert sum(c.uncached_token_share for c in per) == pytest.approx(1.0, abs=1e-3)
    for c in per:
        assert c.dispatch_share == pytest.approx(c.admitted / admitted, abs=1e-4)
    written = msgspec.json.decode((tmp_path / "summary.json").read_bytes(), type=Summary)
    assert written.classes == s.classes
    rows = read_results(tmp_path / "results.jsonl")
    assert {r.policy_class for r in rows} == {"latency", "agents", "batch"}


@pytest.mark.skipif(not HAVE_SCHEDULER, reason="kvsched.core.scheduler is not available")
def test_best_overlap_is_the_deepest_eligible_overlap_at_the_decision():
    """The routing bench's "overlap given up" reads `best_overlap_blocks` from the scheduler's explain
    ring (it read a ring that no longer existed after the core was split into parts and was 0 for
    every request); round robin on a multi-turn slice gives up overlap somewhere."""
    trace = load_trace(SLICE, limit=300)
    run = run_virtual(trace, FleetSpec(workers=4), selector="round_robin", seed=0, overlap_mode="events")
    done = [r for r in run.results if r.worker]
    assert all(r.best_overlap_blocks >= r.overlap_blocks for r in done)
    assert any(r.best_overlap_blocks > r.overlap_blocks for r in done)
