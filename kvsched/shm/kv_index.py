"""The KV-index segment: event-fed overlap indexes and KV-event stream seqs that survive a restart.

Segment `kvsched-<instance>-kvindex` (mode 0640, written only by the daemon), beside the ledger and
with the same lifetime: created by the daemon, unregistered from Python's resource tracker at once
(so a SIGKILL leaves it), unlinked with the other segments on a clean stop with no live lease or by
`kvsched-daemon --purge`. Contents (every array on a 64-byte boundary):

* header uint64[16]: magic `KVSCHIX1`, layout version, max_workers, capacity (entries per index),
  words (u64 holder words per entry = ceil(max_workers / 64)), total bytes;
* per worker row: `last_seq` int64 (the KV-event stream's last applied seq: every batch <= it was
  applied to the indexes; -1 = none), and the identity the row had when its entries were learnt:
  `worker_id` u32, `dp_rank` u32, `worker_generation` u32 (the ledger's `w_generation`), `present` u8;
* per worker row: `meta_len` u32 and `meta` u8[META_BYTES]: an opaque record the daemon writes for a
  worker added at runtime (`kvsched add-worker`: its URL and KV-event endpoints, encoded by
  `kvsched.daemon.registry`), so a restarted daemon restores them; `meta_len` = 0: none;
* two `OverlapIndex` tables (device tier, offload tiers): keys uint64[C], used uint8[C],
  perm / ttlm uint64[C, words], ttl_exp int64[C] (see `kvsched.shm.overlap`).

A restarted daemon validates the header (`attach_kv_index`) and then each row against the ledger's
worker table (`reconcile_rows`): a row whose worker changed is cleared. See docs/KV_EVENTS.md,
"Restarts keep the cache view".
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import numpy as np
import numpy.typing as npt

from ..errors import ShmLayoutError
from .layout import array_fields
from .overlap import OverlapIndex
from .segments import SegmentHandle, _create, _untrack, kv_index_name, mapped_view, unlink_segment
from .space import reserve_pages

log = logging.getLogger(__name__)

KV_INDEX_VERSION = 2  # 2: per-row `meta` records (version 1 segments are recreated empty at start)
META_BYTES = 4096  # bytes of one row's runtime-worker record (a URL is at most 2,048 bytes)
KV_MAGIC = int.from_bytes(b"KVSCHIX1", "little")
_HEADER_WORDS = 16
_ALIGN = 64
K_MAGIC, K_VERSION, K_MAX_WORKERS, K_CAPACITY, K_WORDS, K_NBYTES = 0, 1, 2, 3, 4, 5

# (name, dtype, kind) of each overlap-index table; the per-row fields are `KvIndexSegment`'s annotated
# arrays. kind: "W" = max_workers, "C" = capacity, "CW" = (capacity, words), "WM" = (max_workers, META_BYTES)
_INDEX_FIELDS = (
    ("keys", np.uint64, "C"),
    ("used", np.uint8, "C"),
    ("perm", np.uint64, "CW"),
    ("ttlm", np.uint64, "CW"),
    ("ttl_exp", np.int64, "C"),
)
_TIERS = ("device", "offload")


def _layout(max_workers: int, capacity: int) -> tuple[dict[str, tuple[int, Any, tuple[int, ...]]], int]:
    words = (max_workers + 63) // 64
    shapes = {"W": (max_workers,), "C": (capacity,), "CW": (capacity, words), "WM": (max_workers, META_BYTES)}
    fields: list[tuple[str, Any, str]] = list(_ROW_FIELDS)
    fields += [(f"{tier}_{name}", dt, kind) for tier in _TIERS for name, dt, kind in _INDEX_FIELDS]
    off = _HEADER_WORDS * 8
    out = {}
    for name, dt, kind in fields:
        off = (off + _ALIGN - 1) // _ALIGN * _ALIGN
        shape = shapes[kind]
        out[name] = (off, np.dtype(dt), shape)
        off += np.dtype(dt).itemsize * int(np.prod(shape))
    return out, (off + _ALIGN - 1) // _ALIGN * _ALIGN


def kv_index_nbytes(max_workers: int, capacity: int) -> int:
    """Bytes of the KV-index segment for `max_workers` rows and `capacity` entries per index."""
    return _layout(max_workers, capacity)[1]


class KvIndexSegment:
    """Views over one mapped KV-index segment.

    Attributes:
        name, max_workers, capacity; `last_seq` int64[max_workers]; `worker_id` / `dp_rank` /
        `worker_generation` uint32[max_workers]; `present` uint8[max_workers]; `meta_len`
        uint32[max_workers] and `meta` uint8[max_workers, META_BYTES] (`store_meta` / `load_meta`);
        `device` / `offload`: OverlapIndex over the segment's tables (their inserts write the segment).

    The annotated arrays below are the per-row part of the layout, in segment order (read by
    `kvsched.shm.layout.array_fields`); the two index tables follow them.
    """

    header: npt.NDArray[np.uint64]
    last_seq: Annotated[npt.NDArray[np.int64], "W"]
    worker_id: Annotated[npt.NDArray[np.uint32], "W"]
    dp_rank: Annotated[npt.NDArray[np.uint32], "W"]
    worker_generation: Annotated[npt.NDArray[np.uint32], "W"]
    present: Annotated[npt.NDArray[np.uint8], "W"]
    meta_len: Annotated[npt.NDArray[np.uint32], "W"]
    meta: Annotated[npt.NDArray[np.uint8], "WM"]
    device: OverlapIndex
    offload: OverlapIndex

    def __init__(self, shm: SegmentHandle, max_workers: int, capacity: int) -> None:
        self.name = shm.name
        self.max_workers = max_workers
        self.capacity = capacity
        self._shm = shm
        fields, total = _layout(max_workers, capacity)
        if shm.size < total:
            raise ShmLayoutError(f"{self.name}: {shm.size} bytes, layout needs {total}")
        buf = mapped_view(shm)
        self.header = np.frombuffer(buf, np.uint64, _HEADER_WORDS)
        arrays = {
            name: np.frombuffer(buf, dt, int(np.prod(shape)), off).reshape(shape)
            for name, (off, dt, shape) in fields.items()
        }
        for name, _, _ in _ROW_FIELDS:
            setattr(self, name, arrays[name])
        self.device, self.offload = (
            OverlapIndex.over(max_workers, *(arrays[f"{tier}_{n}"] for n, _, _ in _INDEX_FIELDS)) for tier in _TIERS
        )

    def close(self) -> None:
        """Drop the views and unmap (the segment itself stays)."""
        for attr in ("header", "device", "offload", *(n for n, _, _ in _ROW_FIELDS)):
            setattr(self, attr, None)
        self._shm.close()  # views still alive elsewhere (the scheduler's) keep the mapping until they go

    def store_meta(self, row: int, record: bytes) -> None:
        """Keep `record` (at most META_BYTES bytes) for `row`. The length is written last, so a daemon
        killed midway leaves either no record or the whole one. Raises ValueError when too long."""
        if len(record) > META_BYTES:
            raise ValueError(f"runtime worker record of {len(record)} bytes exceeds {META_BYTES}")
        self.meta_len[row] = 0
        self.meta[row, : len(record)] = np.frombuffer(record, np.uint8)
        self.meta_len[row] = len(record)

    def load_meta(self, row: int) -> bytes | None:
        """The record kept for `row`, or None."""
        n = int(self.meta_len[row])
        return bytes(self.meta[row, :n]) if 0 < n <= META_BYTES else None

    def clear_meta(self, row: int) -> None:
        """Forget `row`'s record (its worker was removed)."""
        self.meta_len[row] = 0

    def clear_row(self, row: int) -> None:
        """Forget everything learnt for `row` (both tiers) and its stream seq."""
        self.device.clear_row(row)
        self.offload.clear_row(row)
        self.last_seq[row] = -1
        self.present[row] = 0


_ROW_FIELDS = array_fields(KvIndexSegment)


def create_kv_index(
    instance: str, max_workers: int, capacity: int, *, mode: int = 0o640, group: int | str | None = None
) -> KvIndexSegment:
    """Create the segment (zeroed, every page reserved; all `last_seq` = -1).

    Raises:
        FileExistsError: it exists. ShmSpaceError: /dev/shm has no room for it.
    """
    nbytes = kv_index_nbytes(max_workers, capacity)
    shm = _create(kv_index_name(instance), nbytes, mode, group)
    seg = KvIndexSegment(shm, max_workers, capacity)
    seg.last_seq[:] = -1
    h = seg.header
    h[K_VERSION], h[K_MAX_WORKERS], h[K_CAPACITY] = KV_INDEX_VERSION, max_workers, capacity
    h[K_WORDS], h[K_NBYTES] = (max_workers + 63) // 64, nbytes
    h[K_MAGIC] = KV_MAGIC  # last: a complete header is one with the magic
    return seg


def attach_kv_index(instance: str, max_workers: int, capacity: int) -> KvIndexSegment:
    """Map an existing segment and validate its header against the wanted capacities.

    Raises:
        FileNotFoundError: no such segment. ShmLayoutError: magic, version, capacities or size differ,
            or the segment is empty (its creation was killed before its size was set).
    """
    name = kv_index_name(instance)
    try:
        shm = SegmentHandle(name=name)
    except ValueError:  # "cannot mmap an empty file": a creation killed before its size was set
        raise ShmLayoutError(f"{name}: empty (an earlier start was killed while creating it)") from None
    _untrack(shm)
    try:
        if shm.size < _HEADER_WORDS * 8:
            raise ShmLayoutError(f"{name}: {shm.size} bytes, too small for the header")
        h = np.frombuffer(mapped_view(shm), np.uint64, _HEADER_WORDS)
        want = {
            K_MAGIC: KV_MAGIC,
            K_VERSION: KV_INDEX_VERSION,
            K_MAX_WORKERS: max_workers,
            K_CAPACITY: capacity,
            K_WORDS: (max_workers + 63) // 64,
            K_NBYTES: kv_index_nbytes(max_workers, capacity),
        }
        bad = {k: int(h[k]) for k, v in want.items() if int(h[k]) != v}
        del h
        if bad:
            raise ShmLayoutError(f"{name}: header words {bad} differ from the expected {want}")
        reserve_pages(shm.fd, shm.size, name)
        return KvIndexSegment(shm, max_workers, capacity)
    except BaseException:
        shm.close()
        raise


def remove_kv_index(instance: str) -> None:
    """Unlink the KV-index segment alone (missing is fine, an empty one too: `unlink_segment`)."""
    unlink_segment(kv_index_name(instance))


def open_kv_index(
    instance: str, max_workers: int, capacity: int, *, restore: bool, group: int | str | None = None
) -> tuple[KvIndexSegment, bool]:
    """The daemon's KV-index segment: re-attached and kept when `restore` (the ledger was re-attached)
    and it validates; otherwise (fresh ledger, missing or invalid segment) created empty.

    Returns:
        (segment, restored): restored is True when the previous daemon's contents were kept.
    """
    if restore:
        try:
            return attach_kv_index(instance, max_workers, capacity), True
        except FileNotFoundError:
            log.info("kv index segment absent instance=%s: starting with an empty cache view", instance)
        except ShmLayoutError as exc:
            log.warning("kv index segment invalid, recreated: %s", exc)
    remove_kv_index(instance)
    return create_kv_index(instance, max_workers, capacity, group=group), False


def reconcile_rows(
    seg: KvIndexSegment, w_present: np.ndarray, w_worker_id: np.ndarray, w_dp_rank: np.ndarray, w_generation: np.ndarray
) -> list[int]:
    """Check every row's recorded identity against the ledger's worker table; clear rows whose worker
    changed (or left) and record the current identity of every present row.

    A row with `present` = 0 was cleared when its worker left (`KvEventApplier.reset_row`), so what it
    holds was learnt for the worker added after that: it is adopted.

    Args:
        w_*: the ledger's worker table (`LedgerArrays.w_present`, `w_worker_id`, `w_dp_rank`, `w_generation`).
    Returns:
        rows cleared.
    """
    cleared = []
    for row in range(seg.max_workers):
        here = bool(w_present[row])
        known = bool(seg.present[row])
        same = (int(seg.worker_id[row]), int(seg.dp_rank[row]), int(seg.worker_generation[row])) == (
            int(w_worker_id[row]),
            int(w_dp_rank[row]),
            int(w_generation[row]),
        )
        if (known and not (here and same)) or (not here and int(seg.last_seq[row]) >= 0):
            seg.clear_row(row)
            cleared.append(row)
        if here:
            seg.worker_id[row], seg.dp_rank[row] = w_worker_id[row], w_dp_rank[row]
            seg.worker_generation[row] = w_generation[row]
            seg.present[row] = 1
    return cleared
