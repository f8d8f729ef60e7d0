"""sd_notify: READY / STATUS / WATCHDOG / STOPPING datagrams to `$NOTIFY_SOCKET` (systemd `Type=notify`).

Written against the documented datagram protocol (sd_notify(3)); no libsystemd needed. Outside systemd
(`NOTIFY_SOCKET` unset) every call is a no-op. The watchdog is pinged from the actor's own timer, so a
stuck loop stops pinging and systemd restarts the daemon (docs/DESIGN.md §7.1).
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger(__name__)


class Notifier:
    """One datagram socket to systemd's notify socket.

    Args:
        env: environment mapping (default `os.environ`): reads `NOTIFY_SOCKET` and `WATCHDOG_USEC`.
    Attributes:
        watchdog_interval_s: half of `WATCHDOG_USEC` in seconds, or None when no watchdog is set.
    """

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env)
        addr = env.get("NOTIFY_SOCKET", "")
        self._addr: str | bytes | None = None
        if addr:
            self._addr = "\0" + addr[1:] if addr.startswith("@") else addr
        usec = env.get("WATCHDOG_USEC")
        self.watchdog_interval_s = int(usec) / 2e6 if usec and usec.isdigit() and int(usec) > 0 else None
        self._sock: socket.socket | None = None
        self._last_ping = 0.0

    def send(self, state: str) -> None:
        """Send one notification (e.g. "READY=1\\nSTATUS=serving"); errors are logged, never raised."""
        if self._addr is None:
            return
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(state.encode(), self._addr)
        except OSError as exc:
            log.warning("sd_notify failed state=%s error=%s", state.split("\n", 1)[0], exc)

    def ready(self, status: str) -> None:
        self.send(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def stopping(self) -> None:
        self.send("STOPPING=1")

    def watchdog_tick(self) -> None:
        """Called from the actor's timer: sends WATCHDOG=1 at most every `watchdog_interval_s`."""
        if self.watchdog_interval_s is None:
            return
        now = time.monotonic()
        if now - self._last_ping >= self.watchdog_interval_s:
            self._last_ping = now
            self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
