"""NVIDIA Dynamo's selector as a routing baseline, through its standalone selection service
(`pip install '.[bench-dynamo]'` → `ai-dynamo-runtime`; `python -m dynamo.select_service --port P`).

One module for every bench that drives Dynamo (routing quality, transport). Today it only reports
whether the service can run here; the HTTP driver (POST /workers with `endpoint`, `block_size` and
`kv_events_endpoints`; POST /select_and_reserve; POST /reservations/{id}/prefill_complete; DELETE
/reservations/{id}; POST /overlap_scores to check it sees the daemon's overlap) is not written yet
(docs/BENCHMARKS.md says so).
"""

from __future__ import annotations

import importlib.util


def dynamo_unavailable_reason() -> str | None:
    """None when the Dynamo baseline can run; else why not (printed by the benches, which then skip it)."""
    if importlib.util.find_spec("dynamo") is None:
        return "package ai-dynamo-runtime not installed (pip install '.[bench-dynamo]')"
    return "the Dynamo HTTP driver is not implemented yet (bench/dynamo_driver.py)"
