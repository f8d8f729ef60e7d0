"""The named shared-memory segments of a daemon instance: their names, creation with mode, group and
every page reserved, attachment with validation, unmapping and removal (docs/DESIGN.md §3.1; the
bytes inside them are `kvsched.shm.layout`'s).

Three named segments per daemon instance:

* ledger (`kvsched-<instance>-ledger`, mode 0640, written only by the daemon): the header, worker
  table, slot table, block arena and refcount index that `layout.LedgerArrays` lays views over.
* progress (`kvsched-<instance>-progress`, mode 0660): `uint64[2 * max_slots]`, two words per slot,
  each written only by the router holding that slot's lease: words [0, max_slots) are the progress
  words (output tokens, see `kvsched.shm.progress`), words [max_slots, 2 * max_slots) the state
  words (dispatched / prefill_done, see `kvsched.shm.words`). Layout version 2 added the state words;
  a version-1 progress segment held the progress words only.
* kv index (`kvsched-<instance>-kvindex`, mode 0640, daemon only): the event-fed overlap indexes and
  each KV-event stream's last applied seq (`kvsched.shm.kv_index`), so a restart keeps the cache view.

Room: the daemon reserves every page of its segments when it creates or re-attaches them
(`kvsched.shm.space`), so a too-small /dev/shm fails the start instead of raising SIGBUS later.

Lifetime: segments outlive the processes. Python 3.11's resource tracker would unlink every segment
a process created or attached when it exits (even after SIGKILL), so every create/attach here
unregisters the segment from the tracker immediately. Only `unlink_segments` removes them.

Read-only clients: `attach_segments(..., writable_ledger=False)` maps the ledger through a read-only
file descriptor (`PROT_READ`), so its arrays are read-only numpy views; a write raises ValueError.
"""

from __future__ import annotations

import _posixshmem  # the stdlib's shm_open/shm_unlink, what SharedMemory itself calls
import contextlib
import grp
import mmap
import os
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from ..errors import ShmLayoutError
from .layout import PROGRESS_WORDS_PER_SLOT, LedgerArrays, check_capacities, default_ref_capacity, progress_nbytes
from .space import reserve_pages

_LEDGER_PREFIX, _LEDGER_SUFFIX = "kvsched-", "-ledger"


def ledger_name(instance: str) -> str:
    """Name of the ledger segment of `instance` (file /dev/shm/<name> on Linux)."""
    return f"{_LEDGER_PREFIX}{instance}{_LEDGER_SUFFIX}"


def ledger_instance(name: str) -> str | None:
    """The instance whose ledger segment is called `name` (inverse of `ledger_name`), or None when
    `name` is not a ledger segment name (routers read it from `Welcome.shm_ledger`)."""
    if (
        len(name) > len(_LEDGER_PREFIX) + len(_LEDGER_SUFFIX)
        and name.startswith(_LEDGER_PREFIX)
        and name.endswith(_LEDGER_SUFFIX)
    ):
        return name[len(_LEDGER_PREFIX) : -len(_LEDGER_SUFFIX)]
    return None


def progress_name(instance: str) -> str:
    """Name of the progress segment of `instance`."""
    return f"kvsched-{instance}-progress"


def kv_index_name(instance: str) -> str:
    """Name of the KV-index segment of `instance` (event-fed overlap indexes + stream seqs)."""
    return f"kvsched-{instance}-kvindex"


def segment_names(instance: str) -> tuple[str, ...]:
    """Every segment `instance` may own (what `unlink_segments` and `--purge` remove)."""
    return (ledger_name(instance), progress_name(instance), kv_index_name(instance))


@dataclass
class Segments:
    """The two mapped segments of one instance.

    Attributes:
        instance: instance name.
        ledger: views over the ledger segment (read-only arrays if attached read-only).
        progress: uint64[max_slots] progress words (always writable).
        state: uint64[max_slots] state words (always writable; the second half of the progress
            segment).
    """

    instance: str
    ledger: LedgerArrays
    progress: np.ndarray
    _handles: list[Any]
    kv_index: Any = None  # the daemon's `kvsched.shm.kv_index.KvIndexSegment`, closed with the rest
    kv_index_restored: bool = False  # its contents were kept from the previous daemon
    state: np.ndarray | None = None  # uint64[max_slots] state words (the progress segment's second half)

    def close(self) -> None:
        """Unmap this process's mappings. A mapping still exported to live numpy views stays until
        those views are collected (BufferError is swallowed); the segments themselves remain."""
        if self.kv_index is not None:
            self.kv_index.close()
            self.kv_index = None
        for handle in self._handles:
            handle.close()  # `SegmentHandle.close` / `_FileMap.close`: never raises BufferError
        self._handles = []

    def unlink(self) -> None:
        """Remove every named segment of the instance (other processes keep their mappings)."""
        unlink_segments(self.instance)


class SegmentHandle(SharedMemory):
    """The daemon's mapping of one named segment: a `SharedMemory` whose file descriptor it uses (mode,
    group, page reservation) and whose `close` leaves a mapping that numpy views still export to them.

    Build it as `SharedMemory` (`SegmentHandle(name=..., create=..., size=...)`); `_untrack` it at once.
    """

    _fd: int  # SharedMemory's descriptor and mapping (set by its __init__, undeclared in its stubs)
    _mmap: mmap.mmap | None

    @property
    def fd(self) -> int:
        """The segment's file descriptor (-1 once closed)."""
        return self._fd

    def close(self) -> None:
        """Unmap and close the descriptor. When numpy views still export the mapping (BufferError), the
        mapping is left to them (unmapped when the last view goes) and only the descriptor is closed, so
        `SharedMemory.__del__` does not retry and warn at exit."""
        try:
            super().close()
        except BufferError:
            self._mmap = None
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def mapped_view(shm: SharedMemory) -> memoryview:
    """The bytes of an open segment (`SharedMemory.buf`). Raises ValueError once it is closed."""
    buf = shm.buf
    if buf is None:
        raise ValueError(f"segment {shm.name} is closed")
    return buf


def _tracked_name(shm: SharedMemory) -> str:
    """The name `SharedMemory` gives the resource tracker: the POSIX name, with its leading slash."""
    return "/" + shm.name


def _untrack(shm: SharedMemory) -> None:
    """Stop the resource tracker from unlinking `shm` when this process exits (docs/DESIGN.md §3.3)."""
    resource_tracker.unregister(_tracked_name(shm), "shared_memory")


def _unlink(shm: SharedMemory) -> None:
    """Unlink `shm`. `SharedMemory.unlink` unregisters from the tracker, so register first to keep
    the tracker's register/unregister pairs balanced (it warns on an unknown name)."""
    resource_tracker.register(_tracked_name(shm), "shared_memory")
    shm.unlink()


def _set_mode(shm: SegmentHandle, mode: int, group: int | str | None) -> None:
    if group is not None:
        gid = grp.getgrnam(group).gr_gid if isinstance(group, str) else int(group)
        os.fchown(shm.fd, -1, gid)
    os.fchmod(shm.fd, mode)


def _create(name: str, size: int, mode: int, group: int | str | None) -> SegmentHandle:
    """Create segment `name` of `size` bytes, untracked, with its mode/group and every page reserved.

    Raises:
        FileExistsError: it exists. ShmSpaceError: /dev/shm has no room (the segment is removed).
    """
    shm = SegmentHandle(name=name, create=True, size=size)
    _untrack(shm)
    try:
        _set_mode(shm, mode, group)
        reserve_pages(shm.fd, size, name)
    except BaseException:
        shm.close()
        _unlink(shm)
        raise
    return shm


def create_segments(
    instance: str,
    *,
    max_workers: int,
    max_slots: int,
    max_blocks_per_request: int,
    ref_capacity: int | None = None,
    block_size: int,
    epoch: int,
    ledger_mode: int = 0o640,
    progress_mode: int = 0o660,
    group: int | str | None = None,
) -> Segments:
    """Create and initialise both segments of `instance`.

    Args:
        ref_capacity: refcount entries per worker row; None = `default_ref_capacity(...)`.
        epoch: daemon epoch stamped in the header.
        ledger_mode / progress_mode: file modes set explicitly (the stdlib creates 0600).
        group: group name or gid given to both segments (None = the creator's).
    Raises:
        FileExistsError: a segment with either name exists (the daemon then attaches instead).
    """
    if ref_capacity is None:
        ref_capacity = default_ref_capacity(max_workers, max_slots, max_blocks_per_request)
    check_capacities(max_workers, max_slots, max_blocks_per_request, ref_capacity, block_size)
    nbytes = LedgerArrays.nbytes(max_workers, max_slots, max_blocks_per_request, ref_capacity)
    ledger_shm = _create(ledger_name(instance), nbytes, ledger_mode, group)
    try:
        progress_shm = _create(progress_name(instance), progress_nbytes(max_slots), progress_mode, group)
    except BaseException:
        ledger_shm.close()
        _unlink(ledger_shm)
        raise
    arrays = LedgerArrays(
        mapped_view(ledger_shm),
        max_workers=max_workers,
        max_slots=max_slots,
        max_blocks_per_request=max_blocks_per_request,
        ref_capacity=ref_capacity,
        block_size=block_size,
    )
    arrays.write_header(epoch)
    progress, state = _word_views(mapped_view(progress_shm), max_slots)
    return Segments(instance, arrays, progress, [ledger_shm, progress_shm], state=state)


def _word_views(buf: Any, max_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(progress words, state words): two uint64[max_slots] views over the progress segment."""
    words = np.frombuffer(buf, dtype=np.uint64, count=PROGRESS_WORDS_PER_SLOT * max_slots)
    return words[:max_slots], words[max_slots:]


class _FileMap:
    """A shared mapping of /dev/shm/<name>, read-only unless `writable` (routers).

    Routers map their segments this way rather than through `SharedMemory`, which registers every
    segment with multiprocessing's resource tracker: router processes that share one tracker (the
    children of one multiprocessing parent) then race register/unregister pairs and the tracker
    prints KeyError tracebacks. Plain mmap involves no tracker.
    """

    def __init__(self, name: str, writable: bool = False) -> None:
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR if writable else os.O_RDONLY)
        try:
            self.size = os.fstat(fd).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self.mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Unmap; a mapping numpy views still export stays until they go (BufferError swallowed)."""
        with contextlib.suppress(BufferError):
            self.mm.close()


def attach_segments(instance: str, *, expect: dict[str, int] | None = None, writable_ledger: bool = False) -> Segments:
    """Map the existing segments of `instance` and validate them.

    Args:
        expect: capacities the caller requires (keys from `CAPACITY_KEYS`), or None to accept any.
        writable_ledger: True for the daemon; False maps the ledger read-only (routers).
    Raises:
        FileNotFoundError: a segment is missing.
        ShmLayoutError: magic, layout version, size or a capacity does not match.
    """
    handles: list[Any] = []
    arrays: LedgerArrays | None  # None in the error path: the views go before their mappings close
    progress: np.ndarray | None
    state: np.ndarray | None
    words_buf: memoryview | mmap.mmap
    try:
        if writable_ledger or not os.path.isdir("/dev/shm"):
            ledger_shm = SegmentHandle(name=ledger_name(instance))
            _untrack(ledger_shm)
            handles.append(ledger_shm)
            if writable_ledger:  # the daemon: a segment from an older start may still be sparse
                reserve_pages(ledger_shm.fd, ledger_shm.size, ledger_name(instance))
            buf: Any = mapped_view(ledger_shm)
        else:
            ro = _FileMap(ledger_name(instance))
            handles.append(ro)
            buf = ro.mm
        arrays = LedgerArrays.from_header(buf, expect, what=ledger_name(instance))
        if writable_ledger or not os.path.isdir("/dev/shm"):
            progress_shm = SegmentHandle(name=progress_name(instance))
            _untrack(progress_shm)
            handles.append(progress_shm)
            if writable_ledger:
                reserve_pages(progress_shm.fd, progress_shm.size, progress_name(instance))
            size, words_buf = progress_shm.size, mapped_view(progress_shm)
        else:  # a router: its slot's words are written through a plain shared mapping
            rw = _FileMap(progress_name(instance), writable=True)
            handles.append(rw)
            size, words_buf = rw.size, rw.mm
        if size < progress_nbytes(arrays.max_slots):
            raise ShmLayoutError(f"{progress_name(instance)}: {size} bytes, need {progress_nbytes(arrays.max_slots)}")
        progress, state = _word_views(words_buf, arrays.max_slots)
    except BaseException:
        arrays = progress = state = None  # drop views before closing
        for handle in handles:
            with contextlib.suppress(BufferError):
                handle.close()
        raise
    return Segments(instance, arrays, progress, handles, state=state)


def ledger_uninitialised(instance: str) -> bool:
    """True when `instance`'s ledger segment exists but its header was never written: shorter than
    the magic word (killed before its size was set) or magic 0. `create_segments` writes the magic
    last, after both segments exist and every page is reserved, so such a ledger is what a start
    killed mid-creation leaves (with or without its progress segment); no daemon attached it and no
    router can have (routers validate the magic), so it holds no lease. A nonzero foreign magic is
    not "uninitialised": `attach_segments` reports it.

    Returns:
        False when the ledger segment does not exist or has a nonzero magic.
    """
    name = ledger_name(instance)
    if os.path.isdir("/dev/shm"):
        try:
            fd = os.open(f"/dev/shm/{name}", os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            head = os.pread(fd, 8, 0)
        finally:
            os.close(fd)
    else:
        try:
            shm = SharedMemory(name=name)
        except FileNotFoundError:
            return False
        except ValueError:  # an empty segment cannot be mapped: its size was never set
            return True
        _untrack(shm)
        head = bytes(mapped_view(shm)[:8])
        shm.close()
    return len(head) < 8 or int.from_bytes(head, "little") == 0


def unlink_segment(name: str) -> None:
    """Remove the segment `name` (under /dev/shm); a missing one is ignored, an empty one (size never
    set: a creation killed before its ftruncate, which cannot be mapped) is unlinked by name."""
    try:
        shm = SharedMemory(name=name)
    except FileNotFoundError:
        return
    except ValueError:  # "cannot mmap an empty file"
        with contextlib.suppress(FileNotFoundError):
            _posixshmem.shm_unlink("/" + name)
        return
    _untrack(shm)
    shm.close()
    _unlink(shm)


def unlink_segments(instance: str) -> None:
    """Remove every segment of `instance` (`segment_names`, `unlink_segment` each)."""
    for name in segment_names(instance):
        unlink_segment(name)
