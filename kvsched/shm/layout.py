"""Shared-memory layout: header, struct-of-arrays dtypes, `LAYOUT_VERSION`, create/attach/validate
(docs/DESIGN.md §3.1).

Two named segments per daemon instance:

* ledger (`kvsched-<instance>-ledger`, mode 0640, written only by the daemon): one buffer holding
  the header, the worker table (`w_*`), the slot table (`s_*`), the block arena and the per-worker
  refcount index. `LedgerArrays` lays numpy views over it; every array starts on a 64-byte boundary.
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

import grp
import mmap
import os
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from ..errors import ShmLayoutError
from ..protocol import MAX_REQUEST_ID_BYTES
from .space import reserve_pages

LAYOUT_VERSION = 2  # 2: the progress segment holds a state word per slot after the progress words
PROGRESS_WORDS_PER_SLOT = 2  # progress word + state word
MAGIC = int.from_bytes(b"KVSCHED1", "little")  # u64 at header[0]
HEADER_WORDS = 16  # u64 words reserved for the header
_ALIGN = 64  # bytes; every array starts on a cache line

# header word indices
H_MAGIC, H_VERSION, H_EPOCH, H_MAX_WORKERS, H_MAX_SLOTS = 0, 1, 2, 3, 4
H_MAX_BLOCKS, H_REF_CAPACITY, H_BLOCK_SIZE, H_ARENA_BLOCKS, H_NBYTES = 5, 6, 7, 8, 9

CAPACITY_KEYS = ("max_workers", "max_slots", "max_blocks_per_request", "ref_capacity", "block_size")

# worker flags (w_flags bits)
FLAG_DRAINED, FLAG_OVERLOADED, FLAG_STALE = 1, 2, 4
# slot states (s_state)
SLOT_FREE, SLOT_ADMITTED, SLOT_DISPATCHED, SLOT_PREFILL_DONE = 0, 1, 2, 3

# (name, dtype, length-kind); kind: "W" = max_workers, "S" = max_slots, "A" = arena, "R" = W x ref_capacity
_FIELDS: tuple[tuple[str, Any, str], ...] = (
    ("w_present", np.uint8, "W"),
    ("w_worker_id", np.uint32, "W"),
    ("w_dp_rank", np.uint32, "W"),
    ("w_generation", np.uint32, "W"),
    ("w_total_kv_blocks", np.int64, "W"),  # blocks
    ("w_max_batched_tokens", np.int64, "W"),  # tokens
    ("w_active_blocks", np.int64, "W"),  # unique live blocks: distinct hashes + unhashed + decode
    ("w_active_prefill", np.int64, "W"),  # outstanding prefill tokens
    ("w_active_requests", np.int64, "W"),  # requests
    ("w_flags", np.uint8, "W"),  # bit0 drained, bit1 overloaded, bit2 stale
    ("s_state", np.uint8, "S"),  # 0 free, 1 admitted, 2 dispatched, 3 prefill_done
    ("s_generation", np.uint32, "S"),  # bumped at every reserve; 0 = never used
    ("s_worker_row", np.int32, "S"),
    ("s_worker_generation", np.uint32, "S"),
    ("s_isl", np.int64, "S"),  # tokens
    ("s_cached", np.int64, "S"),  # tokens
    ("s_prefill", np.int64, "S"),  # outstanding prefill tokens booked on the worker
    ("s_expected_osl", np.int64, "S"),  # tokens; -1 = unknown
    ("s_output_tokens", np.int64, "S"),  # last folded output tokens
    ("s_extra_blocks", np.int64, "S"),  # blocks booked outside the deduped hashes
    ("s_class", np.int32, "S"),
    ("s_enqueue_us", np.int64, "S"),
    ("s_admit_us", np.int64, "S"),
    ("s_arena_off", np.int64, "S"),  # index into arena
    ("s_arena_len", np.int32, "S"),  # hashes stored
    ("s_owner_pid", np.int64, "S"),
    ("s_request_id", f"S{MAX_REQUEST_ID_BYTES}", "S"),  # the wire limit; changing it changes the layout
    ("arena", np.uint64, "A"),
    ("ref_keys", np.uint64, "R"),
    ("ref_counts", np.int32, "R"),
)


_LEDGER_PREFIX, _LEDGER_SUFFIX = "kvsched-", "-ledger"


def ledger_name(instance: str) -> str:
    """Name of the ledger segment of `instance` (file /dev/shm/<name> on Linux)."""
    return f"{_LEDGER_PREFIX}{instance}{_LEDGER_SUFFIX}"


def ledger_instance(name: str) -> str | None:
    """The instance whose ledger segment is called `name` (inverse of `ledger_name`), or None when
    `name` is not a ledger segment name (routers read it from `Welcome.shm_ledger`)."""
    if len(name) > len(_LEDGER_PREFIX) + len(_LEDGER_SUFFIX) and name.startswith(_LEDGER_PREFIX) \
            and name.endswith(_LEDGER_SUFFIX):
        return name[len(_LEDGER_PREFIX):-len(_LEDGER_SUFFIX)]
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


def default_ref_capacity(max_workers: int, max_slots: int, max_blocks_per_request: int) -> int:
    """Per-worker refcount table size (entries, a power of two).

    next power of two >= 2 x (max_slots * max_blocks_per_request / max_workers), clamped to
    [1024, 1 << 20]: room for an even share of the whole arena at load factor <= 0.5. Pages of
    /dev/shm are touched lazily, so a large table costs memory only where rows are used.
    """
    want = max(1, (2 * max_slots * max_blocks_per_request) // max(1, max_workers))
    cap = 1 << (want - 1).bit_length()
    return int(min(max(cap, 1024), 1 << 20))


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _offsets(max_workers: int, max_slots: int, max_blocks_per_request: int, ref_capacity: int) -> tuple[dict[str, tuple[int, Any, tuple[int, ...]]], int]:
    """name -> (byte offset, dtype, shape), and the total size in bytes."""
    shapes = {
        "W": (max_workers,),
        "S": (max_slots,),
        "A": (max_slots * max_blocks_per_request,),
        "R": (max_workers, ref_capacity),
    }
    off = _align(HEADER_WORDS * 8)
    out: dict[str, tuple[int, Any, tuple[int, ...]]] = {}
    for name, dtype, kind in _FIELDS:
        dt = np.dtype(dtype)
        shape = shapes[kind]
        out[name] = (off, dt, shape)
        off = _align(off + dt.itemsize * int(np.prod(shape)))
    return out, off


def _check_capacities(max_workers: int, max_slots: int, max_blocks_per_request: int, ref_capacity: int, block_size: int) -> None:
    for name, v in (("max_workers", max_workers), ("max_slots", max_slots), ("max_blocks_per_request", max_blocks_per_request), ("block_size", block_size)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if ref_capacity < 2 or ref_capacity & (ref_capacity - 1):
        raise ValueError(f"ref_capacity must be a power of two >= 2, got {ref_capacity}")


class LedgerArrays:
    """Struct-of-arrays numpy views over one ledger buffer (shared segment or private memory).

    Attributes (capacities): max_workers, max_slots, max_blocks_per_request (= arena stride),
    ref_capacity (entries per worker row of the refcount index, power of two), block_size (tokens).
    Arrays: `header` uint64[16] plus one attribute per entry of `_FIELDS` (`w_*` length max_workers,
    `s_*` length max_slots, `arena` uint64[max_slots*max_blocks_per_request],
    `ref_keys` uint64[max_workers, ref_capacity], `ref_counts` int32[max_workers, ref_capacity]).

    Refcount index: linear probing from a mixed hash (splitmix64 finalizer) with at most
    `kernels.MAX_PROBE` probes and backward-shift deletion (no tombstones). An entry is occupied
    iff its count > 0, so every u64 key (0 included) is a valid hash. When no free entry is found
    in the probe window the block is counted as unique and not stored (see `kernels.ref_add`).

    Invariant: slot i owns arena[i*stride : i*stride + s_arena_len[i]], stride = max_blocks_per_request.
    """

    header: np.ndarray

    def __init__(self, buffer: Any, *, max_workers: int, max_slots: int, max_blocks_per_request: int, ref_capacity: int, block_size: int) -> None:
        _check_capacities(max_workers, max_slots, max_blocks_per_request, ref_capacity, block_size)
        self.max_workers = max_workers
        self.max_slots = max_slots
        self.max_blocks_per_request = max_blocks_per_request
        self.ref_capacity = ref_capacity
        self.block_size = block_size
        offsets, total = _offsets(max_workers, max_slots, max_blocks_per_request, ref_capacity)
        if len(memoryview(buffer).cast("B")) < total:
            raise ShmLayoutError(f"ledger buffer holds {len(memoryview(buffer).cast('B'))} bytes, layout needs {total}")
        self.header = np.frombuffer(buffer, dtype=np.uint64, count=HEADER_WORDS, offset=0)
        for name, (off, dt, shape) in offsets.items():
            arr = np.frombuffer(buffer, dtype=dt, count=int(np.prod(shape)), offset=off).reshape(shape)
            setattr(self, name, arr)
        self._buffer = buffer

    # -- header -------------------------------------------------------------------------------
    def write_header(self, epoch: int) -> None:
        """Stamp magic, version, epoch and capacities (creator only)."""
        h = self.header
        h[H_VERSION] = LAYOUT_VERSION
        h[H_EPOCH] = epoch
        h[H_MAX_WORKERS] = self.max_workers
        h[H_MAX_SLOTS] = self.max_slots
        h[H_MAX_BLOCKS] = self.max_blocks_per_request
        h[H_REF_CAPACITY] = self.ref_capacity
        h[H_BLOCK_SIZE] = self.block_size
        h[H_ARENA_BLOCKS] = self.max_slots * self.max_blocks_per_request
        h[H_NBYTES] = self.nbytes(self.max_workers, self.max_slots, self.max_blocks_per_request, self.ref_capacity)
        h[H_MAGIC] = MAGIC  # last: a reader seeing the magic sees the rest

    @property
    def epoch(self) -> int:
        """Daemon epoch (bumped by each daemon that attaches the segment)."""
        return int(self.header[H_EPOCH])

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.header[H_EPOCH] = value

    @property
    def capacities(self) -> dict[str, int]:
        return {k: int(getattr(self, k)) for k in CAPACITY_KEYS}

    @property
    def writable(self) -> bool:
        return bool(self.header.flags.writeable)

    @staticmethod
    def nbytes(max_workers: int, max_slots: int, max_blocks_per_request: int, ref_capacity: int, block_size: int = 1) -> int:
        """Total bytes of the ledger buffer for these capacities (block_size does not matter)."""
        return _offsets(max_workers, max_slots, max_blocks_per_request, ref_capacity)[1]

    @classmethod
    def private(cls, max_workers: int, max_slots: int, max_blocks_per_request: int, ref_capacity: int | None = None, block_size: int = 16, epoch: int = 1) -> "LedgerArrays":
        """A ledger over a zeroed, 64-byte-aligned private numpy buffer (tests, the virtual-time simulator)."""
        if ref_capacity is None:
            ref_capacity = default_ref_capacity(max_workers, max_slots, max_blocks_per_request)
        n = cls.nbytes(max_workers, max_slots, max_blocks_per_request, ref_capacity)
        raw = np.zeros(n + _ALIGN, np.uint8)  # zeroed; sliced so the base is 64-byte aligned like a mapping
        start = (-raw.ctypes.data) % _ALIGN
        buf = raw[start:start + n]
        arrays = cls(buf, max_workers=max_workers, max_slots=max_slots, max_blocks_per_request=max_blocks_per_request, ref_capacity=ref_capacity, block_size=block_size)
        arrays.write_header(epoch)
        return arrays

    @classmethod
    def from_header(cls, buffer: Any, expect: dict[str, int] | None = None, what: str = "ledger") -> "LedgerArrays":
        """Validate the header found in `buffer` and lay views over it.

        Raises:
            ShmLayoutError: bad magic, layout version, size, or a capacity differing from `expect`.
        """
        size = len(memoryview(buffer).cast("B"))
        if size < HEADER_WORDS * 8:
            raise ShmLayoutError(f"{what}: {size} bytes, too small for the header")
        h = np.frombuffer(buffer, dtype=np.uint64, count=HEADER_WORDS)
        if int(h[H_MAGIC]) != MAGIC:
            raise ShmLayoutError(f"{what}: bad magic {int(h[H_MAGIC]):#018x}, expected {MAGIC:#018x}")
        if int(h[H_VERSION]) != LAYOUT_VERSION:
            raise ShmLayoutError(f"{what}: layout version {int(h[H_VERSION])}, expected {LAYOUT_VERSION}")
        found = {
            "max_workers": int(h[H_MAX_WORKERS]),
            "max_slots": int(h[H_MAX_SLOTS]),
            "max_blocks_per_request": int(h[H_MAX_BLOCKS]),
            "ref_capacity": int(h[H_REF_CAPACITY]),
            "block_size": int(h[H_BLOCK_SIZE]),
        }
        for key, want in (expect or {}).items():
            if key not in found:
                raise ValueError(f"unknown capacity {key!r}; known: {CAPACITY_KEYS}")
            if want is not None and found[key] != int(want):
                raise ShmLayoutError(f"{what}: {key}={found[key]} in the segment, expected {want}")
        need = cls.nbytes(found["max_workers"], found["max_slots"], found["max_blocks_per_request"], found["ref_capacity"])
        if int(h[H_NBYTES]) != need or size < need:
            raise ShmLayoutError(f"{what}: size {size} bytes (header says {int(h[H_NBYTES])}), layout needs {need}")
        try:
            return cls(buffer, **found)
        except ValueError as exc:
            raise ShmLayoutError(f"{what}: {exc}") from exc


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
            try:
                handle.close()
            except BufferError:
                # numpy views still export the mapping: drop our reference (the mapping is unmapped
                # when the last view goes) so SharedMemory.__del__ does not retry and warn at exit.
                if getattr(handle, "_mmap", None) is not None:
                    handle._mmap = None
                fd = getattr(handle, "_fd", -1)
                if isinstance(fd, int) and fd >= 0:
                    os.close(fd)
                    handle._fd = -1
        self._handles = []

    def unlink(self) -> None:
        """Remove every named segment of the instance (other processes keep their mappings)."""
        unlink_segments(self.instance)


def _untrack(shm: SharedMemory) -> None:
    """Stop the resource tracker from unlinking `shm` when this process exits (docs/DESIGN.md §3.3)."""
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


def _unlink(shm: SharedMemory) -> None:
    """Unlink `shm`. `SharedMemory.unlink` unregisters from the tracker, so register first to keep
    the tracker's register/unregister pairs balanced (it warns on an unknown name)."""
    resource_tracker.register(shm._name, "shared_memory")  # type: ignore[attr-defined]
    shm.unlink()


def _set_mode(shm: SharedMemory, mode: int, group: int | str | None) -> None:
    fd = shm._fd  # type: ignore[attr-defined]
    if group is not None:
        gid = grp.getgrnam(group).gr_gid if isinstance(group, str) else int(group)
        os.fchown(fd, -1, gid)
    os.fchmod(fd, mode)


def _create(name: str, size: int, mode: int, group: int | str | None) -> SharedMemory:
    """Create segment `name` of `size` bytes, untracked, with its mode/group and every page reserved.

    Raises:
        FileExistsError: it exists. ShmSpaceError: /dev/shm has no room (the segment is removed).
    """
    shm = SharedMemory(name=name, create=True, size=size)
    _untrack(shm)
    try:
        _set_mode(shm, mode, group)
        reserve_pages(shm._fd, size, name)  # type: ignore[attr-defined]
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
    _check_capacities(max_workers, max_slots, max_blocks_per_request, ref_capacity, block_size)
    nbytes = LedgerArrays.nbytes(max_workers, max_slots, max_blocks_per_request, ref_capacity)
    ledger_shm = _create(ledger_name(instance), nbytes, ledger_mode, group)
    try:
        progress_shm = _create(progress_name(instance), progress_nbytes(max_slots), progress_mode, group)
    except BaseException:
        ledger_shm.close()
        _unlink(ledger_shm)
        raise
    arrays = LedgerArrays(ledger_shm.buf, max_workers=max_workers, max_slots=max_slots, max_blocks_per_request=max_blocks_per_request, ref_capacity=ref_capacity, block_size=block_size)
    arrays.write_header(epoch)
    progress, state = _word_views(progress_shm.buf, max_slots)
    return Segments(instance, arrays, progress, [ledger_shm, progress_shm], state=state)


def progress_nbytes(max_slots: int) -> int:
    """Bytes of the progress segment: `PROGRESS_WORDS_PER_SLOT` u64 words per slot."""
    return PROGRESS_WORDS_PER_SLOT * 8 * max_slots


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
    try:
        if writable_ledger or not os.path.isdir("/dev/shm"):
            ledger_shm = SharedMemory(name=ledger_name(instance))
            _untrack(ledger_shm)
            handles.append(ledger_shm)
            if writable_ledger:  # the daemon: a segment from an older start may still be sparse
                reserve_pages(ledger_shm._fd, ledger_shm.size, ledger_name(instance))  # type: ignore[attr-defined]
            buf: Any = ledger_shm.buf
        else:
            ro = _FileMap(ledger_name(instance))
            handles.append(ro)
            buf = ro.mm
        arrays = LedgerArrays.from_header(buf, expect, what=ledger_name(instance))
        if writable_ledger or not os.path.isdir("/dev/shm"):
            progress_shm = SharedMemory(name=progress_name(instance))
            _untrack(progress_shm)
            handles.append(progress_shm)
            if writable_ledger:
                reserve_pages(progress_shm._fd, progress_shm.size, progress_name(instance))  # type: ignore[attr-defined]
            size, words_buf = progress_shm.size, progress_shm.buf
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
            try:
                handle.close()
            except BufferError:
                pass
        raise
    return Segments(instance, arrays, progress, handles, state=state)


def unlink_segments(instance: str) -> None:
    """Remove every segment of `instance` (`segment_names`); missing ones are ignored."""
    for name in segment_names(instance):
        try:
            shm = SharedMemory(name=name)
        except FileNotFoundError:
            continue
        _untrack(shm)
        shm.close()
        _unlink(shm)
