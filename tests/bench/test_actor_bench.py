"""`bench/bench_actor.py`: a short real run (smoke). Figures are not judged, only their shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_short_run_splits_actor_cpu_into_core_and_rest(tmp_path):
    out = tmp_path / "actor.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_actor.py"),
            "--windows",
            "1,4",
            "--rounds",
            "20",
            "--repeats",
            "2",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    table = json.loads(out.read_text())["table"]
    assert [(r["tree"], r["window"], r["samples"]) for r in table] == [("this tree", 1, 2), ("this tree", 4, 2)]
    for r in table:
        assert r["core_us_per_lc"] > 0 and r["actor_us_per_lc"] > 0  # the core runs inside the actor's wakes
    assert "rest µs/lc" in proc.stdout
