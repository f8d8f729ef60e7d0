"""Multi-process replay: real daemon + fleet + routers on a few hundred trace requests."""

from __future__ import annotations

import importlib.util
from importlib.resources import files

import msgspec
import pytest

from kvsched.sim.replay import ReplayOptions, run_replay
from kvsched.sim.summary import COMPLETED, REJECTED, Summary, read_results

SLICE = files("kvsched") / "data" / "mooncake_slice.jsonl"
HAVE_STACK = all(
    importlib.util.find_spec(m) is not None
    for m in ("kvsched.core.scheduler", "kvsched.daemon.process", "kvsched.client", "kvsched.client.admin")
)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not HAVE_STACK, reason="daemon, client or scheduler not available")
def test_every_request_completes_or_is_rejected_and_ledger_ends_at_zero_when_replayed(tmp_path):
    """1. a private daemon, the fleet (4 engines) and 2 router processes start;
    2. 300 Mooncake requests are replayed 50x faster than recorded (arrivals and engine time);
    3. every router schedules, dispatches, streams and releases through the daemon.
    Result: each request completed, or was rejected with a stated reason; the daemon's per-worker
    aggregates (active blocks, prefill tokens, requests) are back to zero; summary.json is written."""
    out = tmp_path / "out"
    opts = ReplayOptions(trace=SLICE, routers=2, workers=4, speedup=50.0, limit=300, out=out)
    summary = run_replay(opts)
    results = read_results(out / "results.jsonl")
    assert len(results) == 300
    for r in results:
        assert r.outcome == COMPLETED or (r.outcome == REJECTED and r.reason), r
        if r.outcome == COMPLETED:
            assert r.worker and r.ttft_us > 0 and r.output_tokens == r.osl
    assert summary.completed + sum(summary.rejected.values()) == 300
    assert summary.ledger_zero is True, summary.notes
    on_disk = msgspec.json.decode((out / "summary.json").read_bytes(), type=Summary)
    assert on_disk.requests == 300
    assert 0 <= summary.prefix_hit_ratio <= (summary.infinite_cache_hit_ratio or 0)
