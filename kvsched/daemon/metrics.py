"""All Prometheus objects of the daemon, on a registry of their own (no module globals).

The list with types and labels is in docs/DEPLOY.md ("Metrics"). Histograms are in seconds. Worker
series carry `worker_id` and `dp_rank` labels. The decision path's counters and histograms are
written once per wake from a tally (`daemon/translate.py` `WakeTally`, `observe_many`); the actor calls
`refresh(scheduler, now_us)` once a second for the gauges; `kvsched_decisions_total` and
`kvsched_active_leases` are read at scrape time from the scheduler's own counters (single int reads),
so they equal what `kvsched status` shows. The HTTP side lives in `kvsched.daemon.health`.
"""

from __future__ import annotations

import platform
from bisect import bisect_left
from collections.abc import Sequence

import numpy as np
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .. import __version__
from ..protocol import PROTOCOL_MAX
from ..shm.layout import FLAG_DRAINED, FLAG_OVERLOADED, FLAG_STALE

_LATENCY_BUCKETS = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
)
_WAIT_BUCKETS = (1e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_LEASE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)
_WORKER = ["worker_id", "dp_rank"]


class _SchedulerCounters:
    """Scrape-time collector: `kvsched_decisions_total` (every Admit and Reject the scheduler produced,
    the figure `kvsched status` calls decisions) and `kvsched_active_leases`."""

    def __init__(self) -> None:
        self.scheduler = None

    def describe(self):
        return [
            CounterMetricFamily("kvsched_decisions", "Scheduling decisions (admissions and rejections)"),
            GaugeMetricFamily("kvsched_active_leases", "Leases held (admitted, not yet released)"),
        ]

    def collect(self):
        s = self.scheduler
        yield CounterMetricFamily(
            "kvsched_decisions",
            "Scheduling decisions (admissions and rejections)",
            value=s.decisions_total if s is not None else 0,
        )
        yield GaugeMetricFamily(
            "kvsched_active_leases",
            "Leases held (admitted, not yet released)",
            value=s.active_leases if s is not None else 0,
        )


class Metrics:
    """The daemon's metrics. Attribute names follow the exported names without the prefix.

    Args:
        registry: where to register (a fresh `CollectorRegistry` by default).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        PlatformCollector(registry=r)

        Info("kvsched_build", "kvsched version, protocol and Python", registry=r).info(
            {"version": __version__, "protocol_max": str(PROTOCOL_MAX), "python": platform.python_version()}
        )
        self._counters = _SchedulerCounters()
        r.register(self._counters)
        self.admissions = Counter(
            "kvsched_admissions", "Admitted frames delivered, per class", ["policy_class"], registry=r
        )
        self.rejections = Counter("kvsched_rejections", "Rejections by reason", ["reason"], registry=r)
        self.frames = Counter("kvsched_frames_received", "Frames received on the data socket", registry=r)
        self.update_frames = Counter(
            "kvsched_update_frames",
            "Update frames applied to a live lease, by kind (local routers store dispatched, "
            "prefill_done and output tokens in shared memory instead)",
            ["kind"],
            registry=r,
        )
        self.batches = Counter(
            "kvsched_batches_received",
            "Batch messages received (protocol version 2); their frames count in kvsched_frames_received",
            registry=r,
        )
        self.word_folds = Counter(
            "kvsched_word_folds",
            "Folds of the routers' shared-memory words that changed something",
            registry=r,
        )
        self.malformed = Counter(
            "kvsched_frames_malformed",
            "Frames answered with Error, by lower-case error code (malformed, not_hello, ...)",
            ["code"],
            registry=r,
        )
        self.queue_depth = Gauge("kvsched_queue_depth", "Requests waiting per class", ["policy_class"], registry=r)
        self.queue_oldest = Gauge(
            "kvsched_queue_oldest_age_seconds",
            "Age of the oldest waiting request per class",
            ["policy_class"],
            registry=r,
        )
        self.lease_oldest = Gauge(
            "kvsched_lease_oldest_age_seconds",
            "Age of the oldest active lease per class (0 = none)",
            ["policy_class"],
            registry=r,
        )
        self.lease_duration = Histogram(
            "kvsched_lease_duration_seconds",
            "Admission to Release of leases released by their router, per class",
            ["policy_class"],
            buckets=_LEASE_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "kvsched_queue_wait_seconds",
            "Time admitted requests waited in the daemon",
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.admission_latency = Histogram(
            "kvsched_admission_latency_seconds",
            "Enqueue received to Admitted sent, immediate path",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.worker_total_blocks = Gauge(
            "kvsched_worker_total_kv_blocks", "KV-cache capacity (blocks)", _WORKER, registry=r
        )
        self.worker_blocks = Gauge("kvsched_worker_active_blocks", "Active KV blocks", _WORKER, registry=r)
        self.worker_prefill = Gauge(
            "kvsched_worker_active_prefill_tokens", "Active prefill tokens", _WORKER, registry=r
        )
        self.worker_requests = Gauge(
            "kvsched_worker_active_requests", "Leases running on the worker", _WORKER, registry=r
        )
        self.worker_drained = Gauge("kvsched_worker_drained", "1 while the worker is drained", _WORKER, registry=r)
        self.worker_overloaded = Gauge(
            "kvsched_worker_overloaded", "1 while the worker is overloaded", _WORKER, registry=r
        )
        self.worker_stale = Gauge(
            "kvsched_worker_stale", "1 while the worker's KV-event stream is stale", _WORKER, registry=r
        )
        self.workers = Gauge("kvsched_workers", "Registered workers (ranks)", registry=r)
        self.loop_lag = Histogram(
            "kvsched_actor_loop_lag_seconds",
            "Lateness of the actor's periodic timer",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.cleanup_batch = Histogram(
            "kvsched_cleanup_batch_size",
            "Releases applied per cleanup pass",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=r,
        )
        self.connections = Gauge("kvsched_connections", "Live router connections", registry=r)
        self.dead_connections = Counter(
            "kvsched_dead_connections", "Router connections declared dead (timeout or pid gone)", registry=r
        )
        self.unknown_token_heartbeats = Counter(
            "kvsched_unknown_token_heartbeats",
            "Heartbeats naming a conn_token no open connection has (ignored)",
            registry=r,
        )
        self.undeliverable = Counter(
            "kvsched_undeliverable_admissions",
            "Admitted frames that could not be delivered (released)",
            registry=r,
        )
        self.kv_events_applied = Counter("kvsched_kv_events_applied", "KV events applied", registry=r)
        self.kv_events_replayed = Counter("kvsched_kv_events_replayed", "KV events applied from replay", registry=r)
        self.kv_hash_mismatches = Counter(
            "kvsched_kv_hash_mismatches",
            "First-of-chain BlockStored events whose hashes differ from the routers'",
            registry=r,
        )
        self.stale_workers = Gauge("kvsched_stale_workers", "Workers whose KV event stream is stale", registry=r)
        self.kv_events_skipped = Counter(
            "kvsched_kv_events_skipped",
            "KV events or payloads the daemon could not read, by reason (docs/KV_EVENTS.md)",
            ["reason"],
            registry=r,
        )
        self.kv_event_streams = Counter(
            "kvsched_kv_event_streams",
            "KV event stream incidents by kind: seq gaps, restarts (a seq at or "
            "below the last: the worker's index is cleared), batches a replay could not supply",
            ["kind"],
            registry=r,
        )
        self._worker_gauges = (
            self.worker_total_blocks,
            self.worker_blocks,
            self.worker_prefill,
            self.worker_requests,
            self.worker_drained,
            self.worker_overloaded,
            self.worker_stale,
        )
        self._worker_labels: set[tuple[str, str]] = set()
        self._class_names: list[str] = []
        self._children: dict[tuple[str, str], object] = {}  # (family, label value) -> child

    def bind(self, scheduler) -> None:
        """Read `kvsched_decisions_total` and `kvsched_active_leases` from this `Scheduler` at scrape time."""
        self._counters.scheduler = scheduler
        self._class_names = [cq.name for cq in scheduler.pq.classes]

    def refresh(self, scheduler, now_us: int) -> None:
        """Set the queue, lease and worker gauges from the scheduler (actor loop, about once a second).

        Workers that disappeared since the last call lose their series. Cost: O(classes + workers +
        max_slots) numpy work.
        """
        for row in scheduler.queues(now_us):
            self.queue_depth.labels(policy_class=row.name).set(row.depth)
            self.queue_oldest.labels(policy_class=row.name).set(row.oldest_wait_s)
        self._class_names = [cq.name for cq in scheduler.pq.classes]
        a = scheduler.ledger.arrays
        live = a.s_state != 0
        classes, admit_us = a.s_class[live], a.s_admit_us[live]
        for idx, name in enumerate(self._class_names):
            mine = admit_us[classes == idx]
            self.lease_oldest.labels(policy_class=name).set(
                max(0, now_us - int(mine.min())) / 1e6 if mine.size else 0.0
            )
        seen = set()
        rows = np.flatnonzero(a.w_present).tolist()
        for r in rows:
            labels = (str(int(a.w_worker_id[r])), str(int(a.w_dp_rank[r])))
            seen.add(labels)
            flags = int(a.w_flags[r])
            values = (
                a.w_total_kv_blocks[r],
                a.w_active_blocks[r],
                a.w_active_prefill[r],
                a.w_active_requests[r],
                bool(flags & FLAG_DRAINED),
                bool(flags & FLAG_OVERLOADED),
                bool(flags & FLAG_STALE),
            )
            for gauge, value in zip(self._worker_gauges, values, strict=True):
                gauge.labels(*labels).set(int(value))
        for labels in self._worker_labels - seen:
            for gauge in self._worker_gauges:
                gauge.remove(*labels)
        self._worker_labels = seen
        self.workers.set(len(rows))

    def admission_child(self, policy_class: str):
        """`kvsched_admissions{policy_class}` (children cached: prometheus_client's labels() is slow)."""
        return self._child(self.admissions, "admission", policy_class, policy_class=policy_class)

    def update_child(self, kind: str):
        """`kvsched_update_frames{kind}`."""
        return self._child(self.update_frames, "update", kind, kind=kind)

    def lease_child(self, policy_class: str):
        """`kvsched_lease_duration_seconds{policy_class}`."""
        return self._child(self.lease_duration, "lease", policy_class, policy_class=policy_class)

    def _child(self, metric, family: str, key: str, **labels):
        child = self._children.get((family, key))
        if child is None:
            child = self._children[(family, key)] = metric.labels(**labels)
        return child


def observe_many(hist: Histogram, values: Sequence[float]) -> None:
    """Observe every value of `values` (s) in the histogram `hist` with one lock round per bucket
    touched instead of one per value (a wake's samples at once). Falls back to `observe` per value
    when the histogram does not expose prometheus_client's bucket counters."""
    bounds = getattr(hist, "_upper_bounds", None)
    buckets = getattr(hist, "_buckets", None)
    total = getattr(hist, "_sum", None)
    if bounds is None or buckets is None or total is None or len(values) < 2:
        for v in values:
            hist.observe(v)
        return
    counts: dict[int, int] = {}
    for v in values:
        i = bisect_left(bounds, v)
        counts[i] = counts.get(i, 0) + 1
    total.inc(sum(values))
    for i, n in counts.items():
        buckets[i].inc(n)
