"""All Prometheus objects of the daemon (SPEC §7), on a registry of their own (no module globals).

Histograms are in seconds. `serve(port, host)` starts prometheus_client's HTTP server thread; the
actor only increments/sets values (cheap, lock-protected in prometheus_client).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client import GCCollector, PlatformCollector, ProcessCollector

_LATENCY_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.05, 0.1, 0.25, 0.5, 1.0,
)
_WAIT_BUCKETS = (1e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """The daemon's metrics. Attribute names follow the exported names without the prefix."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        PlatformCollector(registry=r)
        self.decisions = Counter("kvsched_decisions", "Admissions decided", ["policy_class"], registry=r)
        self.rejections = Counter("kvsched_rejections", "Rejections by reason", ["reason"], registry=r)
        self.frames = Counter("kvsched_frames_received", "Frames received on the data socket", registry=r)
        self.malformed = Counter(
            "kvsched_frames_malformed", "Frames answered with Error (malformed, out of order, ...)",
            ["code"], registry=r,
        )
        self.queue_depth = Gauge("kvsched_queue_depth", "Requests waiting per class", ["policy_class"], registry=r)
        self.queue_oldest = Gauge(
            "kvsched_queue_oldest_age_seconds", "Age of the oldest waiting request per class",
            ["policy_class"], registry=r,
        )
        self.queue_wait = Histogram(
            "kvsched_queue_wait_seconds", "Time admitted requests waited in the daemon",
            buckets=_WAIT_BUCKETS, registry=r,
        )
        self.admission_latency = Histogram(
            "kvsched_admission_latency_seconds", "Enqueue received to Admitted sent, immediate path",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.worker_blocks = Gauge("kvsched_worker_active_blocks", "Active KV blocks", ["worker"], registry=r)
        self.worker_prefill = Gauge(
            "kvsched_worker_active_prefill_tokens", "Active prefill tokens", ["worker"], registry=r
        )
        self.loop_lag = Histogram(
            "kvsched_actor_loop_lag_seconds", "Lateness of the actor's periodic timer",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.cleanup_batch = Histogram(
            "kvsched_cleanup_batch_size", "Releases applied per cleanup pass",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), registry=r,
        )
        self.connections = Gauge("kvsched_connections", "Live router connections", registry=r)
        self.dead_connections = Counter(
            "kvsched_dead_connections", "Router connections declared dead (timeout or pid gone)", registry=r
        )
        self.undeliverable = Counter(
            "kvsched_undeliverable_admissions", "Admitted frames that could not be delivered (released)",
            registry=r,
        )
        self.kv_events_applied = Counter("kvsched_kv_events_applied", "KV events applied", registry=r)
        self.kv_events_replayed = Counter("kvsched_kv_events_replayed", "KV events applied from replay", registry=r)
        self.stale_workers = Gauge("kvsched_stale_workers", "Workers whose KV event stream is stale", registry=r)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Expose /metrics over HTTP on (host, port) from a prometheus_client thread."""
        start_http_server(port, addr=host, registry=self.registry)
