"""The metrics operators need (docs/DEPLOY.md "Metrics"), scraped from a real daemon process driven
over its data and admin sockets: per-worker capacity / load / flags with `worker_id` and `dp_rank`
labels, active leases, the oldest lease per class, lease durations, `kvsched_decisions_total` equal
to what `kvsched status` reports, lower-case `code` labels, build info; and `promtool check metrics`
accepts the page."""

from __future__ import annotations

import subprocess
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvsched import protocol as p
from kvsched.client import AdminClient
from tests.conftest import RawPeer, free_port, purge, start_daemon, unique_instance, wait_until
from tests.ops.tools import require_tool

CONFIG = """
[daemon]
block_size = 16
metrics_port = {port}

[[workers]]
worker_id = 1
total_kv_blocks = 500
max_num_batched_tokens = 4000

[[workers]]
worker_id = 2
dp_size = 2
total_kv_blocks = 700
max_num_batched_tokens = 4000

[[classes]]
name = "default"
prefill_busy_threshold = 4000
"""


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text: str, name: str, **labels) -> float | None:
    return samples(text).get((name, frozenset({k: str(v) for k, v in labels.items()}.items())))


def test_worker_lease_decision_and_error_metrics(tmp_path):
    port = free_port()
    instance = unique_instance()
    d = start_daemon(tmp_path, CONFIG.format(port=port), instance=instance)
    peer = RawPeer(d.endpoint)
    admin = AdminClient(d.admin_endpoint)
    try:
        peer.hello()
        peer.send(p.Enqueue("held", 64, pinned=(2, 1)))
        held = peer.recv()
        assert isinstance(held, p.Admitted) and (held.worker_id, held.dp_rank) == (2, 1)
        peer.send(p.Enqueue("short", 32, pinned=(1, 0)))
        short = peer.recv()
        assert isinstance(short, p.Admitted)
        peer.send(p.Enqueue("nowhere", 32, pinned=(9, 0)))
        assert isinstance(peer.recv(), p.Rejected)
        peer.send(b"\x93not a frame")
        err = peer.recv()
        assert isinstance(err, p.Error) and err.code == int(p.ErrorCode.MALFORMED)
        time.sleep(0.3)  # the short lease lives 0.3 s
        peer.send(p.Release("short", short.slot, short.generation, "completed", 40))
        assert isinstance(admin.call(p.Drain(worker_id=1)), p.OkReply)

        def settled() -> bool:
            # The active-lease count is read live and the gauges are refreshed once a second, but
            # the decision-path counters (the lease-duration histogram among them) are written every
            # ~100 ms of the daemon's loop: both can show the release before its duration is counted.
            text = scrape(port)
            return (
                value(text, "kvsched_worker_drained", worker_id=1, dp_rank=0) == 1
                and value(text, "kvsched_active_leases") == 1
                and (value(text, "kvsched_lease_oldest_age_seconds", policy_class="default") or 0) > 0
                and (value(text, "kvsched_lease_duration_seconds_count", policy_class="default") or 0) >= 1
            )

        assert wait_until(settled, 30, 0.2)
        text = scrape(port)
        assert value(text, "kvsched_worker_total_kv_blocks", worker_id=1, dp_rank=0) == 500
        assert value(text, "kvsched_worker_total_kv_blocks", worker_id=2, dp_rank=1) == 700
        assert value(text, "kvsched_worker_active_requests", worker_id=2, dp_rank=1) == 1
        assert value(text, "kvsched_worker_active_requests", worker_id=2, dp_rank=0) == 0
        assert value(text, "kvsched_worker_active_blocks", worker_id=2, dp_rank=1) >= 1
        assert value(text, "kvsched_worker_drained", worker_id=2, dp_rank=0) == 0
        assert value(text, "kvsched_worker_overloaded", worker_id=2, dp_rank=0) == 0
        assert value(text, "kvsched_worker_stale", worker_id=2, dp_rank=0) == 0
        assert value(text, "kvsched_workers") == 3
        assert value(text, "kvsched_frames_malformed_total", code="malformed") == 1
        assert value(text, "kvsched_rejections_total", reason="no_endpoints") == 1
        status = admin.call(p.Status())
        assert status.decisions_total == 3
        assert value(text, "kvsched_decisions_total") == status.decisions_total
        assert value(text, "kvsched_admissions_total", policy_class="default") == 2
        assert value(text, "kvsched_lease_duration_seconds_count", policy_class="default") == 1
        assert value(text, "kvsched_lease_duration_seconds_bucket", policy_class="default", le="0.1") == 0
        assert value(text, "kvsched_lease_duration_seconds_bucket", policy_class="default", le="60.0") == 1
        build = [k for k in samples(text) if k[0] == "kvsched_build_info"]
        assert len(build) == 1 and dict(build[0][1])["version"]
        assert 'worker="' not in text  # the old "id:rank" label is gone

        assert isinstance(admin.call(p.RemoveWorker(worker_id=1)), p.OkReply)
        assert wait_until(
            lambda: value(scrape(port), "kvsched_worker_total_kv_blocks", worker_id=1, dp_rank=0) is None, 10, 0.2
        )
        promtool = require_tool("promtool")
        if promtool:
            res = subprocess.run(
                [promtool, "check", "metrics"], input=scrape(port), capture_output=True, text=True, timeout=60
            )
            assert res.returncode == 0, res.stdout + res.stderr
    finally:
        admin.close()
        peer.close()
        d.stop()
        purge(instance)
