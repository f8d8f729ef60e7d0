"""Shared-memory layout: header, struct-of-arrays dtypes, `LAYOUT_VERSION`, sizes, the views and
their validation (docs/DESIGN.md §3.1). The named segments that hold these bytes — names, create,
attach, unlink — are `kvsched.shm.segments`'.

The ledger is one buffer holding the header, the worker table (`w_*`), the slot table (`s_*`), the
block arena and the per-worker refcount index. `LedgerArrays` lays numpy views over it (a shared
segment or private memory); every array starts on a 64-byte boundary. The progress segment is
`uint64[PROGRESS_WORDS_PER_SLOT * max_slots]`: the progress words, then the state words
(`progress_nbytes`).

The layout's constants (header word indices, worker flags, slot states) are plain module-level ints:
the numba kernels read them as globals, frozen when a kernel compiles.

`kvsched.shm.layout` still answers for the names that moved to `kvsched.shm.segments` (`ledger_name`,
`attach_segments`, `Segments`, ...), loading that module on first use.
"""

from __future__ import annotations

from typing import Annotated, Any, get_args, get_origin, get_type_hints

import numpy as np
import numpy.typing as npt

from ..errors import ShmLayoutError
from ..protocol import MAX_REQUEST_ID_BYTES

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


def array_fields(cls: type) -> tuple[tuple[str, np.dtype[Any], str], ...]:
    """(name, dtype, length kind) of each `Annotated[npt.NDArray[scalar], kind, *itemsize]` attribute of
    `cls`, in declaration order: the class body states a segment's layout once, for numpy (the views
    laid at run time) and for the type checker alike. A byte-string field (`np.bytes_`) names its item
    size after the kind."""
    out = []
    for name, hint in get_type_hints(cls, include_extras=True).items():
        if get_origin(hint) is not Annotated:
            continue
        array_type, kind, *itemsize = get_args(hint)
        (scalar,) = get_args(get_args(array_type)[1])  # NDArray[s] = ndarray[shape, dtype[s]]
        out.append((name, np.dtype((scalar, *itemsize)) if itemsize else np.dtype(scalar), kind))
    return tuple(out)


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


def _offsets(
    max_workers: int, max_slots: int, max_blocks_per_request: int, ref_capacity: int
) -> tuple[dict[str, tuple[int, Any, tuple[int, ...]]], int]:
    """name -> (byte offset, dtype, shape), and the total size in bytes."""
    shapes = {
        "W": (max_workers,),
        "S": (max_slots,),
        "A": (max_slots * max_blocks_per_request,),
        "R": (max_workers, ref_capacity),
    }
    off = _align(HEADER_WORDS * 8)
    out: dict[str, tuple[int, Any, tuple[int, ...]]] = {}
    for name, dt, kind in _FIELDS:
        shape = shapes[kind]
        out[name] = (off, dt, shape)
        off = _align(off + dt.itemsize * int(np.prod(shape)))
    return out, off


def check_capacities(
    max_workers: int, max_slots: int, max_blocks_per_request: int, ref_capacity: int, block_size: int
) -> None:
    """Raise ValueError for a capacity below 1 or a `ref_capacity` that is not a power of two >= 2."""
    for name, v in (
        ("max_workers", max_workers),
        ("max_slots", max_slots),
        ("max_blocks_per_request", max_blocks_per_request),
        ("block_size", block_size),
    ):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if ref_capacity < 2 or ref_capacity & (ref_capacity - 1):
        raise ValueError(f"ref_capacity must be a power of two >= 2, got {ref_capacity}")


class LedgerArrays:
    """Struct-of-arrays numpy views over one ledger buffer (shared segment or private memory).

    Attributes (capacities): max_workers, max_slots, max_blocks_per_request (= arena stride),
    ref_capacity (entries per worker row of the refcount index, power of two), block_size (tokens).
    Arrays: `header` uint64[16] plus one attribute per annotated array field (`w_*` length max_workers,
    `s_*` length max_slots, `arena` uint64[max_slots*max_blocks_per_request],
    `ref_keys` uint64[max_workers, ref_capacity], `ref_counts` int32[max_workers, ref_capacity]).

    Refcount index: linear probing from a mixed hash (splitmix64 finalizer) with at most
    `kernels.MAX_PROBE` probes and backward-shift deletion (no tombstones). An entry is occupied
    iff its count > 0, so every u64 key (0 included) is a valid hash. When no free entry is found
    in the probe window the block is counted as unique and not stored (see `kernels.ref_add`).

    Invariant: slot i owns arena[i*stride : i*stride + s_arena_len[i]], stride = max_blocks_per_request.

    The annotated array attributes below are the one statement of the layout, in buffer order:
    `Annotated[npt.NDArray[scalar], kind]` (`array_fields` reads them; kind "W" = max_workers,
    "S" = max_slots, "A" = arena, "R" = W x ref_capacity; a byte-string field adds its item size).
    """

    header: npt.NDArray[np.uint64]
    max_workers: int
    max_slots: int
    max_blocks_per_request: int
    ref_capacity: int
    block_size: int
    w_present: Annotated[npt.NDArray[np.uint8], "W"]
    w_worker_id: Annotated[npt.NDArray[np.uint32], "W"]
    w_dp_rank: Annotated[npt.NDArray[np.uint32], "W"]
    w_generation: Annotated[npt.NDArray[np.uint32], "W"]
    w_total_kv_blocks: Annotated[npt.NDArray[np.int64], "W"]  # blocks
    w_max_batched_tokens: Annotated[npt.NDArray[np.int64], "W"]  # tokens
    w_active_blocks: Annotated[npt.NDArray[np.int64], "W"]  # unique live blocks: distinct hashes + unhashed + decode
    w_active_prefill: Annotated[npt.NDArray[np.int64], "W"]  # outstanding prefill tokens
    w_active_requests: Annotated[npt.NDArray[np.int64], "W"]  # requests
    w_flags: Annotated[npt.NDArray[np.uint8], "W"]  # bit0 drained, bit1 overloaded, bit2 stale
    s_state: Annotated[npt.NDArray[np.uint8], "S"]  # 0 free, 1 admitted, 2 dispatched, 3 prefill_done
    s_generation: Annotated[npt.NDArray[np.uint32], "S"]  # bumped at every reserve; 0 = never used
    s_worker_row: Annotated[npt.NDArray[np.int32], "S"]
    s_worker_generation: Annotated[npt.NDArray[np.uint32], "S"]
    s_isl: Annotated[npt.NDArray[np.int64], "S"]  # tokens
    s_cached: Annotated[npt.NDArray[np.int64], "S"]  # tokens
    s_prefill: Annotated[npt.NDArray[np.int64], "S"]  # outstanding prefill tokens booked on the worker
    s_expected_osl: Annotated[npt.NDArray[np.int64], "S"]  # tokens; -1 = unknown
    s_output_tokens: Annotated[npt.NDArray[np.int64], "S"]  # last folded output tokens
    s_extra_blocks: Annotated[npt.NDArray[np.int64], "S"]  # blocks booked outside the deduped hashes
    s_class: Annotated[npt.NDArray[np.int32], "S"]
    s_enqueue_us: Annotated[npt.NDArray[np.int64], "S"]
    s_admit_us: Annotated[npt.NDArray[np.int64], "S"]
    s_arena_off: Annotated[npt.NDArray[np.int64], "S"]  # index into arena
    s_arena_len: Annotated[npt.NDArray[np.int32], "S"]  # hashes stored
    s_owner_pid: Annotated[npt.NDArray[np.int64], "S"]
    # the wire limit: changing MAX_REQUEST_ID_BYTES changes the layout
    s_request_id: Annotated[npt.NDArray[np.bytes_], "S", MAX_REQUEST_ID_BYTES]
    arena: Annotated[npt.NDArray[np.uint64], "A"]
    ref_keys: Annotated[npt.NDArray[np.uint64], "R"]
    ref_counts: Annotated[npt.NDArray[np.int32], "R"]

    def __init__(
        self,
        buffer: Any,
        *,
        max_workers: int,
        max_slots: int,
        max_blocks_per_request: int,
        ref_capacity: int,
        block_size: int,
    ) -> None:
        check_capacities(max_workers, max_slots, max_blocks_per_request, ref_capacity, block_size)
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
    def load(
        self,
    ) -> tuple[
        np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray
    ]:
        """The arrays a booking's load change reads and writes, in the booking kernels' parameter order
        (`kernels.fold_progress` / `fold_words`, `booking_kernels.slot_output_tokens`): s_state,
        s_generation, s_worker_row, s_isl, s_prefill, s_output_tokens, s_extra_blocks, w_active_blocks,
        w_active_prefill."""
        return (
            self.s_state,
            self.s_generation,
            self.s_worker_row,
            self.s_isl,
            self.s_prefill,
            self.s_output_tokens,
            self.s_extra_blocks,
            self.w_active_blocks,
            self.w_active_prefill,
        )

    @property
    def capacities(self) -> dict[str, int]:
        return {k: int(getattr(self, k)) for k in CAPACITY_KEYS}

    @property
    def writable(self) -> bool:
        return bool(self.header.flags.writeable)

    @staticmethod
    def nbytes(max_workers: int, max_slots: int, max_blocks_per_request: int, ref_capacity: int) -> int:
        """Total bytes of the ledger buffer for these capacities."""
        return _offsets(max_workers, max_slots, max_blocks_per_request, ref_capacity)[1]

    @classmethod
    def private(
        cls,
        max_workers: int,
        max_slots: int,
        max_blocks_per_request: int,
        ref_capacity: int | None = None,
        block_size: int = 16,
        epoch: int = 1,
    ) -> LedgerArrays:
        """A ledger over a zeroed, 64-byte-aligned private numpy buffer (tests, the virtual-time simulator)."""
        if ref_capacity is None:
            ref_capacity = default_ref_capacity(max_workers, max_slots, max_blocks_per_request)
        n = cls.nbytes(max_workers, max_slots, max_blocks_per_request, ref_capacity)
        raw = np.zeros(n + _ALIGN, np.uint8)  # zeroed; sliced so the base is 64-byte aligned like a mapping
        start = (-raw.ctypes.data) % _ALIGN
        buf = raw[start : start + n]
        arrays = cls(
            buf,
            max_workers=max_workers,
            max_slots=max_slots,
            max_blocks_per_request=max_blocks_per_request,
            ref_capacity=ref_capacity,
            block_size=block_size,
        )
        arrays.write_header(epoch)
        return arrays

    @classmethod
    def from_header(cls, buffer: Any, expect: dict[str, int] | None = None, what: str = "ledger") -> LedgerArrays:
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
        need = cls.nbytes(
            found["max_workers"], found["max_slots"], found["max_blocks_per_request"], found["ref_capacity"]
        )
        if int(h[H_NBYTES]) != need or size < need:
            raise ShmLayoutError(f"{what}: size {size} bytes (header says {int(h[H_NBYTES])}), layout needs {need}")
        try:
            return cls(buffer, **found)
        except ValueError as exc:
            raise ShmLayoutError(f"{what}: {exc}") from exc


_FIELDS = array_fields(LedgerArrays)


def progress_nbytes(max_slots: int) -> int:
    """Bytes of the progress segment: `PROGRESS_WORDS_PER_SLOT` u64 words per slot."""
    return PROGRESS_WORDS_PER_SLOT * 8 * max_slots
