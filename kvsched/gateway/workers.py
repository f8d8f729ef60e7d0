"""`kvsched-gateway --workers N`: N gateway processes serving one listening socket.

One gateway process is one event loop on one core (its CPU per streamed request: docs/BENCHMARKS.md,
`bench/bench_gateway.py`). For more throughput on a host with cores to spare, the supervisor started
here binds and listens on `host:port` itself, as a single gateway would (`SO_REUSEADDR`, no
`SO_REUSEPORT`), and starts N ordinary gateway processes that inherit that socket and accept on it:
the kernel hands each new connection to one of them. Each worker is a complete gateway with its own
`SchedulerClient` (one router of the daemon per process, as the daemon expects: docs/GATEWAY.md
"Run it").

Why one inherited socket and not one `SO_REUSEPORT` socket per worker: Linux lets any socket of the
same user that also sets `SO_REUSEPORT` join a port's group (socket(7)), so a second `--workers`
gateway on the same port would silently take half of the connections. A socket bound without
`SO_REUSEPORT` makes every later bind of the port fail (EADDRINUSE), whoever tries.

The supervisor holds no connection and serves nothing. Workers report readiness on an inherited
pipe (no files), and die with their supervisor (`PR_SET_PDEATHSIG` on Linux, else a parent-pid
watch), so a SIGKILLed supervisor leaves neither orphan listeners nor files behind. It forwards
SIGTERM / SIGINT to the workers and waits for them. A worker that exits on its own ends the group
(the others are stopped, the supervisor exits with the worker's status): the service manager
restarts the whole group rather than the supervisor hiding a crash loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .listen import host_port

log = logging.getLogger("kvsched.gateway.workers")

STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL for a worker that does not stop (s)
PARENT_POLL_S = 0.5  # parent-pid watch period where PR_SET_PDEATHSIG is unavailable (s)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass
class WorkerLink:
    """What a worker inherits from its supervisor: the hidden `--worker-of PID:LISTEN_FD:READY_FD`.

    supervisor_pid: the supervisor's pid (the worker exits when it is gone). listen_fd: the shared
    listening socket. ready_fd: the write end of the readiness pipe (one line per worker)."""

    supervisor_pid: int
    listen_fd: int
    ready_fd: int

    @classmethod
    def parse(cls, text: str) -> WorkerLink:
        """argparse type of `--worker-of`; raises ValueError for anything but three integers."""
        pid, listen_fd, ready_fd = (int(x) for x in text.split(":"))
        return cls(pid, listen_fd, ready_fd)

    def arg(self) -> str:
        return f"{self.supervisor_pid}:{self.listen_fd}:{self.ready_fd}"

    def attach(self) -> socket.socket:
        """Arrange to get SIGTERM when the supervisor dies, then return the inherited listening socket.

        Raises SystemExit(1) when the supervisor is already gone (the worker must not serve alone)."""
        _die_with_parent(self.supervisor_pid)
        return socket.socket(fileno=self.listen_fd)

    def announce(self, port: int) -> None:
        """Tell the supervisor this worker listens (one line "PID PORT" on the readiness pipe)."""
        os.write(self.ready_fd, f"{os.getpid()} {port}\n".encode())
        os.close(self.ready_fd)


def _die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when `parent_pid` (its parent) exits: PR_SET_PDEATHSIG on Linux, otherwise
    a daemon thread polling os.getppid() every PARENT_POLL_S seconds."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            armed = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent_pid:  # it died before prctl: no signal will come
        raise SystemExit(f"kvsched-gateway worker: supervisor pid {parent_pid} is gone; exiting")
    if not armed:

        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(PARENT_POLL_S)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="kvsched-parent-watch", daemon=True).start()


def _worker_argv(config: str, host: str, port: int, link: WorkerLink, log_level: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvsched.gateway",
        "--config",
        config,
        "--host",
        host,
        "--port",
        str(port),
        "--worker-of",
        link.arg(),
        "--log-level",
        log_level,
    ]


def supervise(
    config: str, sock: socket.socket, workers: int, ready_file: str | None, log_level: str, start_timeout_s: float
) -> int:
    """Run `workers` gateway processes on the listening socket `sock` until SIGTERM / SIGINT.

    Args:
        config: the gateway TOML path (each worker loads it).
        sock: the listening socket (`listen_socket`); closed here on return.
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
    host, port = sock.getsockname()[:2]
    stop = {"sig": None}

    def on_signal(signum, _frame) -> None:
        stop["sig"] = signum

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    procs: list[subprocess.Popen] = []
    ready_r, ready_w = os.pipe()
    os.set_blocking(ready_r, False)
    link = WorkerLink(os.getpid(), sock.fileno(), ready_w)
    try:
        for _ in range(workers):
            procs.append(
                subprocess.Popen(_worker_argv(config, host, port, link, log_level), pass_fds=(sock.fileno(), ready_w))
            )
        os.close(ready_w)
        ready_w = -1
        deadline = time.monotonic() + start_timeout_s
        lines, announced = b"", False
        while stop["sig"] is None:
            for proc in procs:
                if proc.poll() is not None and stop["sig"] is None:  # not a Ctrl-C the worker saw too
                    log.error(
                        "gateway worker pid=%d exited with status %d; stopping the group", proc.pid, proc.returncode
                    )
                    rc = proc.returncode
                    return 128 - rc if rc < 0 else (rc or 1)
            if not announced:
                with contextlib.suppress(BlockingIOError):
                    lines += os.read(ready_r, 4096)
                if lines.count(b"\n") >= workers:
                    announced = True
                    log.info(
                        "listening on http://%s with %d worker processes pids=%s",
                        host_port(host, port),
                        workers,
                        ",".join(str(p.pid) for p in procs),
                    )
                    if ready_file:
                        Path(ready_file).write_text(str(port))
                elif time.monotonic() > deadline:
                    log.error("gateway workers not listening within %.0fs; stopping the group", start_timeout_s)
                    return 1
            time.sleep(0.05)
    finally:
        _stop_all(procs)
        sock.close()
        os.close(ready_r)
        if ready_w >= 0:
            os.close(ready_w)
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
