"""The monitoring material in deploy/: the alert rules pass `promtool check rules` and their own
promtool unit tests (deploy/prometheus/kvsched-alerts.test.yml), and the rules and the Grafana
dashboard only name series the daemon really exports."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from prometheus_client import CollectorRegistry

from kvsched.daemon.metrics import Metrics
from tests.ops.tools import tool_or_skip

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvsched-dashboard.json"
NAME = re.compile(r"\b(kvsched_[a-z_]+|process_[a-z_]+)\b")


def exported_names() -> set[str]:
    """Every sample name a fresh daemon registry can export (labelled series appear once used)."""
    m = Metrics(CollectorRegistry())
    names = set()
    for family in m.registry.collect():
        names.add(family.name)
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names.update(family.name + s for s in ("_bucket", "_count", "_sum"))
        if family.type == "info":
            names.add(family.name + "_info")
    return names


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in dash["panels"] for t in panel.get("targets", [])]


def test_promtool_checks_and_unit_tests_the_alert_rules():
    promtool = tool_or_skip("promtool")
    check = subprocess.run(
        [promtool, "check", "rules", str(PROM / "kvsched-alerts.yml")], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run(
        [promtool, "test", "rules", "kvsched-alerts.test.yml"], cwd=PROM, capture_output=True, text=True, timeout=120
    )
    assert unit.returncode == 0, unit.stdout + unit.stderr
    config = subprocess.run(
        [promtool, "check", "config", str(PROM / "prometheus.yml")], capture_output=True, text=True, timeout=60
    )
    assert config.returncode == 0, config.stdout + config.stderr


def test_rules_and_dashboard_name_only_exported_series():
    names = exported_names()
    used = set(NAME.findall((PROM / "kvsched-alerts.yml").read_text()))
    for expr in dashboard_exprs():
        used |= set(NAME.findall(expr))
    assert {"kvsched_lease_oldest_age_seconds", "kvsched_decisions_total", "kvsched_worker_total_kv_blocks"} <= used
    missing = sorted(used - names)
    assert not missing, f"not exported by the daemon: {missing}"


def test_dashboard_is_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "instance"}
