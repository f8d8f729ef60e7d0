"""`bench/bench_core.py` in `make bench`: a short real run (`--quick`, smoke) and how its JSON becomes
the `core` block and the in-process target row of docs/BENCHMARKS.md (`bench/run_all.py`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import run_all as ra


def _core(cpu: list[float], base: list[float] | None = None) -> dict:
    cells = [("approx", 8), ("approx", 1), ("events", 8)]

    def rows(v):
        return [
            {"overlap_mode": m, "window": w, "cpu_us_per_lifecycle": x, "wall_us_per_lifecycle": 2 * x}
            for (m, w), x in zip(cells, v, strict=True)
        ]

    return {
        "workers": 8,
        "hashes": 64,
        "selector": "kv",
        "goal_us": 15.0,
        "revision": "abc1234",
        "mode": "full",
        "lifecycles": 100,
        "repeats": 1,
        "rounds": 1,
        "rows": rows(cpu),
        "baseline_rows": rows(base) if base else None,
        "baseline_revision": "def5678" if base else None,
    }


def test_make_bench_runs_the_core_step():
    assert "core" in ra.STEPS and ra.SCRIPTS["core"] == "bench_core.py"
    assert (ROOT / "bench" / ra.SCRIPTS["core"]).exists()


@pytest.mark.timeout(300)
def test_quick_run_measures_every_cell(tmp_path):
    """The smoke mode `make bench-quick` uses, made shorter still; figures are not judged, only present."""
    out = tmp_path / "core.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_core.py"),
            "--quick",
            "--n",
            "200",
            "--repeats",
            "1",
            "--warm",
            "100",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["mode"] == "quick" and (data["lifecycles"], data["repeats"], data["rounds"]) == (200, 1, 1)
    assert [(r["overlap_mode"], r["window"]) for r in data["rows"]] == [("approx", 8), ("approx", 1), ("events", 8)]
    assert all(r["cpu_us_per_lifecycle"] > 0 and r["lifecycles"] == 200 for r in data["rows"])
    assert data["meets_goal"] == (data["rows"][0]["cpu_us_per_lifecycle"] <= 15.0)
    assert "goal <= 15" in proc.stdout
    ra.md_core(data)  # the doc renderer accepts what the bench writes


def test_core_block_shows_each_cell_and_the_baseline_ratio():
    text = ra.md_core(_core([200.0, 190.0, 270.0], [400.0, 380.0, 540.0]))
    assert "| approximate overlap index, 8 leases in flight | 200.0 | 400.0 | 400.0 | 2.00× |" in text
    assert "| KV-event overlap index, 8 leases in flight | 270.0 | 540.0 | 540.0 | 2.00× |" in text
    assert "200.0 µs — **missed**" in text
    assert "met" in ra.md_core(_core([14.0, 15.0, 30.0])).split("—")[-1]


def test_target_row_prefers_the_core_bench_over_the_transport_inline_figure():
    t = {"goal_summary": [], "core": {"cpu_us_per_lifecycle": 459.3, "goal_us": 15.0}}
    rows = ra.targets(t, None, None, _core([187.9, 190.5, 273.5]))
    core_rows = [r for r in rows if r[0].startswith("in-process core")]
    assert core_rows == [
        ["in-process core ≤ 15 µs per lifecycle (8 workers, 64 hashes; `bench_core.py`)", "187.9 µs", "missed"]
    ]
    (only_t,) = [r for r in ra.targets(t, None, None, None) if r[0].startswith("in-process core")]
    assert only_t[1] == "459.3 µs"


def test_render_doc_rewrites_the_core_block(tmp_path, monkeypatch):
    doc = tmp_path / "BENCHMARKS.md"
    shutil.copy(ROOT / "docs" / "BENCHMARKS.md", doc)
    monkeypatch.setattr(ra, "DOC", doc)
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "core.json").write_text(json.dumps(_core([123.4, 120.0, 150.0])))
    ra.render_doc(bench, None)
    text = doc.read_text()
    block = text.split("<!-- generated:core -->\n", 1)[1].split("<!-- /generated:core -->", 1)[0]
    assert "| approximate overlap index, 8 leases in flight | 123.4 | 246.8 |" in block
    targets = text.split("<!-- generated:targets -->\n", 1)[1].split("<!-- /generated:targets -->", 1)[0]
    assert "| 123.4 µs | missed |" in targets
    assert text.count("<!-- generated:core -->") == 1
