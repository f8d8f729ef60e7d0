"""Ctrl-C of a running wall-clock replay: one line, exit status 130, nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from importlib.resources import files
from pathlib import Path

import pytest

from kvsched.daemon.instance_lock import LOCK_DIR
from tests.conftest import kill_instance, running_instance

SLICE = Path(str(files("kvsched") / "data" / "mooncake_slice.jsonl"))


def _replay_mid_run(out: Path) -> subprocess.Popen:
    """`kvsched replay` (private daemon, fleet, 2 routers) in its own process group, returned once its
    routers replay: the admin-endpoint lines come once the daemon is ready, then 3 s for the fleet and
    routers to start (any moment is a fair signal; this one is mid-run)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvsched.cli",
            "replay",
            str(SLICE),
            "--limit",
            "600",
            "--routers",
            "2",
            "--workers",
            "2",
            "--speedup",
            "5",
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=dict(os.environ, COLUMNS="200"),
    )
    deadline = time.monotonic() + 240
    for line in proc.stdout:
        if "inspect it while it runs" in line or time.monotonic() > deadline:
            break
    time.sleep(3.0)
    if proc.poll() is not None:
        raise AssertionError(proc.stderr.read())
    return proc


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigint_to_the_replays_process_group_prints_one_line_and_exits_130(tmp_path):
    """1. `kvsched replay` (private daemon, fleet, 2 routers) runs in its own process group;
    2. once its routers replay (the progress line is printed), SIGINT goes to the whole group, as a
       terminal's Ctrl-C does.
    Result: exit status 130, one 'interrupted; cleaned up' line, no traceback from any process; the
    daemon stopped (its log says so) and its /dev/shm segments and lock file are gone."""
    out = tmp_path / "out"
    proc = _replay_mid_run(out)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "interrupted; cleaned up" in lines[0], stderr
    assert "stopped" in (out / "daemon.log").read_text()
    assert sorted(p.name for p in LOCK_DIR.glob(f"kvsched-replay-{proc.pid}*")) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sighup_to_the_replays_process_group_stops_its_daemon(tmp_path):
    """A closed terminal (SIGHUP to the job's process group) ended the replay without its cleanup:
    the daemon, in its own session, kept running with its /dev/shm segments."""
    out = tmp_path / "out"
    proc = _replay_mid_run(out)
    try:
        os.killpg(proc.pid, signal.SIGHUP)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 128 + signal.SIGHUP, stderr
        assert "Traceback" not in stderr and "resource_tracker" not in stderr, stderr
        assert not running_instance(f"replay-{proc.pid}"), "the replay's daemon outlived it"
        assert "stopped" in (out / "daemon.log").read_text()
        assert sorted(p.name for p in LOCK_DIR.glob(f"kvsched-replay-{proc.pid}*")) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        kill_instance(f"replay-{proc.pid}")  # a failed run leaves nothing behind either


class _Recorder:
    """Stands in for a multiprocessing Process / Event; appends (name, call) to a shared list."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls, self.alive = name, calls, True

    def is_alive(self) -> bool:
        return self.alive

    def terminate(self) -> None:
        self.calls.append((self.name, "terminate"))
        self.alive = False

    def join(self, timeout=None) -> None:
        self.calls.append((self.name, "join"))

    def set(self) -> None:
        self.calls.append((self.name, "set"))
        self.alive = False


def test_cleanup_stops_the_fleet_before_terminating_routers(tmp_path):
    """The fleet serves until its stop event; a router terminated while it still serves makes it log
    'cannot deliver' for that router's events (a stray stderr line on Ctrl-C, seen in CI). Cleanup
    sets the fleet's stop and joins it before it terminates any router."""
    from kvsched.sim.replay_wall import _Procs, _stop_all

    calls: list = []
    fleet = _Recorder("fleet", calls)
    stop = _Recorder("fleet_stop", calls)
    stop.set = lambda: (calls.append(("fleet_stop", "set")), setattr(fleet, "alive", False))
    procs = _Procs(
        runtime_dir=tmp_path / "rt",
        fleet=fleet,
        fleet_stop=stop,
        routers=[_Recorder("r0", calls), _Recorder("r1", calls)],
    )
    _stop_all(procs, keep=False)
    first_router = min(i for i, (name, _) in enumerate(calls) if name.startswith("r"))
    assert calls.index(("fleet_stop", "set")) < calls.index(("fleet", "join")) < first_router, calls
    assert ("r0", "terminate") in calls and ("r1", "terminate") in calls
