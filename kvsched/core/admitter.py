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
(`shm.admit_kernels.admit_kv_packed`: `admit_kv` with its fixed arrays given as one table; overlap →
busy rule → cost snapshot → projection → kv terms and argmin → booking → overlap record → recent
work). It decides exactly as `admit_one` does: the
kernel composes the same kernels `admit_one` calls, and whenever the decision is not a unique
finite minimum (ties draw from the selector's RNG), the class is busy, or anything else the kernel
does not cover applies, it books nothing and the caller takes the Python path.
"""

from __future__ import annotations

import numpy as np

from ..config import ClassConfig
from ..shm.admit_kernels import OUT_CACHED, OUT_GENERATION, OUT_EVICTED, OUT_LEN, OUT_OVERLAP, OUT_SNAPSHOT, P, UNDECIDED, pack_kv_params
from ..shm.admit_packed import admit_kv_packed, pack_admit_arrays
from ..shm.layout import FLAG_DRAINED
from ..shm.overlap import INT64_MAX, OverlapIndex
from ..shm.select_kernels import count_busy
from .admission import FleetView
from .explain_ring import ExplainRing
from .kv_cost import KvSelector
from .leases import LEASED, READY, Live
from .ordering import QueueEntry
from .selector import SelectionView
from .types import EMPTY_HASHES, Admit, CostSnapshot, Reject, RequestSpec, WorkerKey

EXPLAIN_RING = 1024  # admissions kept for `kvsched explain`
_U64 = np.dtype(np.uint64)  # the block hashes' dtype (an `is` test first: ~0.3 µs less than `!=`)


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
    """

    def __init__(self, ledger, view, selector, leases, pq, selector_cfg) -> None:
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
        self._view = SelectionView(ledger._out_prefill, ledger._out_blocks, a.w_active_prefill,  # noqa: SLF001
                                   a.w_active_blocks, a.w_total_kv_blocks, a.w_max_batched_tokens, 0,
                                   ledger.block_size, 0)
        self.use_selector(selector)
        self._params: dict[int, tuple] = {}  # class index -> (ClassConfig, admit_kv params)
        self._scratch = np.zeros((4, w), np.float64)
        self._out = np.zeros(OUT_LEN, np.int64)
        self._arrays: tuple | None = None  # (the objects read, the arrays, `_kernel_arrays()`)

    def use_selector(self, selector) -> None:  # noqa: ANN001 - a WorkerSelector
        """Decide with `selector` from now on (start; a profile reload that rebuilt it): the fused path
        is on for a kernel-decidable `KvSelector` over an `OverlapIndex`; kernel parameters are re-packed."""
        self.selector = selector
        self.fused = (type(selector) is KvSelector and selector.decides_by_kernel()
                      and isinstance(self.view.approx, OverlapIndex))
        if self.fused:
            selector.reserve_rows(self.ledger.arrays.max_workers)
        self._params = {}

    @property
    def selector_cfg(self):  # noqa: ANN201 - the [selector] table
        """The `[selector]` table (a profile reload assigns it; the kernel parameters follow)."""
        return self._selector_cfg

    @selector_cfg.setter
    def selector_cfg(self, cfg) -> None:  # noqa: ANN001
        self._selector_cfg = cfg
        self._params = {}

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
        n_busy = count_busy(a.w_active_prefill, a.w_max_batched_tokens, elig, -1 if thr is None else int(thr),
                            -1.0 if frac is None else float(frac))
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

    def shared_ready(self, class_idx: int, entry) -> bool:  # noqa: ANN001 - a QueueEntry
        """May the shared root run now: some allowed worker eligible and the class not busy?"""
        spec: RequestSpec = entry.payload.spec
        n = self.ledger.eligible_mask(None, spec.allowed_workers, self.elig)
        return n > 0 and not self.class_busy(self.pq.classes[class_idx].config, self.elig, n)

    def placeable_mask(self, pinned: WorkerKey | None, allowed: frozenset[int] | None,
                       drained_count: bool = False) -> int:
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
        return FleetView(int(a.w_active_blocks[present].sum()), int(a.w_total_kv_blocks[present].sum()),
                         self.ledger.block_size)

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

    def _project(self, hashes: np.ndarray, isl_tokens: int, now_us: int):
        depth = self.view.depth(hashes, now_us) if len(hashes) else self.view.zero()
        sel = self.selector_cfg
        return self.ledger.project(hashes, isl_tokens, depth, self.elig, sel.prefill_load_scale, sel.overlap_credit)

    def _select(self, pin: WorkerKey | None, costs: np.ndarray, request_blocks: int,
                view: SelectionView) -> tuple[int, dict | None]:
        """(row or -1, the selector's cost terms if it computed them on the way)."""
        if pin is not None:
            row = self.ledger.row_of(pin)
            return (-1 if row is None else row), None
        return self.selector.select_explained(costs, self.elig, self.ledger.arrays.w_active_requests,
                                              overlap_blocks=self.view.depth_out, request_blocks=request_blocks,
                                              view=view)

    def _reserve(self, live: Live, row: int, hashes: np.ndarray, blocks: np.ndarray, prefill: np.ndarray,
                 costs: np.ndarray, now_us: int, view: SelectionView, terms: dict | None) -> Admit | Reject:
        spec, entry, depth = live.spec, live.entry, self.view.depth_out
        ledger = self.ledger
        overlap_blocks = int(depth[row])
        cached = min(spec.isl_tokens, overlap_blocks * ledger.block_size)
        cls_name = self.pq.classes[entry.class_idx].name
        got = ledger.reserve(spec.request_id, row, spec.isl_tokens, hashes, cached, spec.expected_osl,
                             entry.class_idx, entry.arrival_us, now_us, spec.owner)
        if got is None:
            self.leases.drop(live, abort=True)
            return self.reject(spec, "overloaded", "slot table full", cls_name)
        if live.share_key is not None:
            self.leases.shares.remove(live)
        live.state, (live.slot, live.generation) = LEASED, got
        self.leases.by_slot[live.slot] = live
        if len(hashes):
            live.wrote = self.view.record(hashes, row, now_us)
        self.selector.note_admitted(row, overlap_blocks, len(hashes))
        if terms is None:  # pinned, or a selector that does not compute terms on the way: before `admitted`
            terms = self.selector.terms(costs, self.elig, depth, view)
        self.selector.admitted(row, spec.isl_tokens - cached, now_us, spec.isl_tokens)
        self.explain.add(spec.request_id, row, now_us, self.elig, depth, blocks, prefill, costs, self._fleet_ids(), terms)
        self.decisions_total += 1
        return Admit(spec.request_id, spec.owner, ledger.key_of(row), live.slot, live.generation,
                     overlap_blocks, cached, max(0, now_us - entry.arrival_us), cls_name)

    # ---- the fused immediate path ------------------------------------------------------------
    def _params_of(self, cq) -> np.ndarray:  # noqa: ANN001 - a PolicyClassQueue
        """`admit_kv`'s params for class `cq` (rebuilt when its config or the `[selector]` table changes)."""
        got = self._params.get(cq.index)
        if got is None or got[0] is not cq.config:
            p = pack_kv_params(self.selector, self._selector_cfg, cq.config)
            p[P["inv_bs"]] = 1.0 / float(self.ledger.block_size)
            got = self._params[cq.index] = (cq.config, p)
        return got[1]

    def _kernel_arrays(self) -> tuple:
        """`admit_kv_packed`'s last arguments: (block_size, stride, the table of `admit_kv`'s 41 fixed
        arrays). Built once, again when one of the objects it reads is replaced (explain ring, the
        selector's recent-work array, ledger arrays, approximate index, depth or eligibility array);
        the cache keeps the arrays alive while the table holds their addresses (`shm.argtable`)."""
        ring, recent, ledger, view = self.explain, self.selector.recent, self.ledger, self.view
        got = self._arrays
        if got is not None:
            k = got[0]
            if (k[0] is ring and k[1] is recent and k[2] is ledger.arrays and k[3] is view.approx
                    and k[4] is view.depth_out and k[5] is self.elig):
                return got[2]
        key = (ring, recent, ledger.arrays, view.approx, view.depth_out, self.elig)
        a, ix = ledger.arrays, view.approx
        arrays = (self.elig, self.placeable, ix.keys, ix.used, ix.perm, ix.ttlm, ix.ttl_exp, ix._scratch,  # noqa: SLF001
                  view.depth_out, a.w_generation, a.w_active_blocks, a.w_active_prefill, a.w_active_requests,
                  a.w_max_batched_tokens, a.ref_keys, a.ref_counts, a.arena, a.s_state, a.s_generation, a.s_worker_row,
                  a.s_worker_generation, a.s_isl, a.s_cached, a.s_prefill, a.s_expected_osl, a.s_output_tokens,
                  a.s_extra_blocks, a.s_class, a.s_enqueue_us, a.s_admit_us, a.s_arena_off, a.s_arena_len,
                  a.s_owner_pid, recent, self._scratch, ring.elig, ring.depth, ring.blocks, ring.prefill, ring.terms,
                  self._out)
        args = (ledger.block_size, ledger._stride, pack_admit_arrays(arrays))  # noqa: SLF001
        self._arrays = (key, arrays, args)
        return args

    def __getstate__(self) -> dict:
        """Copies and pickles drop the argument tables (`shm.argtable`): they hold this process's
        addresses of the original arrays; the copy builds its own on first use."""
        return {**self.__dict__, "_arrays": None}

    def admit_fast(self, spec: RequestSpec, cq, seq, now_us: int) -> Admit | None:  # noqa: ANN001
        """Admit `spec` at once with one `admit_kv` kernel call, or None: nothing changed, the caller
        decides by the Python path (module docstring).

        The caller has checked: `fused`, `eligible_mask` > 0 into `elig`, an unpinned request, a class
        (`cq`) without an admission policy and without a ready backlog. `seq` is the enqueue_seq
        counter (drawn only when the request is admitted). One function on purpose: this runs for
        every immediate admission, and each Python call here costs ~0.2-0.4 µs (docs/BENCHMARKS.md §4b).
        """
        hashes, isl, sel = spec.block_hashes, spec.isl_tokens, self.selector
        dt = hashes.dtype
        if (dt is not _U64 and dt != _U64) or not sel.kernel_may_decide(isl) or not self.leases.owner_alive(spec.owner):
            return None
        ledger, view, ring, rid = self.ledger, self.view, self.explain, spec.request_id
        try:
            got = ledger.take_slot(rid)
        except ValueError:  # the Python path raises it
            return None
        if got is None:  # slot table full: the Python path rejects
            return None
        slot = got[0]
        allowed = spec.allowed_workers
        if self._placeable_key != (None, allowed, False, ledger.rows.version):  # `placeable_mask`'s memo, checked here
            self.placeable_mask(None, allowed)
        own_depth = view.approx_only()
        if not own_depth:
            view.depth(hashes, now_us)
        recent_at = sel.recent_at_us
        row = admit_kv_packed(hashes, isl, now_us, slot, -1 if spec.expected_osl is None else spec.expected_osl,
                              cq.index, now_us, spec.owner, min(now_us + view.ttl_us, INT64_MAX - 1),
                              sel._decay(now_us), 1 if now_us > recent_at else 0, 0 if own_depth else 1,  # noqa: SLF001
                              ring.head, self._params_of(cq), *self._kernel_arrays())
        if own_depth:
            view.drop_memo()  # the kernel wrote depth_out
        if row < 0:
            ledger.give_back(slot)
            if row == UNDECIDED:
                ring.lose_head()
            return None
        # the Python half: maps, lease, overlap versions, explain record
        out = self._out.tolist()
        gen, ob, cached = out[OUT_GENERATION], out[OUT_OVERLAP], out[OUT_CACHED]
        ledger.booked(slot, rid, row)
        if now_us > recent_at and sel.recent_weight > 0.0:
            sel.recent_at_us = now_us
        if sel.home_weight > 0.0 and cached > 0 and cached >= sel.home_min_cached_share * isl:
            sel.note_home(row, isl, isl - cached, now_us)  # what `admitted` counts (its condition, checked first)
        entry = QueueEntry(rid, next(seq), now_us, spec.priority, spec.strict_priority, out[OUT_SNAPSHOT], isl, None,
                           cq.index)
        live = Live(spec, entry, LEASED, slot, gen)
        entry.payload = live
        leases = self.leases
        leases.register(live)
        leases.by_slot[slot] = live
        if len(hashes):
            approx = view.approx
            approx.version += 1
            approx.evictions += out[OUT_EVICTED]
            live.wrote = view.record_speculative(hashes, row, now_us, ob if own_depth else int(view.approx_depth[row]))
        ring.commit(rid, row, now_us, self._fleet_ids())
        self.decisions_total += 1
        return Admit(rid, spec.owner, ledger.rows.key_of(row), slot, gen, ob, cached, 0, cq.name)

    def _fleet_ids(self) -> tuple:
        """(worker ids, dp ranks, present) copies for the explain ring, shared by every decision
        until the ledger's worker table changes (its `version`)."""
        v = self.ledger.version
        if self._ids_key != v:
            a = self.ledger.arrays
            self._ids_key, self._ids = v, (a.w_worker_id.copy(), a.w_dp_rank.copy(), a.w_present.copy())
        return self._ids

    def reject(self, spec: RequestSpec, reason: str, detail: str, cls_name: str, **figures) -> Reject:
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
