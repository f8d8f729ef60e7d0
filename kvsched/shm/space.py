"""Room for the shared-memory segments: a free-space check before creating them and page reservation.

POSIX shared memory on Linux lives in the tmpfs mounted at `/dev/shm`. `ftruncate` (what
`SharedMemory(create=True)` does) only sets a segment's size: its pages are allocated on first
write. When the tmpfs is smaller than the segments (Docker gives a container 64 MiB unless run with
`--shm-size`), the process that first writes a page past the limit gets SIGBUS (Linux
`Documentation/filesystems/tmpfs.rst`: "if the size is exceeded ... SIGBUS"). The daemon therefore
checks the free space of the mount before creating its segments and reserves every page of each
segment with `posix_fallocate(3)`, which tmpfs implements by allocating the pages (or failing with
ENOSPC): a too-small `/dev/shm` is a start error naming the sizes, never a crash under load.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping

from ..errors import ShmLayoutError

SHM_DIR = "/dev/shm"  # where Linux's shm_open(3) keeps named segments


class ShmSpaceError(ShmLayoutError):
    """`/dev/shm` has less free space than the segments need.

    Attributes:
        needed: bytes the segments need; available: bytes free in the mount (statvfs f_bavail).
    """

    def __init__(self, message: str, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def free_bytes(path: str = SHM_DIR) -> int:
    """Bytes an unprivileged process may still allocate in the file system holding `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def space_message(needed: int, available: int, what: str) -> str:
    """The start error: the figures and the fixes (bigger /dev/shm, or smaller capacities)."""
    return (
        f"not enough shared memory in {SHM_DIR}: {what} need {_mib(needed)} ({needed} bytes), "
        f"{_mib(available)} ({available} bytes) available. In a container give it more "
        f"(docker run --shm-size={max(64, -(-needed * 5 // 4 // (1 << 20)))}m, or a Kubernetes emptyDir "
        f"volume with medium: Memory mounted at {SHM_DIR}), or lower daemon.max_slots, "
        f"daemon.max_blocks_per_request or daemon.max_workers"
    )


def check_free_space(sizes: Mapping[str, int], path: str = SHM_DIR) -> None:
    """Raise unless the mount holding `path` has room for every segment of `sizes` (name -> bytes).

    Raises:
        ShmSpaceError: sum(sizes) > free bytes; the message names both figures and each segment.
    """
    needed = sum(sizes.values())
    if not needed or not os.path.isdir(path):
        return
    available = free_bytes(path)
    if needed > available:
        parts = ", ".join(f"{name} {_mib(n)}" for name, n in sizes.items())
        raise ShmSpaceError(space_message(needed, available, f"the segments ({parts})"), needed, available)


def reserve_pages(fd: int, size: int, name: str) -> None:
    """Allocate every page of the segment open at `fd` (bytes [0, size)) now, not on first write.

    Pages already allocated (a re-attached segment) are kept with their contents.

    Raises:
        ShmSpaceError: the file system has no room left for them (ENOSPC), with needed and free bytes.
        OSError: any other failure of posix_fallocate.
    """
    if size <= 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        available = free_bytes(SHM_DIR) if os.path.isdir(SHM_DIR) else 0
        raise ShmSpaceError(space_message(size, available, f"segment {name}"), size, available) from exc
