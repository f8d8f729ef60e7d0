"""sd_notify against a fake NOTIFY_SOCKET: READY after bind, WATCHDOG from the actor loop, STOPPING."""

from __future__ import annotations

import os
import signal
import socket
import time
import urllib.request

import pytest

from kvsched.daemon.process import DaemonProcess
from tests.conftest import free_port, purge, unique_instance

pytestmark = pytest.mark.timeout(60)


def _collect(sock: socket.socket, seconds: float, until=None) -> list[tuple[float, str]]:
    """(arrival time, message) of the notifications within `seconds`, or until `until(messages)`."""
    out: list[tuple[float, str]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (until is not None and until([m for _, m in out])):
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            out.append((time.monotonic(), sock.recv(4096).decode()))
        except TimeoutError:
            break
    return out


def test_ready_watchdog_and_stopping_reach_systemd_and_a_stuck_loop_stops_the_watchdog(tmp_path):
    """1. the daemon starts with NOTIFY_SOCKET and WATCHDOG_USEC=200000 (ping every 0.1 s), 2. READY=1
    and WATCHDOG=1 arrive, 3. SIGUSR2 blocks the loop for 1.5 s (KVSCHED_DEBUG_STALL_S), 4. SIGTERM.
    Result: no WATCHDOG=1 during the stall, pings resume after it, STOPPING=1 at the end; the
    Prometheus endpoint serves the daemon's metrics."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    port = free_port()
    env = dict(
        os.environ,
        NOTIFY_SOCKET=path,
        WATCHDOG_USEC="200000",
        KVSCHED_DEBUG_STALL_S="1.5",
        KVSCHED_DAEMON_METRICS_PORT=str(port),
    )
    instance = unique_instance()
    d = DaemonProcess.start(None, instance=instance, runtime_dir=tmp_path, extra_args=["--workers", "2"], env=env)
    try:
        first = _collect(
            sock, 30.0, until=lambda ms: any(m.startswith("READY=1") for m in ms) and ms.count("WATCHDOG=1") >= 5
        )
        states = [m for _, m in first]
        assert any(m.startswith("READY=1") for m in states), states
        assert sum(m == "WATCHDOG=1" for m in states) >= 5
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "kvsched_decisions" in body and "process_resident_memory_bytes" in body
        os.kill(d.pid, signal.SIGUSR2)
        t_stall = time.monotonic()
        during = _collect(sock, 30.0, until=lambda ms: ms.count("WATCHDOG=1") >= 6)  # 1.5 s silent, then pings
        pings = [t - t_stall for t, m in during if m == "WATCHDOG=1"]
        assert pings, "watchdog never resumed after the stall"
        gaps = [b - a for a, b in zip([0.0, *pings], pings, strict=False)]
        assert max(gaps) >= 1.2  # silent while the loop was stuck
        assert len(pings) >= 5  # and pinging again afterwards
        d.stop()
        after = [m for _, m in _collect(sock, 1.0)]
        assert "STOPPING=1" in after
    finally:
        d.stop()
        sock.close()
        purge(instance)
