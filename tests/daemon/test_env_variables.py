"""Stray `KVSCHED_*` variables do not stop a real `kvsched-daemon` (Kubernetes service links).

Kubernetes puts `<SERVICE>_SERVICE_HOST`, `<SERVICE>_PORT`, ... into every pod of a namespace for each
Service; the shipped manifests name theirs `kvsched-pool`, so the daemon's pod sees
`KVSCHED_POOL_SERVICE_HOST` and the rest. Before, the daemon refused every `KVSCHED_<X>_<Y>` it could
not read and exited 2 at start.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

import pytest

from kvsched import protocol as p
from kvsched.client import SyncSchedulerClient
from kvsched.daemon.process import DaemonProcess
from tests.conftest import admin_call, free_port, purge, unique_instance, write_config
from tests.test_config import SERVICE_LINKS

pytestmark = pytest.mark.timeout(240)

CONFIG = """
[[workers]]
worker_id = 1
total_kv_blocks = 1000
max_num_batched_tokens = 1000
"""


def _start(tmp_path, extra_env: dict[str, str]) -> DaemonProcess:
    instance = unique_instance("env")
    cfg = write_config(tmp_path / "pool.toml", CONFIG)
    return DaemonProcess.start(cfg, instance=instance, runtime_dir=tmp_path, env=dict(os.environ, **extra_env))


def _warnings(d: DaemonProcess) -> list[str]:
    return [line for line in d.log_path.read_text().splitlines() if "level=WARNING" in line]


def test_daemon_starts_and_serves_with_kubernetes_service_links_in_its_environment(tmp_path):
    """1. a daemon starts with the service links of two Services (kvsched-pool, kvsched-daemon) in its
    environment, plus KVSCHED_DAEMON_METRICS_PORT and KVSCHED_DAEMON_LOG_LEVEL=debug; 2. a router
    schedules a request; 3. /healthz is fetched on that metrics port. Result: it serves (exit 2
    before), the metrics port is the variable's (a known key is read though it ends in _PORT), no
    warning is logged and one debug line names each service link."""
    port = free_port()
    d = _start(
        tmp_path, SERVICE_LINKS | {"KVSCHED_DAEMON_METRICS_PORT": str(port), "KVSCHED_DAEMON_LOG_LEVEL": "debug"}
    )
    try:
        with (
            SyncSchedulerClient(d.endpoint, attach_progress=False) as router,
            router.schedule("r1", isl_tokens=10) as lease,
        ):
            assert lease.worker.worker_id == 1
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as resp:
            assert resp.status == 200
        assert _warnings(d) == []
        log = d.log_path.read_text()
        for name in SERVICE_LINKS:
            assert log.count(f"environment variable ignored name={name} reason=kubernetes-service-link") == 1
    finally:
        d.stop()
        purge(d.instance)


def test_an_unknown_variable_warns_once_and_the_daemon_serves(tmp_path):
    """A typo that names no section (KVSCHED_DEAMON_MAX_SLOTS) is ignored: the daemon starts, serves an
    admin request and logs one warning naming it and what kvsched reads (user-facing variables only).
    Before: exit 2."""
    d = _start(tmp_path, {"KVSCHED_DEAMON_MAX_SLOTS": "5"})
    try:
        assert isinstance(admin_call(d, p.Status()), p.StatusReply)
        warnings = _warnings(d)
        assert len(warnings) == 1 and "KVSCHED_DEAMON_MAX_SLOTS ignored" in warnings[0], warnings
        assert "KVSCHED_ENDPOINT" in warnings[0] and "KVSCHED_DEBUG_STALL_S" not in warnings[0]
    finally:
        d.stop()
        purge(d.instance)


def test_a_known_section_with_an_unknown_key_still_stops_the_daemon(tmp_path):
    """KVSCHED_DAEMON_MAX_SLOTZ (a typo of a [daemon] key), service links beside it: exit 2, naming it."""
    instance = unique_instance("env")
    env = dict(os.environ, **SERVICE_LINKS, KVSCHED_DAEMON_MAX_SLOTZ="5")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvsched.daemon.app",
            "--instance",
            instance,
            "--endpoint",
            f"ipc://{tmp_path}/{instance}.sock",
            "--admin-endpoint",
            f"ipc://{tmp_path}/{instance}-admin.sock",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "KVSCHED_DAEMON_MAX_SLOTZ: unknown key daemon.max_slotz" in proc.stderr
    assert "KVSCHED_POOL" not in proc.stderr
