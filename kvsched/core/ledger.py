"""Ledger: bookings (slot, generation) over the shared-memory arrays and their per-worker load
(docs/DESIGN.md §3.1, §4.2).

The worker-row table (which worker holds which row, its flags, eligibility) is `worker_rows.WorkerRows`,
reached as `Ledger.rows`; `Ledger` keeps the worker methods its callers use and delegates them.

Pure: no I/O, no clock (time comes in as `now_us`). The actor is the only writer of the ledger
segment; routers read it and write only their own progress words.

Aggregates per worker row are kept incrementally — never rescanned per decision:
* `w_active_blocks` = distinct live hashes booked on the row (refcount index, so a prefix shared by
  concurrent requests counts once) + every booking's `s_extra_blocks` (prompt blocks without a
  stored hash + decode blocks, ceil((isl + output)/B) - ceil(isl/B)).
* `w_active_prefill` = sum of the bookings' outstanding prefill tokens (isl - cached until the first
  output token or `prefill_done`).
* `w_active_requests` = live bookings.

Hashes: at most `min(max_blocks_per_request, ceil(isl/B))` hashes of a request are stored in its
arena range and deduplicated; the rest of its prompt blocks count as unique (`s_extra_blocks`).
Hashes within one request are assumed distinct (they are chained).

Invariant: releasing every booking returns every aggregate and every refcount to zero.
Invariant: `s_generation` of a slot only grows (1..2**32-1, wrapping past 0); a (slot, generation)
pair names at most one booking, so stale releases and stale progress words are no-ops.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import numpy as np

from ..config import OverloadConfig
from ..protocol import MAX_REQUEST_ID_BYTES, WorkerRow
from ..shm.admit_kernels import reserve_slot
from ..shm.bind import entry_point
from ..shm.booking_kernels import slot_dispatched, slot_output_tokens, slot_prefill_done
from ..shm.booking_packed import pack_release_arrays, release_booking_packed
from ..shm.kernels import project_and_cost
from ..shm.layout import (
    FLAG_DRAINED,
    FLAG_OVERLOADED,
    FLAG_STALE,
    SLOT_FREE,
    LedgerArrays,
)
from .slot_table import SlotInfo, read_slot, rebuild_aggregates
from .types import WorkerKey
from .word_fold import WordFold
from .worker_rows import WorkerRows


class Ledger:
    """Bookings with incremental per-worker aggregates, over a worker-row table (`rows`).

    Args:
        arrays: the ledger views (shared segment, writable, or `LedgerArrays.private`). Existing rows
            and bookings in it are adopted (daemon restart); call `rebuild_aggregates()` to recompute
            the aggregates from the slot table.
        progress: uint64[max_slots] progress words, or None (no local routers / simulator).
        overload: per-worker overload thresholds (None fields = off).
        state: uint64[max_slots] state words (dispatched / prefill_done stored by local routers,
            `kvsched.shm.words`), or None; folded with the progress words by `fold_progress`.
    Maps: request_id -> slot here; WorkerKey -> row in `rows` (`worker_rows.WorkerRows`).
    Attributes:
        block_size: tokens per block; stride: hashes kept per booking (the arena's max_blocks_per_request).
        out_blocks / out_prefill / out_cost: int64[W] / int64[W] / float64[W], what `project` writes and
            returns (one set, reused by every call: a `SelectionView` made over them sees each projection).
    """

    def __init__(
        self,
        arrays: LedgerArrays,
        progress: np.ndarray | None = None,
        overload: OverloadConfig | None = None,
        state: np.ndarray | None = None,
    ) -> None:
        self.arrays = arrays
        self.progress = progress
        self.state = state
        s = arrays.max_slots
        self._high = 0  # slots [0, _high) have been booked at least once (fold range)
        self._max_slots = s
        self.block_size = arrays.block_size
        self.stride = arrays.max_blocks_per_request
        w = arrays.max_workers
        self.out_blocks = np.zeros(w, np.int64)
        self.out_prefill = np.zeros(w, np.int64)
        self.out_cost = np.zeros(w, np.float64)
        self.rows = WorkerRows(arrays, overload if overload is not None else OverloadConfig())
        self.words = WordFold(arrays, self.rows, progress, state)
        self._adopt()

    def _adopt(self) -> None:
        """Rebuild the Python-side booking maps (free slots, request ids) from the slot table."""
        a = self.arrays
        self._slot_of: dict[str, int] = {}
        self._rid_of: list[str | None] = [None] * a.max_slots  # slot -> request id of its booking
        for slot in np.flatnonzero(a.s_state).tolist():
            rid = a.s_request_id[slot].decode()
            self._slot_of[rid] = slot
            self._rid_of[slot] = rid
        self._free: list[int] = np.flatnonzero(a.s_state == SLOT_FREE)[::-1].tolist()  # pop() = lowest
        live = np.flatnonzero(a.s_state)
        self._high = max(self._high, int(live[-1]) + 1 if live.size else 0)

    # -- workers (the row table, `worker_rows.WorkerRows`) -------------------------------------
    @property
    def version(self) -> int:
        """Grows whenever presence or a drained / overloaded / stale flag changes (memo key)."""
        return self.rows.version

    @property
    def overload(self) -> OverloadConfig:
        return self.rows.overload

    def add_worker(self, key: WorkerKey, total_kv_blocks: int, max_num_batched_tokens: int) -> int:
        """Register `key` in the lowest free row; returns the row. Bumps the row's w_generation.

        Raises:
            ValueError: `key` is already registered, or every row is taken ("max_workers=N reached").
        """
        return self.rows.add(key, total_kv_blocks, max_num_batched_tokens)

    def remove_worker_row(self, row: int) -> list[int]:
        """Release every booking on `row`, then free the row. Returns the released slots.

        Raises:
            KeyError: no worker in `row`.
        """
        a = self.arrays
        self.rows.check(row)
        slots = np.flatnonzero((a.s_state != SLOT_FREE) & (a.s_worker_row == row)).tolist()
        for slot in slots:
            self.release(slot, int(a.s_generation[slot]))
        self.rows.free(row)
        return slots

    def row_of(self, key: WorkerKey) -> int | None:
        return self.rows.row_of(key)

    def rows_of_worker_id(self, worker_id: int) -> list[int]:
        return self.rows.rows_of_worker_id(worker_id)

    def rows_of(self, worker_id: int, dp_rank: int | None) -> list[int]:
        """Rows of a worker (every rank when dp_rank is None). Raises KeyError when unknown."""
        return self.rows.rows_of(worker_id, dp_rank)

    def key_of(self, row: int) -> WorkerKey:
        """The worker in `row`. Raises KeyError for a row that holds none."""
        return self.rows.key_of(row)

    def live_rows(self) -> np.ndarray:
        """int64[k], rows holding a registered worker, ascending."""
        return self.rows.live_rows()

    def n_worker_ids(self) -> int:
        """Distinct registered worker ids (limits are scaled by this, docs/DESIGN.md §4.10)."""
        return self.rows.n_worker_ids()

    def worker_ids(self) -> frozenset[int]:
        """Registered worker ids."""
        return self.rows.worker_ids()

    def ranks_of(self, worker_id: int) -> int:
        """Registered ranks of `worker_id` (0 when unknown)."""
        return self.rows.ranks_of(worker_id)

    def set_drained(self, row: int, drained: bool) -> None:
        self.rows.check(row)
        self.rows.set_flag(row, FLAG_DRAINED, drained)

    def set_stale(self, row: int, stale: bool) -> None:
        """KV-event stream of `row` untrusted: its publisher disconnected or a gap unfilled past its limit
        (kvevents/staleness.py); its overlap falls back to the approximate index."""
        self.rows.check(row)
        self.rows.set_flag(row, FLAG_STALE, stale)

    def update_overload(self, row: int) -> bool:
        """Recompute `row`'s overloaded flag from its CURRENT load (docs/DESIGN.md §4.2); returns the flag."""
        return self.rows.update_overload(row)

    def eligible_mask(self, pinned: WorkerKey | None, allowed: frozenset[int] | None, out: np.ndarray) -> int:
        """Write uint8[max_workers] `out`: present, not drained, not overloaded, allowed / pinned.

        Args:
            pinned: the only worker the request may use, or None.
            allowed: worker ids (all ranks) the request may use, or None for any.
        Returns:
            int: number of eligible rows.
        """
        return self.rows.eligible_mask(pinned, allowed, out)

    @property
    def elig_cache(self) -> np.ndarray:
        """uint8[max_workers], the result of the last `eligible_mask` call. A caller that passes
        this array as `out` gets memo hits without a copy (it is overwritten by every call)."""
        return self.rows.elig_cache

    # -- bookings -----------------------------------------------------------------------------
    def reserve(
        self,
        request_id: str,
        row: int,
        isl_tokens: int,
        hashes: np.ndarray,
        cached_tokens: int,
        expected_osl: int | None,
        class_idx: int,
        enqueue_us: int,
        now_us: int,
        owner_pid: int = 0,
    ) -> tuple[int, int] | None:
        """Book `request_id` on `row`; returns (slot, generation), or None when no slot is free.

        Args:
            isl_tokens: prompt tokens (>= 1); hashes: uint64[n] chained block hashes.
            cached_tokens: prompt tokens already cached on `row` (outstanding prefill = isl - cached).
            expected_osl: expected output tokens or None; class_idx: policy class index.
            enqueue_us / now_us: enqueue and admission times (µs).
        Raises:
            ValueError: request_id already booked or longer than `protocol.MAX_REQUEST_ID_BYTES` UTF-8 bytes.
            KeyError: no worker in `row`.
        """
        self.rows.check(row)
        got = self.take_slot(request_id)
        if got is None:
            return None
        slot, _rid = got
        a = self.arrays
        gen = reserve_slot(
            slot,
            row,
            int(isl_tokens),
            np.asarray(hashes, dtype=np.uint64),
            int(cached_tokens),
            -1 if expected_osl is None else int(expected_osl),
            int(class_idx),
            int(enqueue_us),
            int(now_us),
            int(owner_pid),
            self.block_size,
            self.stride,
            a.w_generation,
            a.w_active_blocks,
            a.w_active_prefill,
            a.w_active_requests,
            a.ref_keys,
            a.ref_counts,
            a.arena,
            a.s_state,
            a.s_generation,
            a.s_worker_row,
            a.s_worker_generation,
            a.s_isl,
            a.s_cached,
            a.s_prefill,
            a.s_expected_osl,
            a.s_output_tokens,
            a.s_extra_blocks,
            a.s_class,
            a.s_enqueue_us,
            a.s_admit_us,
            a.s_arena_off,
            a.s_arena_len,
            a.s_owner_pid,
        )
        self.booked(slot, request_id, row)
        return slot, gen

    def take_slot(self, request_id: str) -> tuple[int, bytes] | None:
        """The first half of `reserve`: check `request_id`, take the lowest free slot and write the
        id into its request-id column (the slot stays free until `reserve_slot` books it). Returns
        (slot, encoded id), or None when no slot is free. A caller that does not book the slot gives
        it back with `give_back`.

        Raises:
            ValueError: request_id already booked or longer than `protocol.MAX_REQUEST_ID_BYTES` UTF-8 bytes.
        """
        rid = request_id.encode()
        if len(rid) > MAX_REQUEST_ID_BYTES:
            raise ValueError(f"request_id longer than {MAX_REQUEST_ID_BYTES} bytes")
        if request_id in self._slot_of:
            raise ValueError(f"request {request_id!r} is already booked")
        if not self._free:
            return None
        slot = self._free.pop()
        self.arrays.s_request_id[slot] = rid
        return slot, rid

    def give_back(self, slot: int) -> None:
        """Return a slot `take_slot` gave and nothing booked: the free list is as before."""
        self._free.append(slot)

    def booked(self, slot: int, request_id: str, row: int) -> None:
        """The last half of `reserve`, after `reserve_slot` booked `slot` on `row`: the id maps, the
        fold range and the row's overload flag."""
        if slot >= self._high:
            self._high = slot + 1
        self._slot_of[request_id] = slot
        self._rid_of[slot] = request_id
        if self.rows.overload_rules:
            self.rows.update_overload(row)

    def release(self, slot: int, generation: int) -> bool:
        """Free booking (slot, generation) and take its load off its worker. False (no-op) if stale/free."""
        return self.release_booking(slot, generation) >= 0

    def release_booking(self, slot: int, generation: int) -> int:
        """Free booking (slot, generation) (one `booking_kernels.release_booking` call: refcounts,
        aggregates, slot state); returns its worker row, or -1 (no-op) when stale or free."""
        if not 0 <= slot < self._max_slots:
            return -1
        fn, table, _ = self._k_release
        row: int = fn(slot, generation, table)
        if row < 0:
            return -1
        rid = self._rid_of[slot]
        self._rid_of[slot] = None
        self._slot_of.pop(rid if rid is not None else self.arrays.s_request_id[slot].decode(), None)
        self._free.append(slot)
        if self.rows.overload_rules:
            self.rows.update_overload(row)
        return row

    def dispatched(self, slot: int, generation: int) -> bool:
        """The backend accepted the request (state admitted -> dispatched). False if stale."""
        if not 0 <= slot < self._max_slots:
            return False
        fn, state, gens = self._k_dispatched  # the arrays named, not `*args`: no tuple built per call
        ok: bool = fn(slot, generation, state, gens)
        return ok

    def prefill_done(self, slot: int, generation: int) -> bool:
        """First output token seen: the booking's outstanding prefill leaves its worker. False if stale."""
        return self.prefill_done_row(slot, generation) >= 0

    def prefill_done_row(self, slot: int, generation: int) -> int:
        """`prefill_done` (one `booking_kernels.slot_prefill_done` call); returns the booking's worker
        row, or -1 when stale."""
        if not 0 <= slot < self._max_slots:
            return -1
        fn, st, gens, rows, prefill, w_prefill = self._k_prefill_done
        row: int = fn(slot, generation, st, gens, rows, prefill, w_prefill)
        if row >= 0 and self.rows.overload_rules:
            self.rows.update_overload(row)
        return row

    def output_tokens_row(self, slot: int, generation: int, n: int) -> int:
        """Output tokens so far (Update(progress)); same effect as a folded progress word. The count
        only moves forward: a value <= the current one is ignored. One `booking_kernels.slot_output_tokens`
        call; returns the booking's worker row when the count moved forward, else -1 (stale or ignored)."""
        if not 0 <= slot < self._max_slots:
            return -1
        fn, args = self._k_output_tokens
        row: int = fn(slot, generation, int(n), *args)
        if row >= 0 and self.rows.overload_rules:
            self.rows.update_overload(row)
        return row

    # -- the routers' words (`word_fold.WordFold`) ---------------------------------------------
    def fold_progress(self, every_slot: bool = False) -> int:
        """Fold the routers' words into the slots and aggregates (`WordFold.fold_progress`)."""
        return self.words.fold_progress(self.arrays.max_slots if every_slot else self._high)

    def fold(self) -> tuple[list[int], list[int]]:
        """Fold the routers' words and take what changed (`WordFold.fold`): (rows whose capacity
        changed, ascending; slots whose `dispatched` flag appeared)."""
        return self.words.fold(self._high)

    def fold_progress_rows(self) -> list[int]:
        """Fold; the rows whose capacity changed, ascending (`WordFold.fold_progress_rows`)."""
        return self.words.fold_progress_rows(self._high)

    def take_dispatched(self) -> list[int]:
        """Slots whose `dispatched` flag the last fold saw appear (`WordFold.take_dispatched`)."""
        return self.words.take_dispatched()

    # -- the one-event kernels, bound to this ledger's arrays (`shm.bind.entry_point`) -------------
    @cached_property
    def _k_release(self) -> tuple[Any, ...]:
        """`release_booking_packed` with the table of this ledger's 13 arrays (`shm.booking_packed`);
        the arrays stay referenced beside the table (`shm.argtable`)."""
        a = self.arrays
        table = pack_release_arrays(a)
        return entry_point(release_booking_packed, (0, 0, table)), table, a

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles drop the release kernel's argument table (`shm.argtable`: it holds this
        process's addresses of the original arrays); the copy builds its own on first use."""
        state = dict(self.__dict__)
        state.pop("_k_release", None)
        return state

    @cached_property
    def _k_dispatched(self) -> tuple[Any, ...]:
        args = (self.arrays.s_state, self.arrays.s_generation)
        return entry_point(slot_dispatched, (0, 0, *args)), *args

    @cached_property
    def _k_prefill_done(self) -> tuple[Any, ...]:
        a = self.arrays
        args = (a.s_state, a.s_generation, a.s_worker_row, a.s_prefill, a.w_active_prefill)
        return entry_point(slot_prefill_done, (0, 0, *args)), *args

    @cached_property
    def _k_output_tokens(self) -> tuple[Any, ...]:
        a = self.arrays
        args = (*a.load, self.block_size)
        return entry_point(slot_output_tokens, (0, 0, 0, *args)), args

    # -- decisions ----------------------------------------------------------------------------
    def project(
        self,
        hashes: np.ndarray,
        isl_tokens: int,
        overlap_blocks: np.ndarray,
        eligible: np.ndarray,
        prefill_load_scale: float,
        overlap_credit: float,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Projected blocks int64[W], prefill tokens int64[W] and cost float64[W] (one kernel call).

        The returned arrays are reused by the next call: copy them to keep them. Ineligible rows
        hold -1 / -1 / +inf. overlap_blocks: int32[W]; eligible: uint8[W].
        """
        a = self.arrays
        project_and_cost(
            a.w_active_blocks,
            a.w_active_prefill,
            eligible,
            a.ref_keys,
            a.ref_counts,
            np.asarray(hashes, dtype=np.uint64),
            int(isl_tokens),
            self.block_size,
            overlap_blocks,
            float(prefill_load_scale),
            float(overlap_credit),
            self.out_blocks,
            self.out_prefill,
            self.out_cost,
        )
        return self.out_blocks, self.out_prefill, self.out_cost

    # -- introspection ------------------------------------------------------------------------
    def worker_rows(self) -> list[WorkerRow]:
        """One row per registered worker rank for the admin socket: capacity, current load, flags."""
        a = self.arrays
        return [
            WorkerRow(
                worker_id=int(a.w_worker_id[r]),
                dp_rank=int(a.w_dp_rank[r]),
                total_kv_blocks=int(a.w_total_kv_blocks[r]),
                max_num_batched_tokens=int(a.w_max_batched_tokens[r]),
                active_blocks=int(a.w_active_blocks[r]),
                active_prefill_tokens=int(a.w_active_prefill[r]),
                active_requests=int(a.w_active_requests[r]),
                drained=bool(a.w_flags[r] & FLAG_DRAINED),
                overloaded=bool(a.w_flags[r] & FLAG_OVERLOADED),
                stale=bool(a.w_flags[r] & FLAG_STALE),
            )
            for r in self.live_rows().tolist()
        ]

    def slot_info(self, slot: int) -> SlotInfo:
        """The booking in `slot` (`slot_table.read_slot`)."""
        return read_slot(self.arrays, slot)

    def live_slots(self) -> list[int]:
        return np.flatnonzero(self.arrays.s_state).tolist()

    def n_free_slots(self) -> int:
        return len(self._free)

    def rebuild_aggregates(self) -> None:
        """Recompute w_active_* and the refcount index from the slot table + arena (daemon restart).

        Bookings on rows that no longer hold a worker are freed (`slot_table.rebuild_aggregates`).
        """
        rebuild_aggregates(self.arrays)
        self.rows.adopt()
        self._adopt()
        if self.rows.overload_enabled():
            self.rows.update_overload_all()
