"""The decision path's metric tally: counts and histogram samples of the actor's wakes, written to
Prometheus in bulk (`WakeTally.flush`): by the actor's tick every 100 ms (`tick.LIVENESS_EVERY_US`)
or when `FLUSH_SAMPLES` samples are pending, never once per frame; and the scheduler clock (`now_us`).
"""

from __future__ import annotations

import time

from .metrics import Metrics, observe_many


def now_us() -> int:
    """The scheduler clock: monotonic µs."""
    return time.monotonic_ns() // 1000


FLUSH_SAMPLES = 512  # pending histogram samples that make `WakeTally.flush_if_full` write at once


class WakeTally:
    """Decision-path counts since the last `flush`, written to `metrics` in bulk.

    The actor calls `flush_if_full()` after each wake (writes only when `FLUSH_SAMPLES` histogram
    samples are pending: bounded memory) and `flush()` every 100 ms from its tick, so Prometheus
    lags the actor by at most ~100 ms plus one tick; a prometheus_client `inc` / `observe` costs
    1-4 µs each and a flush ~25 µs however little it holds.

    Attributes:
        admissions: policy class -> Admitted frames sent; rejections: reason -> Rejected.
        updates: Update kind -> frames; queue_wait_s / admission_s / lease_s: histogram samples (s);
        undeliverable: admissions released because nobody could receive them.
        loop_lag_s: the tick's lag behind its schedule (s), one sample per tick.
        frames / batches / word_folds: data-socket frames, Batch messages, folds that changed something;
        cleanup_sizes: releases applied per cleanup pass (one sample per wake that had releases).
    """

    __slots__ = (
        "admission_s",
        "admissions",
        "batches",
        "cleanup_sizes",
        "frames",
        "lease_class",
        "lease_s",
        "loop_lag_s",
        "metrics",
        "queue_wait_s",
        "rejections",
        "samples",
        "undeliverable",
        "updates",
        "word_folds",
    )

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.admissions: dict[str, int] = {}
        self.rejections: dict[str, int] = {}
        self.updates: dict[str, int] = {}
        self.queue_wait_s: list[float] = []
        self.admission_s: list[float] = []
        self.lease_s: dict[str, list[float]] = {}
        self.undeliverable = 0
        self.frames = self.batches = self.word_folds = 0
        self.cleanup_sizes: list[int] = []
        self.samples = 0  # histogram samples appended by the actor since the last flush (an estimate)
        self.loop_lag_s: list[float] = []

    def flush_if_full(self) -> None:
        """`flush()` when `FLUSH_SAMPLES` samples are pending (checked once per wake)."""
        if self.samples >= FLUSH_SAMPLES:
            self.flush()

    def flush(self) -> None:
        """Add the pending counts to the Prometheus objects and start over."""
        m = self.metrics
        self.samples = 0
        for name, counter in (
            ("frames", m.frames),
            ("batches", m.batches),
            ("word_folds", m.word_folds),
            ("undeliverable", m.undeliverable),
        ):
            if n := getattr(self, name):
                counter.inc(n)
                setattr(self, name, 0)
        for samples, hist in (
            (self.cleanup_sizes, m.cleanup_batch),
            (self.queue_wait_s, m.queue_wait),
            (self.admission_s, m.admission_latency),
            (self.loop_lag_s, m.loop_lag),
        ):
            if samples:
                observe_many(hist, samples)
                samples.clear()
        for counts, child in ((self.admissions, m.admission_child), (self.updates, m.update_child)):
            for key, n in counts.items():
                child(key).inc(n)
            counts.clear()
        for reason, n in self.rejections.items():
            m.rejections.labels(reason=reason).inc(n)
        self.rejections.clear()
        for name, values in self.lease_s.items():
            observe_many(m.lease_child(name), values)
        self.lease_s.clear()
