"""Run `kvsched-daemon` as a child process (tests, `kvsched replay`, scripts).

The child prints `KVSCHED_READY <endpoint> <admin_endpoint>` on stdout once it is ready (the same
moment it sends READY=1 to systemd); `DaemonProcess.start` waits for that line, calling
`on_wait(elapsed_s)` about once a second meanwhile (the first start on a machine compiles the numba
kernels: about a minute on a busy 2-core machine; cached afterwards, README "Quick start"). Logs go
to `<runtime_dir>/<instance>.log` unless `log_path` says otherwise.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import DaemonUnavailable


class DaemonProcess:
    """Handle on a running daemon child.

    Attributes:
        endpoint / admin_endpoint: the sockets it bound (ipc paths inside `runtime_dir`).
        pid: process id. log_path: its stderr log.
    """

    def __init__(
        self,
        proc: subprocess.Popen,
        endpoint: str,
        admin_endpoint: str,
        log_path: Path,
        argv: list[str],
        env: dict[str, str],
    ) -> None:
        self.proc = proc
        self.endpoint = endpoint
        self.admin_endpoint = admin_endpoint
        self.log_path = log_path
        self.argv = argv
        self.env = env

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def instance(self) -> str:
        """The `--instance` name it was started with (names its shm segments)."""
        return self.argv[self.argv.index("--instance") + 1]

    @classmethod
    def start(
        cls,
        config_path: str | os.PathLike[str] | None,
        *,
        instance: str,
        runtime_dir: Path,
        extra_args: list[str] | tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 60.0,
        log_path: Path | None = None,
        on_wait: Callable[[float], None] | None = None,
    ) -> DaemonProcess:
        """Start a daemon with private ipc endpoints in `runtime_dir` and wait until it is ready.

        `log_path`: its stderr (appended; default `<runtime_dir>/<instance>.log`). `on_wait`: called
        with the seconds waited so far, about once a second, until it is ready (progress display).

        Raises:
            DaemonUnavailable: it exited or did not become ready within `ready_timeout_s` (the
                message includes the tail of its log).
        """
        runtime_dir = Path(runtime_dir)
        runtime_dir.mkdir(parents=True, exist_ok=True)
        endpoint = f"ipc://{runtime_dir}/{instance}.sock"
        admin = f"ipc://{runtime_dir}/{instance}-admin.sock"
        argv = [
            sys.executable,
            "-m",
            "kvsched.daemon.app",
            "--instance",
            instance,
            "--endpoint",
            endpoint,
            "--admin-endpoint",
            admin,
            *extra_args,
        ]
        if config_path is not None:
            argv += ["--config", str(config_path)]
        child_env = dict(os.environ if env is None else env)
        child_env.pop("KVSCHED_ENDPOINT", None)
        child_env.pop("KVSCHED_ADMIN_ENDPOINT", None)
        log_path = Path(log_path) if log_path is not None else runtime_dir / f"{instance}.log"
        handle = cls(cls._spawn(argv, child_env, log_path), endpoint, admin, log_path, argv, child_env)
        try:
            handle.wait_ready(ready_timeout_s, on_wait)
        except BaseException:  # e.g. Ctrl-C while waiting: the caller never gets a handle to stop it with
            handle.kill()
            raise
        return handle

    @staticmethod
    def _spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
        with open(log_path, "ab") as log_fh:  # the child has its own copy of the descriptor
            return subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=log_fh, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )

    def restart(self, ready_timeout_s: float = 60.0) -> None:
        """Start the same command again (after `kill()` or `stop()`), and wait until ready."""
        self.proc = self._spawn(self.argv, self.env, self.log_path)
        self.wait_ready(ready_timeout_s)

    def wait_ready(self, timeout_s: float = 60.0, on_wait: Callable[[float], None] | None = None) -> None:
        """Block until the child printed its ready line; `on_wait(elapsed_s)` about once a second meanwhile.

        Raises:
            DaemonUnavailable: it exited first (or right after its ready line:
                tests/daemon/test_ready_then_dead.py), or `timeout_s` passed (then it is SIGKILLed).
        """
        box: list[bytes] = []

        def reader() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if line.startswith(b"KVSCHED_READY"):
                    box.append(line)
                    return

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        start = time.monotonic()
        while t.is_alive():
            left = timeout_s - (time.monotonic() - start)
            if left <= 0:
                break
            t.join(min(1.0, left))
            if t.is_alive() and on_wait is not None:
                on_wait(time.monotonic() - start)
        if box:  # ready, unless it died since: its line stays readable in the pipe after it exits
            code = self.proc.poll()
            if code is None:
                return
            self.kill()
            raise DaemonUnavailable(
                f"daemon exited with code {code} right after it was ready; log {self.log_path}:\n{self.log_tail()}"
            )
        if not t.is_alive():  # its stdout closed: it is exiting; let it finish so its code is known
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
        code = self.proc.poll()
        self.kill()
        why = f"exited with code {code}" if code is not None else f"was not ready within {timeout_s:.0f}s"
        raise DaemonUnavailable(f"daemon {why}; log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM and wait; SIGKILL after `timeout_s`. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_pipe()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL (crash simulation): segments and socket files stay behind."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close_pipe()

    def _close_pipe(self) -> None:
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        time.sleep(0)
