"""`kvsched-gateway --workers N`: N gateway processes sharing one listening port (SO_REUSEPORT).

One gateway process is one event loop on one core (docs/BENCHMARKS.md, gateway: about 2 ms of CPU
per streamed request). For more throughput on a host with cores to spare, the supervisor started
here runs N ordinary gateway processes that each bind the same `host:port` with `SO_REUSEPORT`: the
kernel spreads new connections over their listening sockets (socket(7), SO_REUSEPORT; Linux 3.9 and
later). Each worker is a complete gateway with its own `SchedulerClient` (one router of the daemon
per process, as the daemon expects: docs/GATEWAY.md "Run it").

The supervisor holds no connection and serves nothing. With `port = 0` it reserves a free port by
binding (not listening on) a `SO_REUSEPORT` socket, so every worker binds the same port; that socket
never accepts, so it receives no connection. It writes the ready file once every worker listens,
forwards SIGTERM / SIGINT to the workers and waits for them. A worker that exits on its own ends the
group (the others are stopped, the supervisor exits with the worker's status): the service manager
restarts the whole group rather than the supervisor hiding a crash loop.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("kvsched.gateway.workers")

STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL for a worker that does not stop (s)


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, non-listening `SO_REUSEPORT` socket on `host:port` (port 0 = a free port).

    Keeps the port for the workers without taking connections. Raises OSError when the address
    cannot be bound (e.g. held by another user's socket, or without SO_REUSEPORT)."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("this platform has no SO_REUSEPORT: run one gateway process per port instead of --workers")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((host, port))
    except OSError:
        s.close()
        raise
    return s


def _worker_argv(config: str, host: str, port: int, ready: Path, log_level: str) -> list[str]:
    return [sys.executable, "-m", "kvsched.gateway", "--config", config, "--host", host, "--port", str(port),
            "--reuse-port", "--ready-file", str(ready), "--log-level", log_level]


def supervise(config: str, host: str, port: int, workers: int, ready_file: str | None, log_level: str,
              start_timeout_s: float) -> int:
    """Run `workers` gateway processes on one port until SIGTERM / SIGINT; returns the exit status.

    Args:
        config: the gateway TOML path (each worker loads it).
        host / port: the shared listening address (port 0 = a free port, chosen here).
        workers: processes to run (>= 2).
        ready_file: written with the port once every worker listens.
        log_level: passed to the workers.
        start_timeout_s: how long a worker may take to listen (s): its connect wait for the daemon
            plus start-up.
    Returns:
        0 after a requested stop; otherwise the status of the worker that exited first (2 bad
        config, 3 daemon unavailable, as `kvsched-gateway` itself; 128 + the signal number when a
        signal killed it; 1 when it exited with 0 unasked), or 1 if one did not start in time.
    """
    reserved = reserve_port(host, port)
    port = reserved.getsockname()[1]
    stop = {"sig": None}

    def on_signal(signum, _frame) -> None:
        stop["sig"] = signum

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="kvsched-gateway-") as tmp:
        readies = [Path(tmp) / f"worker-{i}.port" for i in range(workers)]
        try:
            for ready in readies:
                procs.append(subprocess.Popen(_worker_argv(config, host, port, ready, log_level)))
            deadline = time.monotonic() + start_timeout_s
            announced = False
            while stop["sig"] is None:
                for proc in procs:
                    if proc.poll() is not None and stop["sig"] is None:  # not a Ctrl-C the worker saw too
                        log.error("gateway worker pid=%d exited with status %d; stopping the group", proc.pid,
                                  proc.returncode)
                        rc = proc.returncode
                        return 128 - rc if rc < 0 else (rc or 1)
                if not announced:
                    if all(r.exists() and r.read_text().strip() for r in readies):
                        announced = True
                        log.info("listening on http://%s:%d with %d worker processes pids=%s", host, port, workers,
                                 ",".join(str(p.pid) for p in procs))
                        if ready_file:
                            Path(ready_file).write_text(str(port))
                    elif time.monotonic() > deadline:
                        log.error("gateway workers not listening within %.0fs; stopping the group", start_timeout_s)
                        return 1
                time.sleep(0.05)
        finally:
            _stop_all(procs)
            reserved.close()
    return 0


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("gateway worker pid=%d did not stop within %.0fs; killing it", proc.pid, STOP_GRACE_S)
            proc.kill()
            proc.wait()


def default_workers() -> int:
    """CPUs this process may run on (`os.sched_getaffinity`), for `--workers 0`."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
