"""A wall-clock replay whose private daemon does not come up: its log is kept, its shared memory removed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from importlib.resources import files
from pathlib import Path

import pytest

from kvsched.daemon.instance_lock import LOCK_DIR
from kvsched.daemon.process import DaemonProcess
from kvsched.errors import DaemonUnavailable
from kvsched.shm.segments import segment_names
from kvsched.sim.replay import ReplayOptions, run_replay

SLICE = Path(str(files("kvsched") / "data" / "mooncake_slice.jsonl"))


def _instance_files(instance: str) -> list[str]:
    return sorted(p.name for p in LOCK_DIR.glob(f"kvsched-{instance}*"))


@pytest.mark.timeout(240)
def test_daemon_killed_during_start_up_leaves_no_shared_memory_and_a_kept_log(tmp_path, monkeypatch):
    """1. a wall replay starts its private daemon;
    2. once the daemon has created its /dev/shm segments it is SIGKILLed before it is ready (as a ready
       timeout does during a cold kernel compile).
    Result: DaemonUnavailable naming `<out>/daemon.log`, which exists and holds the daemon's output;
    no segment and no lock file of the instance is left in /dev/shm."""
    instance = f"replay-{os.getpid()}"
    original = DaemonProcess.wait_ready

    def ready_once_segments_exist(self, timeout_s=60.0, *args, **kwargs):
        deadline = time.monotonic() + 180
        while not all((LOCK_DIR / n).exists() for n in segment_names(instance)):
            assert self.proc.poll() is None, "daemon exited before creating its segments"
            assert time.monotonic() < deadline, "daemon created no segments in 180 s"
            time.sleep(0.05)
        self.proc.kill()  # dies during start-up with its segments in place (as a ready timeout's SIGKILL)
        self.proc.wait()
        return original(self, 30.0)

    monkeypatch.setattr(DaemonProcess, "wait_ready", ready_once_segments_exist)
    out = tmp_path / "out"
    with pytest.raises(DaemonUnavailable) as err:
        run_replay(ReplayOptions(trace=SLICE, routers=1, workers=2, speedup=50.0, limit=5, out=out))
    log = out / "daemon.log"
    assert str(log) in str(err.value)
    assert log.is_file() and log.stat().st_size > 0
    assert _instance_files(instance) == []


@pytest.mark.timeout(120)
def test_replay_cli_ready_timeout_exits_3_naming_a_log_that_exists_and_leaves_no_shared_memory(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvsched.cli",
            "replay",
            str(SLICE),
            "--limit",
            "5",
            "--routers",
            "1",
            "--workers",
            "2",
            "--out",
            str(out),
            "--daemon-ready-timeout",
            "0.2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = proc.communicate(timeout=110)
    assert proc.returncode == 3, stderr
    assert "not ready within" in stderr and str(out / "daemon.log") in stderr
    assert (out / "daemon.log").is_file()
    assert "Traceback" not in stderr
    assert _instance_files(f"replay-{proc.pid}") == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kvsched_config_environment_does_not_reach_the_replays_daemon(tmp_path, monkeypatch):
    """1. KVSCHED_DAEMON_MAX_WORKERS=1 (a config override that contradicts the replay's 2 workers) and
       KVSCHED_DEBUG_STALL_S (not a config variable) are in the environment;
    2. a wall replay of 20 requests on 2 workers runs.
    Result: the daemon starts with the replay's own config (the override would have made it refuse
    to start) and every request completes; the console names the dropped variable, once; the
    non-config variable still reaches the daemon."""
    from rich.console import Console

    monkeypatch.setenv("KVSCHED_DAEMON_MAX_WORKERS", "1")
    monkeypatch.setenv("KVSCHED_DEBUG_STALL_S", "0.5")
    seen: list[dict] = []
    original = DaemonProcess.start.__func__

    def start(cls, *args, **kwargs):
        seen.append(dict(kwargs.get("env") or os.environ))
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(DaemonProcess, "start", classmethod(start))
    with open(os.devnull, "w") as devnull:
        console = Console(record=True, width=200, file=devnull)
        summary = run_replay(
            ReplayOptions(trace=SLICE, routers=1, workers=2, speedup=50.0, limit=20, out=tmp_path / "out"), console
        )
    assert summary.completed == 20
    assert "KVSCHED_DAEMON_MAX_WORKERS" not in seen[0] and seen[0]["KVSCHED_DEBUG_STALL_S"] == "0.5"
    lines = [ln for ln in console.export_text().splitlines() if "KVSCHED_DAEMON_MAX_WORKERS" in ln]
    assert len(lines) == 1 and "not passed to its daemon" in lines[0]
