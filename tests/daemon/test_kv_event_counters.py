"""KV events the daemon could not read are visible: on /metrics and in one log line.

Found from outside: a publisher sending payloads that are not MessagePack, events of unknown types or
fields of the wrong type left no trace — the subscriber counted them (docs/KV_EVENTS.md says they are
counted) but only `applied` and `replayed` reached /metrics and nothing was logged, so an engine whose
format kvsched cannot read just gave its worker no overlap, unnoticed.
"""

from __future__ import annotations

import logging

from prometheus_client import generate_latest

from kvsched.daemon.metrics import Metrics
from kvsched.daemon.wiring import kv_metrics_tick


class FakeSubscriber:
    def __init__(self) -> None:
        self.c = {
            "applied": 0,
            "replayed": 0,
            "stale_workers": 0,
            "unknown_types": 0,
            "unknown_fields": 0,
            "malformed_events": 0,
            "malformed_batches": 0,
            "malformed_frames": 0,
            "gaps": 0,
            "restarts": 0,
            "replay_lost": 0,
        }

    def counters(self) -> dict[str, int]:
        return dict(self.c)


def _value(metrics: Metrics, name: str, label: str) -> float:
    for line in generate_latest(metrics.registry).decode().splitlines():
        if (
            line.startswith(name + "{")
            and line.split("{", 1)[1].startswith(("reason", "kind"))
            and f'="{label}"}}' in line
        ):
            return float(line.split()[-1])
    raise AssertionError(f"{name}{{{label}}} not on the metrics page")


def test_unreadable_kv_events_are_counted_by_reason_and_logged(caplog):
    sub, metrics = FakeSubscriber(), Metrics()
    tick = kv_metrics_tick(sub, metrics)
    tick()
    sub.c.update(malformed_batches=2, unknown_types=3, malformed_events=1, restarts=1)
    with caplog.at_level(logging.WARNING):
        tick()
    assert _value(metrics, "kvsched_kv_events_skipped_total", "malformed_batches") == 2
    assert _value(metrics, "kvsched_kv_events_skipped_total", "unknown_types") == 3
    assert _value(metrics, "kvsched_kv_events_skipped_total", "malformed_events") == 1
    assert _value(metrics, "kvsched_kv_event_streams_total", "restarts") == 1
    warned = [r.getMessage() for r in caplog.records if "could not be read" in r.getMessage()]
    assert len(warned) == 1 and "malformed_batches=2" in warned[0] and "KV_EVENTS.md" in warned[0], warned
    caplog.clear()
    sub.c.update(malformed_batches=3)
    with caplog.at_level(logging.WARNING):
        tick()  # within a minute of the last warning: counted, not logged again
    assert _value(metrics, "kvsched_kv_events_skipped_total", "malformed_batches") == 3
    assert not [r for r in caplog.records if "could not be read" in r.getMessage()]
