"""OverlapIndex: block hash -> worker-row bitmask, for the KV-overlap prefix depth per worker (docs/DESIGN.md §6).

Fixed memory: `capacity` entries (a power of two), each holding a key, two bitmasks of
`words = ceil(max_workers / 64)` u64 words and one expiry:

* `perm` bits: permanent holders (KV-event-fed entries, inserted with `ttl_us=None`).
* `ttlm` bits: holders learned from routing decisions, valid while `ttl_exp > now_us`. The expiry is
  per entry (the latest insert's now + ttl), so a TTL holder may outlive its own TTL while other rows
  keep refreshing the same hash — the approximation of this mode.

Placement: an entry lives in the window of `WINDOW` consecutive entries after `mix64(hash)`. Lookups
scan the whole window (no tombstones needed). When the window has no unused entry, insert evicts the
entry with the earliest expiry (expired TTL entries first; an entry with any permanent holder counts
as expiring at INT64_MAX; ties -> the first in the window) and counts it in `evictions`.
"""

from __future__ import annotations

import numpy as np

from .kernel_cache import njit
from .kernels import _home

INT64_MAX = np.iinfo(np.int64).max
INT64_MIN = np.iinfo(np.int64).min
WINDOW = 16  # entries probed per hash
_ONE = np.uint64(1)
_ZERO = np.uint64(0)


@njit(cache=True, nogil=True)
def _find_entry(keys, used, h, mask, limit):
    i = _home(h, mask)
    for _ in range(limit):
        if used[i] != 0 and keys[i] == h:
            return i
        i = (i + 1) & mask
    return -1


# _NO_ARRAY_HELPERS_IN_LOOPS: a jitted helper that takes arrays, called from a kernel's inner loop,
# costs far more than its body: numba compiles the call with reference counting of the array
# arguments (NRT incref / decref in the LLVM IR; `inline="always"` did not help). Measured on this
# project's VM: `overlap_insert` with an expiry helper called for each of the 16 probes of a new
# hash took 41.7 µs per 64 new hashes, 7.7 µs with the rule written out in the loop (same
# results). Inner loops therefore index the arrays themselves.


@njit(cache=True, nogil=True)
def overlap_insert(keys, used, perm, ttlm, ttl_exp, hashes, row, now_us, expiry_us):
    """Mark `row` as holding each of `hashes` (uint64[n]) until `expiry_us` (INT64_MAX = permanent).

    Arrays: keys uint64[C], used uint8[C], perm / ttlm uint64[C, words], ttl_exp int64[C] (µs).
    Returns:
        int: entries evicted to make room.
    """
    mask = keys.shape[0] - 1
    limit = min(keys.shape[0], WINDOW)
    words = perm.shape[1]
    wd = row // 64
    bit = _ONE << np.uint64(row % 64)
    evicted = 0
    for k in range(hashes.shape[0]):
        h = hashes[k]
        i = _home(h, mask)
        e = -1
        victim = -1
        victim_key = INT64_MAX
        for _ in range(limit):
            if used[i] == 0:
                key = INT64_MIN  # an unused entry beats any eviction
            elif keys[i] == h:
                e = i
                break
            else:  # its expiry: INT64_MAX with any permanent holder (_NO_ARRAY_HELPERS_IN_LOOPS)
                key = ttl_exp[i]
                for w in range(words):
                    if perm[i, w] != 0:
                        key = INT64_MAX
                        break
            if victim < 0 or key < victim_key:
                victim = i
                victim_key = key
            i = (i + 1) & mask
        if e < 0:
            e = victim
            if used[e] != 0:
                evicted += 1
            keys[e] = h
            used[e] = 1
            ttl_exp[e] = 0
            for w in range(perm.shape[1]):
                perm[e, w] = _ZERO
                ttlm[e, w] = _ZERO
        if expiry_us == INT64_MAX:
            perm[e, wd] |= bit
        else:
            if ttl_exp[e] <= now_us:  # expired TTL holders are dead: forget them
                for w in range(ttlm.shape[1]):
                    ttlm[e, w] = _ZERO
            ttlm[e, wd] |= bit
            if expiry_us > ttl_exp[e]:
                ttl_exp[e] = expiry_us
    return evicted


@njit(cache=True, nogil=True)
def _free_if_empty(used, perm, ttlm, e):
    for w in range(perm.shape[1]):
        if perm[e, w] != 0 or ttlm[e, w] != 0:
            return 0
    used[e] = 0
    return 1


@njit(cache=True, nogil=True)
def overlap_remove(keys, used, perm, ttlm, hashes, row):
    """Clear `row`'s bit (both kinds) on each of `hashes`; entries left empty are freed. Returns freed."""
    mask = keys.shape[0] - 1
    limit = min(keys.shape[0], WINDOW)
    wd = row // 64
    keep = ~(_ONE << np.uint64(row % 64))
    freed = 0
    for k in range(hashes.shape[0]):
        e = _find_entry(keys, used, hashes[k], mask, limit)
        if e >= 0:
            perm[e, wd] &= keep
            ttlm[e, wd] &= keep
            freed += _free_if_empty(used, perm, ttlm, e)
    return freed


@njit(cache=True, nogil=True)
def overlap_clear_row(used, perm, ttlm, row):
    """Clear `row` from every entry (worker removed or its cache cleared). Returns entries freed."""
    wd = row // 64
    keep = ~(_ONE << np.uint64(row % 64))
    freed = 0
    for e in range(used.shape[0]):
        if used[e] != 0:
            perm[e, wd] &= keep
            ttlm[e, wd] &= keep
            freed += _free_if_empty(used, perm, ttlm, e)
    return freed


@njit(cache=True, nogil=True)
def _write_rows(out, wd, bits, value):
    """out[wd * 64 + b] = value for every set bit b of the u64 mask `bits` (rows of word `wd`)."""
    d = bits
    while d != _ZERO:
        low = d & (~d + _ONE)
        b = 0
        t = low
        while t > _ONE:
            t >>= _ONE
            b += 1
        out[wd * 64 + b] = value
        d ^= low


@njit(cache=True, nogil=True)
def overlap_depth(keys, used, perm, ttlm, ttl_exp, hashes, now_us, scratch, out):
    """Prefix depth per worker row: leading `hashes` held (unexpired) by the row, stopping at its first miss.

    Args:
        keys / used / perm / ttlm / ttl_exp: the index arrays (see `overlap_insert`).
        hashes: uint64[n], the request's chained block hashes, in order.
        now_us: current time (µs); TTL holders with ttl_exp <= now_us are absent.
        scratch: uint64[words], caller-owned work space (overwritten).
        out: int32[R] (R <= 64 * words), written: depth in blocks for rows 0..R-1.
    """
    n_rows = out.shape[0]
    mask = keys.shape[0] - 1
    limit = min(keys.shape[0], WINDOW)
    words = scratch.shape[0]
    for wd in range(words):
        bits = min(64, n_rows - wd * 64)
        if bits <= 0:
            scratch[wd] = _ZERO
        elif bits == 64:
            scratch[wd] = ~_ZERO
        else:
            scratch[wd] = (_ONE << np.uint64(bits)) - _ONE
    n = hashes.shape[0]
    for k in range(n):
        e = _find_entry(keys, used, hashes[k], mask, limit)
        live_ttl = e >= 0 and ttl_exp[e] > now_us
        any_alive = False
        for wd in range(words):
            a = scratch[wd]
            if a == _ZERO:
                continue
            p = _ZERO
            if e >= 0:
                p = perm[e, wd]
                if live_ttl:
                    p |= ttlm[e, wd]
            _write_rows(out, wd, a & ~p, k)  # rows whose prefix ends at block k
            a &= p
            scratch[wd] = a
            if a != _ZERO:
                any_alive = True
        if not any_alive:
            return
    for wd in range(words):
        _write_rows(out, wd, scratch[wd], n)  # rows holding every block


class OverlapIndex:
    """Block hash -> worker-row bitmask prefix index with per-entry expiry (see module docstring).

    Args:
        max_workers: worker rows (bits per entry).
        capacity: entries (power of two); memory = capacity * (17 + 16 * words) bytes.
    Attributes:
        keys / used / perm / ttlm / ttl_exp: the table (see `over`); evictions, version: counters.
        scratch: uint64[words], `overlap_depth`'s work space; kernels that compute a depth over this
            index (the fused admission, the credited depth) are handed it.
    Invariant: every stored entry has at least one holder bit set, or was inserted and has only
    expired TTL holders (reclaimed by the next insert that lands on it, or by eviction).
    """

    def __init__(self, max_workers: int, capacity: int = 1 << 16) -> None:
        if capacity < 1 or capacity & (capacity - 1):
            raise ValueError(f"capacity must be a power of two, got {capacity}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.capacity = capacity
        self.words = (max_workers + 63) // 64
        self.keys = np.zeros(capacity, np.uint64)
        self.used = np.zeros(capacity, np.uint8)
        self.perm = np.zeros((capacity, self.words), np.uint64)
        self.ttlm = np.zeros((capacity, self.words), np.uint64)
        self.ttl_exp = np.zeros(capacity, np.int64)
        self.evictions = 0  # entries evicted by insert (fixed memory budget)
        self.version = 0  # bumped by every insert / remove / clear_row (lets callers memoise depth)
        self.scratch = np.zeros(self.words, np.uint64)

    @classmethod
    def over(
        cls,
        max_workers: int,
        keys: np.ndarray,
        used: np.ndarray,
        perm: np.ndarray,
        ttlm: np.ndarray,
        ttl_exp: np.ndarray,
    ) -> OverlapIndex:
        """An index over caller-owned arrays (e.g. views of a shared-memory segment), contents kept.

        Args:
            keys uint64[C], used uint8[C], perm / ttlm uint64[C, ceil(max_workers / 64)], ttl_exp int64[C];
            C a power of two.
        Raises:
            ValueError: a shape or dtype that does not match.
        """
        idx = cls.__new__(cls)
        capacity = keys.shape[0]
        words = (max_workers + 63) // 64
        want = {
            "keys": (keys, np.uint64, (capacity,)),
            "used": (used, np.uint8, (capacity,)),
            "perm": (perm, np.uint64, (capacity, words)),
            "ttlm": (ttlm, np.uint64, (capacity, words)),
            "ttl_exp": (ttl_exp, np.int64, (capacity,)),
        }
        for name, (arr, dt, shape) in want.items():
            if arr.dtype != dt or arr.shape != shape:
                raise ValueError(f"{name}: {arr.dtype}{arr.shape}, expected {np.dtype(dt)}{shape}")
        if capacity < 1 or capacity & (capacity - 1) or max_workers < 1:
            raise ValueError(f"capacity {capacity} (power of two) / max_workers {max_workers} (>= 1) invalid")
        idx.max_workers, idx.capacity, idx.words = max_workers, capacity, words
        idx.keys, idx.used, idx.perm, idx.ttlm, idx.ttl_exp = keys, used, perm, ttlm, ttl_exp
        idx.evictions = 0
        idx.version = 0
        idx.scratch = np.zeros(words, np.uint64)
        return idx

    @property
    def nbytes(self) -> int:
        """Memory the index holds (bytes)."""
        return sum(a.nbytes for a in (self.keys, self.used, self.perm, self.ttlm, self.ttl_exp))

    def prefault(self) -> None:
        """Touch every page of the index (bytes: `nbytes`) with a write that keeps its contents, so
        requests never pay first-touch page faults: measured on this project's VM, lazily mapped
        pages cost a 80 ms stall on the first requests and ~20 ms spikes later."""
        for arr in (self.keys, self.used, self.perm, self.ttlm, self.ttl_exp):
            flat = arr.reshape(-1).view(np.uint8)
            flat[::4096] = flat[::4096]
            flat[-1:] = flat[-1:]

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_workers:
            raise IndexError(f"row {row} out of range [0, {self.max_workers})")

    def insert(self, hashes: np.ndarray, row: int, now_us: int, ttl_us: int | None) -> None:
        """Record that `row` holds `hashes` (uint64[n]); until now_us + ttl_us (µs), or permanently if None."""
        self._check_row(row)
        expiry = INT64_MAX if ttl_us is None else min(int(now_us) + int(ttl_us), INT64_MAX - 1)
        h = np.asarray(hashes, dtype=np.uint64)
        self.version += 1
        self.evictions += overlap_insert(
            self.keys, self.used, self.perm, self.ttlm, self.ttl_exp, h, int(row), int(now_us), int(expiry)
        )

    def remove(self, hashes: np.ndarray, row: int) -> None:
        """Forget that `row` holds `hashes` (KV event BlockRemoved)."""
        self._check_row(row)
        self.version += 1
        overlap_remove(self.keys, self.used, self.perm, self.ttlm, np.asarray(hashes, dtype=np.uint64), int(row))

    def clear_row(self, row: int) -> None:
        """Forget everything `row` holds (AllBlocksCleared, engine restart, worker removed). O(capacity)."""
        self._check_row(row)
        self.version += 1
        overlap_clear_row(self.used, self.perm, self.ttlm, int(row))

    def depth(self, hashes: np.ndarray, now_us: int, out: np.ndarray) -> None:
        """Write into `out` (int32[max_workers]) the prefix depth in blocks of `hashes` on every row."""
        overlap_depth(
            self.keys,
            self.used,
            self.perm,
            self.ttlm,
            self.ttl_exp,
            np.asarray(hashes, dtype=np.uint64),
            int(now_us),
            self.scratch,
            out,
        )

    def __len__(self) -> int:
        """Entries held (including ones whose TTL holders have expired but are not yet reclaimed)."""
        return int(np.count_nonzero(self.used))


def warm_overlap_kernels() -> None:
    """Compile the overlap kernels on a tiny index (called by `shm.warm.warm_kernels`)."""
    idx = OverlapIndex(2, 16)
    h = np.arange(3, dtype=np.uint64)
    out = np.zeros(2, np.int32)
    for hashes in (h, np.frombuffer(h.tobytes(), dtype="<u8")):
        idx.insert(hashes, 0, 0, None)
        idx.insert(hashes, 1, 0, 10)
        idx.depth(hashes, 1, out)
        idx.remove(hashes, 0)
    idx.clear_row(1)
