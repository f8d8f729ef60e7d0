"""Frame <-> core translation and the per-wake metric tally, without sockets."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Histogram

from kvsched import protocol as p
from kvsched.config import DaemonConfig
from kvsched.daemon.metrics import Metrics, observe_many
from kvsched.daemon.tally import WakeTally
from kvsched.daemon.translate import enqueue_problem, spec_from_enqueue
from tests.core.factories import make_request
from tests.daemon.test_wake import Harness


def test_observe_many_equals_one_observe_per_value():
    values = [0.0, 1e-5, 2e-5, 0.003, 0.003, 0.7, 5.0, 1e9]
    one, many = (
        Histogram(f"h{i}", "x", registry=CollectorRegistry(), buckets=(1e-5, 1e-3, 0.5, 2.0)) for i in range(2)
    )
    for v in values:
        one.observe(v)
    observe_many(many, values)

    def samples(h: Histogram) -> list:
        return [
            (s.name.split("_", 1)[1], s.labels.get("le"), s.value)
            for m in h.collect()
            for s in m.samples
            if not s.name.endswith("_created")
        ]

    assert samples(one) == samples(many)


def test_spec_from_enqueue_reads_the_hashes_without_copying():
    raw = np.arange(1, 4, dtype="<u8").tobytes()
    f = p.Enqueue("r", 48, raw, pinned=(3, 1), allowed_workers=[3, 4], deadline_ms=5, excluded_workers=[4])
    spec = spec_from_enqueue(f, owner=7, t=1_000)
    assert spec.block_hashes.tolist() == [1, 2, 3] and not spec.block_hashes.flags.writeable
    assert (spec.pinned, spec.allowed_workers, spec.excluded_workers) == ((3, 1), frozenset({3, 4}), frozenset({4}))
    assert (spec.owner, spec.deadline_us) == (7, 6_000)


def _metric(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def test_the_actor_answers_and_counts_once_per_wake():
    """Enqueues, Updates and Releases through one actor wake each: every Admitted names the worker's
    URL, each lifecycle is counted once, and only when the tally is flushed (was a test of the
    `Translator` object, whose frame handling moved into the actor)."""
    h = Harness("tr-counts", worker_urls={1: "http://w1"})
    try:
        metrics, tally = h.actor.metrics, h.actor.tally
        h.send(*[p.Enqueue(f"r{i}", 16) for i in range(3)])
        h.actor.data_reader.wake()
        admitted = h.replies()
        assert [f.request_id for f in admitted] == ["r0", "r1", "r2"] and admitted[0].url == "http://w1"
        assert next(iter(h.actor.conns)).inflight == 0
        frames = []
        for f in admitted:
            frames += [
                p.Update(f.request_id, f.slot, f.generation, "dispatched"),
                p.Release(f.request_id, f.slot, f.generation),
            ]
        h.send(*frames)
        h.actor.data_reader.wake()
        assert _metric(metrics, "kvsched_admissions_total", policy_class="default") == 0  # not yet flushed
        tally.flush()
        assert _metric(metrics, "kvsched_admissions_total", policy_class="default") == 3
        assert _metric(metrics, "kvsched_update_frames_total", kind="dispatched") == 3
        assert _metric(metrics, "kvsched_lease_duration_seconds_count", policy_class="default") == 3
        assert _metric(metrics, "kvsched_queue_wait_seconds_count") == 3
        assert _metric(metrics, "kvsched_cleanup_batch_size_sum") == 3  # the wake's 3 releases, one pass
        assert h.sched.active_leases == 0 and h.actor.releases_this_wake == 0
    finally:
        h.close()


async def test_an_update_for_an_unknown_lease_is_an_error_and_not_counted_as_applied():
    """Was: `kvsched_update_frames_total{kind="dispatched"}` rose for an update of a lease that does
    not exist (answered UNKNOWN_REQUEST)."""
    h = Harness("tr-unknown")
    try:
        h.send(p.Update("nobody", 5, 1, "dispatched"))
        h.actor.data_reader.wake()
        h.actor.tally.flush()
        [err] = h.replies()
        assert (type(err), err.code, err.request_id) == (p.Error, p.ErrorCode.UNKNOWN_REQUEST, "nobody")
        assert _metric(h.actor.metrics, "kvsched_update_frames_total", kind="dispatched") == 0
    finally:
        h.close()


async def test_the_actor_releases_an_admission_nobody_can_receive():
    h = Harness("tr-lost")
    try:
        other = h.actor.conns.open(b"gone", 0)
        [adm] = h.sched.enqueue(make_request("x", owner=other.owner, isl_tokens=16), 1)
        h.actor.conns.close(other)
        h.actor.deliver([adm], 2)
        assert h.sched.active_leases == 0
        h.actor.tally.flush()
        assert _metric(h.actor.metrics, "kvsched_undeliverable_admissions_total") == 1
        h.send(p.Release("x", adm.slot, adm.generation))  # stale, and not this connection's: a no-op
        h.actor.data_reader.wake()
        assert h.replies() == [] and h.sched.active_leases == 0
    finally:
        h.close()


def test_enqueue_problems_are_answered_before_the_scheduler():
    ok = p.Enqueue("r", 16)
    assert enqueue_problem(ok, True, 0, 4) is None
    assert enqueue_problem(ok, False, 0, 4)[0] == "shutting_down"
    assert enqueue_problem(ok, True, 4, 4)[0] == "overloaded"
    assert enqueue_problem(p.Enqueue("é" * p.MAX_REQUEST_ID_BYTES, 16), True, 0, 4)[0] == "invalid"
    assert enqueue_problem(p.Enqueue("r", 16, b"1234567"), True, 0, 4)[0] == "invalid"


def test_tally_writes_socket_counts_in_bulk_and_only_when_full_between_ticks():
    from kvsched.daemon.tally import FLUSH_SAMPLES

    metrics = Metrics()
    tally = WakeTally(metrics)
    tally.frames += 5
    tally.batches += 2
    tally.word_folds += 1
    tally.cleanup_sizes += [3, 1]
    tally.samples = FLUSH_SAMPLES - 1
    tally.flush_if_full()  # below the bound: nothing written yet (the tick writes it)
    assert _metric(metrics, "kvsched_frames_received_total") == 0
    tally.samples += 1
    tally.flush_if_full()
    assert _metric(metrics, "kvsched_frames_received_total") == 5
    assert _metric(metrics, "kvsched_batches_received_total") == 2
    assert _metric(metrics, "kvsched_word_folds_total") == 1
    assert _metric(metrics, "kvsched_cleanup_batch_size_count") == 2
    assert _metric(metrics, "kvsched_cleanup_batch_size_sum") == 4
    tally.flush()  # nothing pending: nothing added twice
    assert _metric(metrics, "kvsched_frames_received_total") == 5 and tally.samples == 0


def test_tick_writes_the_tally_every_100_ms_with_the_loop_lag_samples():
    """The periodic tick (every 10 ms) writes the tally only every `LIVENESS_EVERY_US`: a write costs
    ~25 µs however little it holds. The loop-lag sample of every tick goes through the tally."""
    from types import SimpleNamespace

    from kvsched.daemon import tick
    from kvsched.daemon.connections import ConnectionTable
    from kvsched.daemon.ratelimit import RateLimitedLog
    from tests.core.factories import make_scheduler

    metrics, conns = Metrics(), ConnectionTable(10**9)
    tally, sched = WakeTally(metrics), make_scheduler(owner_alive=conns.owner_alive)
    cfg = DaemonConfig()
    actor = SimpleNamespace(
        cfg=cfg,
        metrics=metrics,
        tally=tally,
        conns=conns,
        scheduler=sched,
        warn=RateLimitedLog(__import__("logging").getLogger("t")),
        fold_words=lambda: False,
        deliver=lambda outcomes, t: None,
    )
    ticker = tick.Ticker(actor)
    ticker.on_second.append(lambda: None)

    def lag() -> float:
        return _metric(metrics, "kvsched_actor_loop_lag_seconds_count")

    t = 1_000_000
    for k in range(10):  # ten ticks 10 ms apart: the first writes, the next nine within 100 ms do not
        now = t + k * 10_000
        tally.frames += 1
        ticker.observe_lag(now)
        ticker.periodic_work(now)
        assert _metric(metrics, "kvsched_frames_received_total") == 1 and lag() == 1, k
    now = t + tick.LIVENESS_EVERY_US
    ticker.observe_lag(now)
    ticker.periodic_work(now)
    assert _metric(metrics, "kvsched_frames_received_total") == 10 and lag() == 11
