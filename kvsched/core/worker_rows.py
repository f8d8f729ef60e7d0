"""WorkerRows: the worker-row table of the ledger — which worker holds which row, its flags, eligibility.

Owns the row side of the shared-memory arrays (`w_present`, `w_worker_id`, `w_dp_rank`,
`w_generation`, capacity fields, `w_flags`) and the Python maps WorkerKey -> row and row -> WorkerKey.
It does not touch bookings: the load aggregates of a row (`w_active_*`) are kept by `Ledger`, which
this table only zeroes when a row is registered or freed (docs/DESIGN.md §3.1, §4.2).

`version` grows whenever presence or a drained / overloaded / stale flag changes; memos keyed on it
(`eligible_mask` here, the admitter's and the overlap view's) stay valid while it is unchanged.
Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..config import OverloadConfig
from ..shm.layout import FLAG_DRAINED, FLAG_OVERLOADED, LedgerArrays
from .types import WorkerKey

_U32_MAX = 0xFFFF_FFFF


class WorkerRows:
    """Registered workers by row over `arrays`, with flags, overload thresholds and the eligibility memo.

    Args:
        arrays: the ledger views; rows already present in them are adopted (daemon restart).
        overload: per-worker overload thresholds (None fields = off).
    """

    def __init__(self, arrays: LedgerArrays, overload: OverloadConfig) -> None:
        self.arrays = arrays
        self.overload = overload
        w = arrays.max_workers
        self.version = 0
        self._elig_key: tuple[Any, ...] | None = None  # eligible_mask memo: (pinned, allowed, version)
        self._elig_cache = np.zeros(w, np.uint8)
        self._elig_n = 0
        self.adopt()

    def adopt(self) -> None:
        """Rebuild the maps (key -> row, row -> key, worker id -> rank count) from `w_present`."""
        a = self.arrays
        self._row_of: dict[WorkerKey, int] = {}
        self._key_of: list[WorkerKey | None] = [None] * a.max_workers  # row -> key (None = free row)
        self._ids: dict[int, int] = {}  # worker_id -> registered rows
        for row in np.flatnonzero(a.w_present).tolist():
            self._index(row, WorkerKey(int(a.w_worker_id[row]), int(a.w_dp_rank[row])))

    def _index(self, row: int, key: WorkerKey) -> None:
        self._row_of[key] = row
        self._key_of[row] = key
        self._ids[key.worker_id] = self._ids.get(key.worker_id, 0) + 1

    def add(self, key: WorkerKey, total_kv_blocks: int, max_num_batched_tokens: int) -> int:
        """Register `key` in the lowest free row (zero load, no flags); returns the row. Bumps w_generation.

        Raises:
            ValueError: `key` is already registered, or every row is taken ("max_workers=N reached").
        """
        a = self.arrays
        if key in self._row_of:
            raise ValueError(f"worker {key} is already registered")
        free = np.flatnonzero(a.w_present == 0)
        if free.size == 0:
            raise ValueError(f"max_workers={a.max_workers} reached")
        row = int(free[0])
        a.w_worker_id[row] = key.worker_id
        a.w_dp_rank[row] = key.dp_rank
        a.w_generation[row] = (int(a.w_generation[row]) + 1) & _U32_MAX
        a.w_total_kv_blocks[row] = total_kv_blocks
        a.w_max_batched_tokens[row] = max_num_batched_tokens
        a.w_active_blocks[row] = a.w_active_prefill[row] = a.w_active_requests[row] = 0
        a.w_flags[row] = 0
        a.w_present[row] = 1
        self._index(row, key)
        self.version += 1
        return row

    def free(self, row: int) -> None:
        """Forget the worker in `row` and zero the row (load, flags, refcounts). The caller has released
        its bookings first. Raises KeyError for a row that holds no worker."""
        self.check(row)
        a = self.arrays
        key = self.key_of(row)
        a.w_present[row] = 0
        a.w_active_blocks[row] = a.w_active_prefill[row] = a.w_active_requests[row] = 0
        a.w_flags[row] = 0
        a.ref_counts[row, :] = 0
        self.version += 1
        del self._row_of[key]
        self._key_of[row] = None
        self._ids[key.worker_id] -= 1
        if self._ids[key.worker_id] == 0:
            del self._ids[key.worker_id]

    def check(self, row: int) -> None:
        """Raises KeyError unless `row` holds a registered worker."""
        if not (0 <= row < self.arrays.max_workers and self.arrays.w_present[row]):
            raise KeyError(f"no worker in row {row}")

    def row_of(self, key: WorkerKey) -> int | None:
        return self._row_of.get(key)

    def rows_of_worker_id(self, worker_id: int) -> list[int]:
        return sorted(r for k, r in self._row_of.items() if k.worker_id == worker_id)

    def rows_of(self, worker_id: int, dp_rank: int | None) -> list[int]:
        """Rows of a worker: every rank when `dp_rank` is None, ascending. Raises KeyError when unknown."""
        if dp_rank is None:
            rows = self.rows_of_worker_id(worker_id)
        else:
            row = self._row_of.get(WorkerKey(worker_id, dp_rank))
            rows = [] if row is None else [row]
        if not rows:
            raise KeyError(f"unknown worker {worker_id}:{'*' if dp_rank is None else dp_rank}")
        return rows

    def key_of(self, row: int) -> WorkerKey:
        """The worker in `row`. Raises KeyError for a row that holds none."""
        key = self._key_of[row] if 0 <= row < len(self._key_of) else None
        if key is None:
            raise KeyError(f"no worker in row {row}")
        return key

    def live_rows(self) -> np.ndarray:
        """int64[k], rows holding a registered worker, ascending."""
        return np.flatnonzero(self.arrays.w_present)

    def n_worker_ids(self) -> int:
        return len(self._ids)

    def worker_ids(self) -> frozenset[int]:
        return frozenset(self._ids)

    def ranks_of(self, worker_id: int) -> int:
        return self._ids.get(worker_id, 0)

    # -- flags ----------------------------------------------------------------------------------
    def set_flag(self, row: int, flag: int, on: bool) -> None:
        """Set or clear `flag` (a `shm.layout.FLAG_*` bit) on `row`; bumps `version` when it changes."""
        a = self.arrays
        cur = int(a.w_flags[row])
        new = (cur | flag) if on else (cur & (0xFF ^ flag))
        if new != cur:
            a.w_flags[row] = new
            self.version += 1

    @property
    def overload(self) -> OverloadConfig:
        """The overload thresholds; assigning them also sets `overload_rules`."""
        return self._overload

    @overload.setter
    def overload(self, overload: OverloadConfig) -> None:
        self._overload = overload
        self.overload_rules = (
            overload.overload_active_blocks_frac is not None or overload.overload_prefill_tokens is not None
        )

    def overload_enabled(self) -> bool:
        """True when an overload threshold is set (only then do load changes re-check the flag);
        the same as the attribute `overload_rules`, which the per-event paths read."""
        return self.overload_rules

    def update_overload(self, row: int) -> bool:
        """Recompute `row`'s overloaded flag from its CURRENT load (docs/DESIGN.md §4.2); returns the flag."""
        a, ov = self.arrays, self.overload
        over = False
        if ov.overload_active_blocks_frac is not None:
            over = bool(a.w_active_blocks[row] > ov.overload_active_blocks_frac * a.w_total_kv_blocks[row])
        if not over and ov.overload_prefill_tokens is not None:
            over = bool(a.w_active_prefill[row] > ov.overload_prefill_tokens)
        self.set_flag(row, FLAG_OVERLOADED, over)
        return over

    def update_overload_all(self) -> None:
        """`update_overload` on every live row (after a fold or a rebuild changed many rows)."""
        for row in self.live_rows().tolist():
            self.update_overload(row)

    # -- eligibility ----------------------------------------------------------------------------
    def eligible_mask(self, pinned: WorkerKey | None, allowed: frozenset[int] | None, out: np.ndarray) -> int:
        """Write uint8[max_workers] `out`: present, not drained, not overloaded, allowed / pinned.

        Memoised on (pinned, allowed, version). Returns the number of eligible rows.
        """
        key = (pinned, allowed, self.version)
        if key == self._elig_key:  # nothing that decides eligibility changed since the last call
            if out is not self._elig_cache:
                out[:] = self._elig_cache
            return self._elig_n
        a = self.arrays
        ok = (a.w_present != 0) & ((a.w_flags & (FLAG_DRAINED | FLAG_OVERLOADED)) == 0)
        if allowed is not None:
            ok &= np.isin(a.w_worker_id, np.fromiter(allowed, np.int64, len(allowed)))
        if pinned is not None:
            row = self._row_of.get(pinned)
            keep = row is not None and bool(ok[row])
            ok[:] = False
            if keep:
                ok[row] = True
        out[:] = ok
        n = int(np.count_nonzero(ok))
        self._elig_key, self._elig_n = key, n
        if out is not self._elig_cache:
            self._elig_cache[:] = ok
        return n

    @property
    def elig_cache(self) -> np.ndarray:
        """uint8[max_workers], the result of the last `eligible_mask` call (overwritten by every call)."""
        return self._elig_cache
