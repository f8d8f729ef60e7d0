"""`bench/bench_transport.py`: the goal verdicts it prints, and a short real run of the bench (smoke)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import bench_transport as bt


def _row(backend: str, routers: int, window: int, lc: float, p99: float, cpu: float) -> dict:
    return {
        "backend": backend,
        "routers": routers,
        "window": window,
        "lifecycles_per_s": lc,
        "select_us_p50": p99 / 2,
        "select_us_p99": p99,
        "server_cpu_us_per_lifecycle": cpu,
        "loadavg_1m": 0.0,
        "errors": 0,
    }


def test_verdicts_apply_each_goal_per_cell():
    rows = [
        _row("echo", 1, 1, 10_000, 100, 20),
        _row("daemon", 1, 1, 3_000, 130, 40),
        _row("redis", 1, 1, 2_000, 90, 50),
        _row("dynamo", 1, 1, 1_000, 900, 300),
        _row("echo", 1, 8, 20_000, 200, 10),
        _row("daemon", 1, 8, 4_000, 261, 21),
        _row("redis", 1, 8, 2_000, 300, 40),
        _row("dynamo", 1, 8, 1_400, 3_000, 300),
    ]
    v1, v8 = bt.verdicts(rows)
    assert (v1["window"], v8["window"]) == (1, 8)
    assert v1["over_dynamo"] == 3.0 and v1["dynamo_3x"] is True  # the bound itself meets the goal
    assert v1["over_redis"] == 1.5 and v1["redis"] is True  # window 1: 1.5× suffices
    assert v1["p99_over_echo"] == 1.3 and v1["p99_1_3x_echo"] is True
    assert v1["cpu_over_echo"] == 2.0 and v1["cpu_2x_echo"] is True
    assert v8["over_redis"] == 2.0 and v8["redis"] is False  # window 8: 2.5× needed
    assert v8["over_dynamo"] == 2.86 and v8["dynamo_3x"] is False
    assert v8["p99_1_3x_echo"] is False and v8["cpu_2x_echo"] is False  # 1.305× and 2.1×
    summary = {g["goal"]: g for g in bt.goal_summary([v1, v8])}
    assert summary["redis"]["met"] == 1 and summary["redis"]["cells"] == 2 and summary["redis"]["verdict"] == "missed"


def test_verdicts_without_a_backend_are_not_measured():
    rows = [_row("echo", 4, 1, 10_000, 100, 20), _row("daemon", 4, 1, 3_000, 120, 30)]
    (v,) = bt.verdicts(rows)
    assert v["over_redis"] is None and v["redis"] is None and v["dynamo_3x"] is None
    assert v["p99_1_3x_echo"] is True
    summary = {g["goal"]: g["verdict"] for g in bt.goal_summary([v])}
    assert summary == {
        "dynamo_3x": "not measured",
        "redis": "not measured",
        "p99_1_3x_echo": "met",
        "cpu_2x_echo": "met",
    }


@pytest.mark.timeout(300)
def test_quick_run_measures_the_echo_and_the_daemon(tmp_path):
    """One short cell per backend through real processes; figures are not judged, only present."""
    out = tmp_path / "transport.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_transport.py"),
            "--quick",
            "--routers",
            "1",
            "--windows",
            "2",
            "--measure-s",
            "0.5",
            "--backends",
            "echo,daemon",
            "--no-inprocess",
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
    rows = {r["backend"]: r for r in data["rows"]}
    assert set(rows) == {"echo", "daemon"}
    for r in rows.values():
        assert r["lifecycles"] > 0 and r["errors"] == 0, r
    (v,) = data["verdicts"]
    assert v["over_echo"] is not None and v["redis"] is None
    assert "admission p99" in proc.stdout


def test_inprocess_figures_run():
    sys.path.insert(0, str(ROOT / "bench"))
    import transport_core as tc

    core = tc.core_cost(n=200, repeats=1)
    assert core["cpu_us_per_lifecycle"] > 0
    long = tc.long_prompt_cell(n=4, window=2)
    assert long["blocks"] == 6250 and long["workers"] == 64 and long["decisions_per_s"] > 0


def test_baseline_env_imports_the_exported_tree_from_the_repository_root(tmp_path, monkeypatch):
    """`daemon@REV` rows ran this tree's daemon: `python -m` put the repository (the working directory)
    ahead of PYTHONPATH. The environment must make a child import the exported tree."""
    src = tmp_path / "base"
    (src / "kvsched").mkdir(parents=True)
    (src / "kvsched" / "__init__.py").write_text("")
    (src / "kvsched" / "__main__.py").write_text("print('the exported tree')")  # this repository's has none
    monkeypatch.chdir(ROOT)
    env = bt.baseline_env(src)
    got = subprocess.run([sys.executable, "-m", "kvsched"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert got.stdout.strip() == "the exported tree", (got.stdout, got.stderr)


def test_baseline_env_refuses_a_tree_a_child_would_not_import(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(RuntimeError, match="not what a child imports"):
        bt.baseline_env(tmp_path / "empty")
