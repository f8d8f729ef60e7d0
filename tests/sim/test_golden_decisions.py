"""Decisions do not change by accident: a virtual replay of the bundled trace slice with a fixed seed
routes every request to the same worker as the golden file committed with this test.

The golden files were written from the `kv` selector of docs/ROUTING.md before the decision path was
rebuilt for speed; a rebuild (new data structures, batching, shared-memory words) must reproduce them
exactly. A deliberate change of routing regenerates them with `KVSCHED_REGEN_GOLDEN=1 pytest
tests/sim/test_golden_decisions.py` and says why in its commit message.

The `kv` files without a suffix are the selector with the "home" term off (`home_weight` 0, pinned
here): the configuration the fused admission kernel decides. `-home` is the term on (docs/ROUTING.md,
"Home"), decided by the Python path.
"""

from __future__ import annotations

import json
import os
from importlib.resources import files
from pathlib import Path

import msgspec
import pytest

from kvsched.sim.fleet_spec import FleetSpec, build_config
from kvsched.sim.trace import load_trace
from kvsched.sim.virtual import run_virtual

SLICE = str(files("kvsched") / "data" / "mooncake_slice.jsonl")
GOLDEN = Path(__file__).parent / "golden"
REQUESTS = 600  # the first 600 rows: ~3 s per mode on a loaded 2-core machine
HOME_WEIGHT = 0.08  # the "home" term's weight in its golden file


def decisions(
    selector: str, overlap_mode: str, workers: int, load_scale: float, home_weight: float = 0.0
) -> list[list]:
    """[[index, outcome, reason, worker, overlap_blocks]] per request of the replay (`kv`: with the given
    `home_weight`)."""
    spec = FleetSpec(workers=workers)
    cfg = build_config(spec, selector, 0)
    if selector == "kv":
        cfg = msgspec.structs.replace(cfg, selector=msgspec.structs.replace(cfg.selector, home_weight=home_weight))
    run = run_virtual(
        load_trace(SLICE, REQUESTS), spec, config=cfg, seed=0, overlap_mode=overlap_mode, load_scale=load_scale
    )
    return [[r.index, r.outcome, r.reason, r.worker, r.overlap_blocks] for r in run.results]


@pytest.mark.parametrize(
    "selector,overlap_mode,workers,load_scale,home_weight",
    [
        ("kv", "events", 4, 1.25, 0.0),
        ("kv", "approx", 8, 1.0, 0.0),
        ("kv", "events", 8, 2.0, HOME_WEIGHT),
        ("dynamo_cost", "events", 4, 1.25, 0.0),
    ],
)
def test_replay_routes_every_request_as_the_golden_file(selector, overlap_mode, workers, load_scale, home_weight):
    got = decisions(selector, overlap_mode, workers, load_scale, home_weight)
    suffix = "-home" if home_weight > 0 else ""
    path = GOLDEN / f"decisions-{selector}-{overlap_mode}-{workers}w-{load_scale}{suffix}.json"
    if os.environ.get("KVSCHED_REGEN_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(got, separators=(",", ":")) + "\n")
    want = json.loads(path.read_text())
    assert len(got) == len(want) == REQUESTS
    diffs = [(w, g) for w, g in zip(want, got, strict=True) if w != g]
    assert not diffs, f"{len(diffs)} of {REQUESTS} decisions changed; first: {diffs[:3]}"
