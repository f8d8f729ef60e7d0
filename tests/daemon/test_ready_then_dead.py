"""A daemon child that printed its ready line and then died is not reported ready.

Found from outside (a CI run on a loaded machine): `tests/sim/test_replay_start.py` SIGKILLs the
replay's daemon during start-up; when the kill landed just after the daemon printed
`KVSCHED_READY`, `DaemonProcess.wait_ready` found the line in the pipe and returned, and the replay
then waited 120 s for routers that could not reach a dead daemon ("processes not ready within 120s")
instead of saying the daemon exited and naming its log.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvsched.daemon.process import DaemonProcess
from kvsched.errors import DaemonUnavailable


def test_a_child_that_printed_ready_and_exited_is_unavailable_naming_its_code_and_log(tmp_path):
    """1. a child prints the ready line, then exits with code 7 (as a daemon SIGKILLed right after
    start-up would leave it); 2. `wait_ready` reads the line. Result: DaemonUnavailable naming the
    exit code and the log (before: it returned as if the daemon were ready)."""
    log = tmp_path / "d.log"
    log.write_text("the daemon's last words\n")
    proc = subprocess.Popen(
        [sys.executable, "-c", "print('KVSCHED_READY ipc://x ipc://y', flush=True); raise SystemExit(7)"],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    proc.wait(30)  # dead before anyone reads its pipe
    handle = DaemonProcess(proc, "ipc://x", "ipc://y", log, [sys.executable, "--instance", "t"], {})
    with pytest.raises(DaemonUnavailable) as err:
        handle.wait_ready(10.0)
    assert "exited with code 7" in str(err.value)
    assert str(log) in str(err.value) and "the daemon's last words" in str(err.value)


def test_a_child_that_printed_ready_and_lives_is_ready(tmp_path):
    """The same child, alive after its ready line: `wait_ready` returns."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; print('KVSCHED_READY a b', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    handle = DaemonProcess(proc, "ipc://x", "ipc://y", tmp_path / "d.log", [sys.executable, "--instance", "t"], {})
    try:
        handle.wait_ready(30.0)
        assert handle.alive()
    finally:
        handle.kill()


def test_the_replay_stops_waiting_for_its_routers_when_its_daemon_dies(tmp_path):
    """1. the replay waits for its routers' ready events (never set: they cannot reach a dead
    daemon); 2. its private daemon has exited. Result: DaemonUnavailable naming the daemon's exit
    code and log within a second (before: RuntimeError "processes not ready" after the 120 s wait)."""
    import multiprocessing as mp
    import time

    from kvsched.sim.replay_wall import _wait_ready

    log = tmp_path / "d.log"
    log.write_text("killed mid-start\n")
    proc = subprocess.Popen(
        [sys.executable, "-c", "raise SystemExit(9)"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    proc.wait(30)
    daemon = DaemonProcess(proc, "ipc://x", "ipc://y", log, [sys.executable, "--instance", "t"], {})
    started = time.monotonic()
    with pytest.raises(DaemonUnavailable) as err:
        _wait_ready([mp.get_context("spawn").Event()], [], 120.0, daemon)
    assert time.monotonic() - started < 5
    assert "exited with code 9" in str(err.value) and str(log) in str(err.value)
