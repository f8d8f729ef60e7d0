"""One daemon per instance: an exclusive `flock` on `/dev/shm/kvsched-<instance>.lock`.

The lock lives beside the instance's segments (same namespace as what it protects) and is released
by the kernel when the holder exits, even on SIGKILL, so a crashed daemon never blocks its restart.
A second daemon with the same instance name, or `--purge` while the daemon runs, is refused with a
message naming the holder's pid (so `--purge` never removes a running daemon's segments or sockets).
The file is removed by its holder on the way out (a clean stop,
`purge_instance`); a process that locked a file unlinked meanwhile retries on the new one, so the
removal never lets two holders in (the usual open / flock / check-the-path's-inode sequence).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigError
from ..shm.segments import segment_names, unlink_segments
from .sockets import remove_stale_ipc

LOCK_DIR = Path("/dev/shm")


def lock_path(instance: str) -> Path:
    return LOCK_DIR / f"kvsched-{instance}.lock"


class InstanceLock:
    """Hold the instance lock for the lifetime of this object (`release()` or process exit).

    Raises:
        ConfigError: another live process holds the lock (message names its pid).
    """

    def __init__(self, instance: str) -> None:
        self.path = lock_path(instance)
        self.instance = instance
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise ConfigError(
                    f"instance {instance!r} is already running (pid {holder}); stop it first or use another --instance"
                ) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # its holder unlinked it before we locked it: lock the path's new file
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        """Unlock and remove the lock file (only while we still hold it)."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    """True when `path` still names the file open as `fd` (it was not unlinked or replaced)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def purge_instance(instance: str, endpoints: Sequence[str] = ()) -> list[str]:
    """Remove a stopped instance's shared-memory segments, its lock file and the ipc socket files its
    `endpoints` left (a daemon killed without a clean stop leaves them in the discovery directory).

    Args:
        instance: the instance name.
        endpoints: the data and admin endpoints its daemon binds (`endpoints.daemon_endpoints`);
            tcp ones are skipped. A socket file is removed only when no process listens on it
            (`sockets.remove_stale_ipc`).
    Returns:
        the names (under /dev/shm) of the segments that existed, in `segment_names` order, then the
        paths of the socket files removed.
    Raises:
        ConfigError: the instance's daemon is running (the message names its pid); nothing is removed.
    """
    lock = InstanceLock(instance)
    try:
        found = [n for n in segment_names(instance) if (LOCK_DIR / n).exists()]
        unlink_segments(instance)
        found += [str(path) for path in map(remove_stale_ipc, endpoints) if path is not None]
    finally:
        lock.release()  # unlinks the lock file
    return found
