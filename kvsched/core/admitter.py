"""Admitter: readiness, cost snapshots, `admit_one` and the dispatch pass (docs/DESIGN.md §4.17
Guardrails: admit_one is the only path to a worker).

`admit_one` = project (the overlap view's credited depths + one `Ledger.project` kernel call) →
select (pure selector; pinned → that worker) → skip if the owner is known gone → reserve
(`Ledger.reserve`) → `Admit` record; then the request's hashes are recorded in the overlap view
(`OverlapView.record`). The actor delivers the record and, if delivery fails, calls
`Scheduler.release(..., "aborted")` (docs/DESIGN.md §4.11: a failed delivery must release).

Busy / overload are read from CURRENT load (never projected), so an oversized request is never stuck
forever. A worker is *placeable* for a request when it is registered, not drained and within the
request's pin and allowed set; *eligible* when placeable and not overloaded. The cost snapshot uses
the best placeable worker (docs/PROTOCOL.md "Scheduling contracts").

Scratch arrays (eligible rows, placeable rows, the selection view, the explain ring) are allocated
once; the decision path allocates only what it keeps (the lease's records, one explain tuple).

`admit_fast` is the immediate path of the default configuration in one kernel call
(`fused_admit.FusedAdmission.admit`); it decides exactly as `admit_one` does, or books nothing and the
caller takes the Python path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..config import ClassConfig, SelectorConfig
from ..shm.layout import FLAG_DRAINED
from ..shm.overlap import OverlapIndex
from ..shm.select_kernels import count_busy
from .admission import FleetView
from .explain_ring import ExplainRing
from .fused_admit import FusedAdmission
from .kv_cost import KvSelector
from .live import READY, Live
from .selector import SelectionView
from .types import EMPTY_HASHES, Admit, CostSnapshot, Reject, RequestSpec, WorkerKey

if TYPE_CHECKING:
    from .leases import LeaseTable
    from .ledger import Ledger
    from .ordering import QueueEntry
    from .overlap_view import OverlapView
    from .policy_queue import PolicyQueue
    from .selector import WorkerSelector

EXPLAIN_RING = 1024  # admissions kept for `kvsched explain`


class Admitter:
    """project → select → reserve, and the readiness predicates the dispatch pass asks.

    Args:
        ledger: the `Ledger`; view: the `OverlapView`; selector: the `WorkerSelector`.
        leases: the `LeaseTable` (an admission becomes a lease there).
        pq: the `PolicyQueue` (replaced by a profile reload: assign `pq`).
        selector_cfg: the `[selector]` table (prefill_load_scale, overlap_credit).
    Attributes:
        decisions_total: every Admit and Reject produced (`reject` counts the rejections).
        explain: `ExplainRing` of the last `EXPLAIN_RING` admissions (worker ids / ranks / present
            copies are shared between decisions while the worker table is unchanged; costs are kept
            only when there are no terms, whose sum is the cost).
        fused: True when `admit_fast` may decide (the `kv` selector, `KvSelector.decides_by_kernel`,
            over an `OverlapIndex`); False sends every request through `admit_one`.
        admit_fast: `FusedAdmission.admit` of this admitter (`fast`): the immediate path in one kernel call.
    """

    def __init__(
        self,
        ledger: Ledger,
        view: OverlapView,
        selector: WorkerSelector,
        leases: LeaseTable,
        pq: PolicyQueue,
        selector_cfg: SelectorConfig,
    ) -> None:
        self.ledger, self.view, self.selector, self.leases, self.pq = ledger, view, selector, leases, pq
        self._selector_cfg = selector_cfg
        w = ledger.arrays.max_workers
        self.elig = ledger.elig_cache  # eligible rows of the last eligible_mask call (memo hits copy nothing)
        self.placeable = np.zeros(w, np.bool_)  # placeable rows of the last `placeable_mask`
        self._placeable_key: tuple | None = None
        self._placeable_n = 0
        self._placeable_rows: list[int] | None = None  # placeable rows, None when every row is
        self.explain = ExplainRing(EXPLAIN_RING, w)
        self._ids_key: int | None = None
        self._ids: tuple = ()
        self.decisions_total = 0
        a = ledger.arrays
        self.fast = FusedAdmission(self)
        self.admit_fast = self.fast.admit
        self._view = SelectionView(
            ledger.out_prefill,
            ledger.out_blocks,
            a.w_active_prefill,
            a.w_active_blocks,
            a.w_total_kv_blocks,
            a.w_max_batched_tokens,
            0,
            ledger.block_size,
            0,
        )
        self.use_selector(selector)

    def use_selector(self, selector: WorkerSelector) -> None:
        """Decide with `selector` from now on (start; a profile reload that rebuilt it): the fused path
        is on for a kernel-decidable `KvSelector` over an `OverlapIndex`; kernel parameters are re-packed."""
        self.selector = selector
        self.fused = (
            type(selector) is KvSelector and selector.decides_by_kernel() and isinstance(self.view.approx, OverlapIndex)
        )
        if self.fused:
            selector.reserve_rows(self.ledger.arrays.max_workers)
        self.fast.reset()

    @property
    def selector_cfg(self) -> SelectorConfig:
        """The `[selector]` table (a profile reload assigns it; the kernel parameters follow)."""
        return self._selector_cfg

    @selector_cfg.setter
    def selector_cfg(self, cfg: SelectorConfig) -> None:
        self._selector_cfg = cfg
        self.fast.reset()

    # ---- busy / eligibility (current load) ---------------------------------------------------
    def busy_rows(self, cls: ClassConfig) -> np.ndarray | None:
        """bool[W]: rows whose active prefill tokens exceed the class threshold; None = never busy."""
        a = self.ledger.arrays
        busy = None
        if cls.prefill_busy_threshold is not None:
            busy = a.w_active_prefill > cls.prefill_busy_threshold
        if cls.prefill_busy_threshold_frac is not None:
            frac = a.w_active_prefill > cls.prefill_busy_threshold_frac * a.w_max_batched_tokens
            busy = frac if busy is None else busy | frac
        return busy

    def class_busy(self, cls: ClassConfig, elig: np.ndarray, n_elig: int) -> bool:
        """True when at least busy_worker_ratio of the eligible rows are busy (docs/DESIGN.md §4.1).
        One `count_busy` kernel call (the same comparisons as `busy_rows`)."""
        thr, frac = cls.prefill_busy_threshold, cls.prefill_busy_threshold_frac
        if (thr is None and frac is None) or n_elig == 0:
            return False
        a = self.ledger.arrays
        n_busy = count_busy(
            a.w_active_prefill,
            a.w_max_batched_tokens,
            elig,
            -1 if thr is None else int(thr),
            -1.0 if frac is None else float(frac),
        )
        return n_busy >= cls.busy_worker_ratio * n_elig - 1e-9

    def lane_ready(self, class_idx: int, worker: WorkerKey) -> bool:
        """May the lane of `worker` (class `class_idx`) dispatch its head now?"""
        row = self.ledger.row_of(worker)
        if row is None or self.ledger.eligible_mask(worker, None, self.elig) == 0:
            return False
        cls = self.pq.classes[class_idx].config
        thr, frac = cls.prefill_busy_threshold, cls.prefill_busy_threshold_frac
        a = self.ledger.arrays
        ap = a.w_active_prefill[row]
        return not ((thr is not None and ap > thr) or (frac is not None and ap > frac * a.w_max_batched_tokens[row]))

    def shared_ready(self, class_idx: int, entry: QueueEntry) -> bool:
        """May the shared root run now: some allowed worker eligible and the class not busy?"""
        spec: RequestSpec = entry.payload.spec
        n = self.ledger.eligible_mask(None, spec.allowed_workers, self.elig)
        return n > 0 and not self.class_busy(self.pq.classes[class_idx].config, self.elig, n)

    def placeable_mask(
        self, pinned: WorkerKey | None, allowed: frozenset[int] | None, drained_count: bool = False
    ) -> int:
        """Write bool[max_workers] `self.placeable`: rows placeable for a request with this pin and
        allowed set (registered, not drained, within pin / allowed; overload ignored). With
        `drained_count`, drained rows count too (worker removal: drain is temporary). Returns how
        many. Memoised on (pin, allowed, drained_count, ledger version)."""
        key = (pinned, allowed, drained_count, self.ledger.version)
        if key == self._placeable_key:
            return self._placeable_n
        a = self.ledger.arrays
        ok = a.w_present != 0
        if not drained_count:
            ok &= (a.w_flags & FLAG_DRAINED) == 0
        if allowed is not None:
            ok &= np.isin(a.w_worker_id, np.fromiter(allowed, np.int64, len(allowed)))
        if pinned is not None:
            row = self.ledger.row_of(pinned)
            keep = row is not None and bool(ok[row])
            ok[:] = False
            if keep:
                ok[row] = True
        self.placeable[:] = ok
        self._placeable_key, self._placeable_n = key, int(np.count_nonzero(ok))
        self._placeable_rows = None if self._placeable_n == ok.shape[0] else np.flatnonzero(ok).tolist()
        return self._placeable_n

    def snapshot(self, spec: RequestSpec, pinned: WorkerKey | None, now_us: int) -> CostSnapshot:
        """Cost snapshot: cached tokens on the pinned worker, else on the best *placeable* worker,
        overloaded or not (Dynamo kv-router guardrail: WSPT uses the best allowed worker's cached
        tokens); raw ISL only when there is no cache data or no placeable worker."""
        return CostSnapshot.of(spec.isl_tokens, self._cached_tokens(spec, pinned, now_us))

    def snapshot_cost(self, spec: RequestSpec, pinned: WorkerKey | None, now_us: int) -> int:
        """`snapshot(...).cost` (tokens, >= 1) without building the record."""
        cached = min(self._cached_tokens(spec, pinned, now_us), spec.isl_tokens)
        return max(1, spec.isl_tokens - max(0, cached))

    def _cached_tokens(self, spec: RequestSpec, pinned: WorkerKey | None, now_us: int) -> int:
        hashes = spec.block_hashes
        if len(hashes) == 0:
            return 0
        if pinned is not None:
            row = self.ledger.row_of(pinned)
            if row is None:
                return 0
            depth = self.view.depth(hashes, now_us)
            return int(depth[row]) * self.ledger.block_size
        if self.placeable_mask(None, spec.allowed_workers) == 0:
            return 0
        depth = self.view.depth(hashes, now_us)
        rows, d = self._placeable_rows, depth.tolist()  # a list max: a few rows, no ufunc overhead
        return (max(d) if rows is None else max(d[r] for r in rows)) * self.ledger.block_size

    def fleet(self) -> FleetView:
        a = self.ledger.arrays
        present = a.w_present != 0
        return FleetView(
            int(a.w_active_blocks[present].sum()), int(a.w_total_kv_blocks[present].sum()), self.ledger.block_size
        )

    # ---- admit_one ---------------------------------------------------------------------------
    def admit_one(self, live: Live, now_us: int) -> Admit | Reject | None:
        """The only path to a worker. Returns Admit, Reject("overloaded": slot table full), or None
        (no eligible worker: the caller keeps the request; or owner gone: request dropped)."""
        spec, entry = live.spec, live.entry
        pin = entry.placement
        if self.ledger.eligible_mask(pin, spec.allowed_workers, self.elig) == 0:
            return None
        hashes = spec.block_hashes if len(spec.block_hashes) else EMPTY_HASHES
        blocks, prefill, costs = self._project(hashes, spec.isl_tokens, now_us)
        view = self._view
        view.isl_tokens, view.now_us = int(spec.isl_tokens), now_us
        row, terms = self._select(pin, costs, len(hashes), view)
        if row < 0:
            return None
        if not self.leases.owner_alive(spec.owner):
            self.leases.drop(live, abort=True)
            return None
        return self._reserve(live, row, hashes, blocks, prefill, costs, now_us, view, terms)

    def _project(self, hashes: np.ndarray, isl_tokens: int, now_us: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        depth = self.view.depth(hashes, now_us) if len(hashes) else self.view.zero()
        sel = self.selector_cfg
        return self.ledger.project(hashes, isl_tokens, depth, self.elig, sel.prefill_load_scale, sel.overlap_credit)

    def _select(
        self, pin: WorkerKey | None, costs: np.ndarray, request_blocks: int, view: SelectionView
    ) -> tuple[int, dict | None]:
        """(row or -1, the selector's cost terms if it computed them on the way)."""
        if pin is not None:
            row = self.ledger.row_of(pin)
            return (-1 if row is None else row), None
        return self.selector.select_explained(
            costs,
            self.elig,
            self.ledger.arrays.w_active_requests,
            overlap_blocks=self.view.depth_out,
            request_blocks=request_blocks,
            view=view,
        )

    def _reserve(
        self,
        live: Live,
        row: int,
        hashes: np.ndarray,
        blocks: np.ndarray,
        prefill: np.ndarray,
        costs: np.ndarray,
        now_us: int,
        view: SelectionView,
        terms: dict | None,
    ) -> Admit | Reject:
        spec, entry, depth = live.spec, live.entry, self.view.depth_out
        ledger = self.ledger
        overlap_blocks = int(depth[row])
        cached = min(spec.isl_tokens, overlap_blocks * ledger.block_size)
        cls_name = self.pq.classes[entry.class_idx].name
        got = ledger.reserve(
            spec.request_id,
            row,
            spec.isl_tokens,
            hashes,
            cached,
            spec.expected_osl,
            entry.class_idx,
            entry.arrival_us,
            now_us,
            spec.owner,
        )
        if got is None:
            self.leases.drop(live, abort=True)
            return self.reject(spec, "overloaded", "slot table full", cls_name)
        self.leases.leased(live, *got)
        if len(hashes):
            live.wrote = self.view.record(hashes, row, now_us)
        self.selector.note_admitted(row, overlap_blocks, len(hashes))
        if terms is None:  # pinned, or a selector that does not compute terms on the way: before `admitted`
            terms = self.selector.terms(costs, self.elig, depth, view)
        self.selector.admitted(row, spec.isl_tokens - cached, now_us, spec.isl_tokens)
        self.explain.add(
            spec.request_id, row, now_us, self.elig, depth, blocks, prefill, costs, self.fleet_ids(), terms
        )
        self.decisions_total += 1
        return Admit(
            spec.request_id,
            spec.owner,
            ledger.key_of(row),
            live.slot,
            live.generation,
            overlap_blocks,
            cached,
            max(0, now_us - entry.arrival_us),
            cls_name,
        )

    def fleet_ids(self) -> tuple:
        """(worker ids, dp ranks, present) copies for the explain ring, shared by every decision
        until the ledger's worker table changes (its `version`)."""
        v = self.ledger.version
        if self._ids_key != v:
            a = self.ledger.arrays
            self._ids_key, self._ids = v, (a.w_worker_id.copy(), a.w_dp_rank.copy(), a.w_present.copy())
        return self._ids

    def reject(
        self, spec: RequestSpec, reason: str, detail: str, cls_name: str, **figures: int | str | bool | None
    ) -> Reject:
        """A `Reject` record for `spec` (counted in `decisions_total`)."""
        self.decisions_total += 1
        return Reject(spec.request_id, spec.owner, reason, detail, cls_name, **figures)

    # ---- the dispatch pass -------------------------------------------------------------------
    def dispatch(self, now_us: int) -> list[Admit | Reject]:
        """While some class has a dispatchable head (DRR picks the class), admit_one it."""
        out: list[Admit | Reject] = []
        pq, live_map = self.pq, self.leases.live
        if not any(cq.has_ready() for cq in pq.classes):
            return out  # nothing ready: DRR state is already reset (every empty class has no credit)
        while self.ledger.n_free_slots() > 0:  # slot table full: keep waiting, not reject
            entry = pq.pop_next(self.lane_ready, self.shared_ready)
            if entry is None:
                break
            live: Live = entry.payload
            got = self.admit_one(live, now_us)
            if got is not None:
                out.append(got)
            elif live.state == READY and live.spec.request_id in live_map:
                pq.put_back(entry)  # nothing eligible after all: keep it, stop this pass
                break
        return out
