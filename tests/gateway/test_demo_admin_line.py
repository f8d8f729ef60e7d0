"""`make gateway-demo` prints an admin line to paste into a second shell; it must work from any directory.

Found by a new user: the demo binds under its relative `--workdir` (`out/gateway-demo`) and printed
`KVSCHED_ADMIN_ENDPOINT=ipc://out/gateway-demo/run/...`, which a shell outside the checkout could
not reach ("socket file ... does not exist").
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port, kill_instance, running_instance

pytestmark = pytest.mark.timeout(240)


def _demo(workdir: str, cwd: Path | None = None, session: bool = False) -> subprocess.Popen:
    """`python -m kvsched.gateway.demo` with one engine on a free port (its own process group when
    `session`, as a shell job is), stdout and stderr on one text pipe."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvsched.gateway.demo",
            "--port",
            str(free_port()),
            "--engines",
            "1",
            "--workdir",
            workdir,
        ],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=session,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _admin_endpoint(proc: subprocess.Popen) -> str:
    """The admin endpoint the demo prints once everything is up (AssertionError with its output if not)."""
    seen, deadline = [], time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        m = re.search(r"KVSCHED_ADMIN_ENDPOINT=(\S+)", line)
        if m:
            return m.group(1)
    raise AssertionError("".join(seen))


def test_the_printed_admin_line_reaches_the_daemon_from_another_directory(tmp_path):
    (tmp_path / "checkout").mkdir()
    (tmp_path / "elsewhere").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = _demo("demo", cwd=tmp_path / "checkout")
    try:
        endpoint = _admin_endpoint(proc)
        cli = subprocess.run(
            [sys.executable, "-m", "kvsched.cli", "workers", "--json"],
            cwd=tmp_path / "elsewhere",
            env={**env, "KVSCHED_ADMIN_ENDPOINT": endpoint},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, (endpoint, cli.stdout, cli.stderr)
        assert '"worker_id":1' in cli.stdout.replace(" ", "")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def test_a_hangup_of_the_demos_process_group_stops_its_daemon_and_frees_its_shared_memory(tmp_path):
    """Closing the terminal (SIGHUP to the job's process group) killed the demo, its engines and its
    gateway, but the daemon (its own session: no hangup) kept running with ~324 MiB of /dev/shm."""
    proc = _demo(str(tmp_path / "demo"), session=True)
    instance = None
    try:
        instance = re.search(r"/(gw-[0-9a-f]+)-admin\.sock$", _admin_endpoint(proc)).group(1)
        assert list(Path("/dev/shm").glob(f"kvsched-{instance}*")), "the daemon's segments should exist while it runs"
        os.killpg(proc.pid, signal.SIGHUP)
        proc.communicate(timeout=90)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (
            running_instance(instance) or list(Path("/dev/shm").glob(f"kvsched-{instance}*"))
        ):
            time.sleep(0.2)
        assert not running_instance(instance), "the daemon outlived the demo"
        assert not list(Path("/dev/shm").glob(f"kvsched-{instance}*"))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        if instance:  # a failed run leaves nothing behind either
            kill_instance(instance)


def test_ctrl_c_during_start_up_is_reported_as_an_interruption_not_an_engine_failure(tmp_path):
    """Found from outside: a terminal's Ctrl-C while the demo started (it reaches the engines too)
    printed `gateway-demo: [... kvsched.sim.http_engine] exited with -2:` and the engine's traceback."""
    proc = _demo(str(tmp_path / "demo"), session=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith("starting daemon"), first
        time.sleep(0.3)  # the fleet is starting
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert "exited with" not in out and "Traceback" not in out, out
    assert "interrupted while starting" in out or "stopping ..." in out, out
    # nothing it started runs on: every process of the fleet has the work directory in its command line
    assert subprocess.run(["pgrep", "-f", "--", str(tmp_path / "demo")], capture_output=True).returncode == 1
