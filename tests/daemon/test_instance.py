"""One daemon per instance; purge refuses a running instance; a failed start leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvsched.daemon.process import DaemonProcess
from kvsched.errors import DaemonUnavailable
from tests.conftest import free_port, purge, unique_instance

pytestmark = pytest.mark.timeout(60)


def _daemon_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvsched.daemon.app", *args], capture_output=True, text=True,
                          timeout=60, env=os.environ.copy())


def test_second_daemon_with_same_instance_is_refused_and_first_keeps_serving(tmp_path):
    instance = unique_instance()
    first = DaemonProcess.start(None, instance=instance, runtime_dir=tmp_path / "a", extra_args=["--workers", "1"])
    try:
        with pytest.raises(DaemonUnavailable, match="already running"):
            DaemonProcess.start(None, instance=instance, runtime_dir=tmp_path / "b", extra_args=["--workers", "1"],
                                ready_timeout_s=20)
        # same endpoint, another instance: refused, the first daemon's socket file survives
        with pytest.raises(DaemonUnavailable, match="in use"):
            DaemonProcess.start(None, instance=unique_instance(), runtime_dir=tmp_path / "a",
                                extra_args=["--workers", "1", "--endpoint", first.endpoint,
                                            "--admin-endpoint", f"ipc://{tmp_path}/other-admin.sock"],
                                ready_timeout_s=20)
        assert os.path.exists(first.endpoint[len("ipc://"):])
        refused = _daemon_cli("--purge", "--instance", instance)
        assert refused.returncode == 1 and "already running" in refused.stderr
        assert os.path.exists(f"/dev/shm/kvsched-{instance}-ledger")
        assert first.alive()
    finally:
        first.stop()
        purge(instance)
    assert "nothing to purge" in _daemon_cli("--purge", "--instance", instance).stdout


def test_failed_start_leaves_no_segments_behind(tmp_path):
    instance = unique_instance()
    with pytest.raises(DaemonUnavailable, match="CURVE"):
        DaemonProcess.start(None, instance=instance, runtime_dir=tmp_path, ready_timeout_s=20,
                            extra_args=["--workers", "1", "--endpoint", f"tcp://0.0.0.0:{free_port()}"])
    assert not os.path.exists(f"/dev/shm/kvsched-{instance}-ledger")
    assert not os.path.exists(f"/dev/shm/kvsched-{instance}-progress")
    assert not os.path.exists(f"/dev/shm/kvsched-{instance}.lock")
