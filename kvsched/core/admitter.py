"""Admitter: readiness, cost snapshots, `admit_one` and the dispatch pass (docs/DESIGN.md §4.17
Guardrails: admit_one is the only path to a worker).

`admit_one` = the compiled decision (`book`, below) for an unpinned request; for what it leaves
UNDECIDED: project (the overlap view's credited depths + one `Ledger.project` kernel call) →
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

One admission pipeline: every unpinned admission — `admit` (a request that may run at once: no
admission policy, no backlog in its class) and `admit_one` (a request leaving its queue) — is first
`book`: ONE kernel call, `shm.admit_packed.admit_kv_packed` (`admit_kv` with its fixed arrays given as
one table: overlap → busy rule → cost snapshot → projection → kv terms and argmin → booking → overlap
record → recent work), then the booking's Python half. Whatever the kernel does not decide (a tie,
which draws from the selector's RNG; a busy class; a selector or index the kernel does not cover) it
answers UNDECIDED, books nothing, and the Python steps (admission policy, queue, project → select →
reserve) decide from the same unchanged state
(tests/core/test_fused_admission.py runs a scheduler with and without the kernel on the same
operations and compares everything).

`admit` runs for every immediate admission, where each Python call costs ~0.2-0.4 µs on the project's
VM (docs/BENCHMARKS.md §4b), so it is one function: the memo checks of the placeable mask, the
kernel's parameters and argument table and the overlap view's approximate-only test are written out
in it (each names the method it stands for), and the kernel is called through its compiled entry
point (`shm.bind.entry_point`: numba's per-call type resolution skipped) when the hashes are a
C-contiguous uint64 vector, the only layout that entry point reads correctly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import ClassConfig, SelectorConfig
from ..protocol import RejectReason
from ..shm.admit_kernels import (
    OUT_CACHED,
    OUT_EVICTED,
    OUT_GENERATION,
    OUT_LEN,
    OUT_OVERLAP,
    OUT_SNAPSHOT,
    UNDECIDED,
    P,
    pack_kv_params,
)
from ..shm.admit_packed import admit_kv_packed, pack_admit_arrays
from ..shm.bind import entry_point
from ..shm.layout import FLAG_DRAINED
from ..shm.overlap import INT64_MAX
from ..shm.select_kernels import count_busy
from .admission import FleetView
from .explain_ring import ExplainRing
from .kv_cost import KvSelector
from .live import LEASED, READY, Live
from .ordering import QueueEntry
from .selector import SelectionView, Terms
from .types import EMPTY_HASHES, Admit, CostSnapshot, Reject, RequestSpec, WorkerKey

if TYPE_CHECKING:
    from .class_queue import PolicyClassQueue
    from .leases import LeaseTable
    from .ledger import Ledger
    from .overlap_view import OverlapView
    from .policy_queue import PolicyQueue
    from .selector import WorkerSelector

EXPLAIN_RING = 1024  # admissions kept for `kvsched explain`
_U64 = np.dtype(np.uint64)  # the block hashes' dtype (an `is` test first: ~0.3 µs less than `!=`)
_ONE_WORD = (_U64.itemsize,)  # the strides of a C-contiguous uint64 vector (1-D)
# admit_kv_packed's compiled entry point, resolved once per process (`_admit_entry`)
_ENTRY: list[Callable[..., int]] = []


def _admit_entry() -> Callable[..., int]:
    """`admit_kv_packed`'s entry point for the daemon's argument types (read-only uint64 hashes as decoded
    from a frame, int64 scalars, the float64 params and the int64 table): the overload
    `shm.admit_kernels.warm_admit_kernels` compiles. A writable vector is read alike (numba's
    unboxing checks the item size only, and the kernel never writes the hashes)."""
    if not _ENTRY:
        hashes = np.frombuffer(bytes(8), dtype=np.uint64)
        _ENTRY.append(
            entry_point(
                admit_kv_packed,
                (hashes, 0, 0, 0, 0, 0, 0, 0, 0, 1.0, 0, 0, 0, np.zeros(1), 0, 0, np.zeros(4, np.int64)),
            )
        )
    return _ENTRY[0]


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
        fused: True when the admission kernel may decide (the `kv` selector, `KvSelector.decides_by_kernel`,
            over an `OverlapIndex`); False sends every request through the Python steps.
        params: class index -> (its `ClassConfig`, `admit_kv`'s float64 params); emptied when the
            selector, the `[selector]` table or a class changes.
        scratch: float64[4, W], the admission kernel's work space; out: int64[OUT_LEN], what it reports back.
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
        self._placeable_key: tuple[Any, ...] | None = None
        self._placeable_n = 0
        self._placeable_rows: list[int] | None = None  # placeable rows, None when every row is
        self.explain = ExplainRing(EXPLAIN_RING, w)
        self._ids_key: int | None = None
        self._ids: tuple[Any, ...] = ()
        self.decisions_total = 0
        a = ledger.arrays
        self.params: dict[int, tuple[Any, ...]] = {}
        self.scratch = np.zeros((4, w), np.float64)
        self.out = np.zeros(OUT_LEN, np.int64)
        self._key: tuple[Any, ...] | None = None  # the objects the kernel's table describes (`kernel_arrays`)
        self._arrays: tuple[Any, ...] = ()  # the arrays themselves, kept alive beside their table
        self._args: tuple[Any, ...] = ()  # (block_size, stride, table)
        self._kernel: Callable[..., int] | None = None  # `_admit_entry()`, bound on first use
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
        kv = selector if type(selector) is KvSelector else None
        self.fused = kv is not None and kv.decides_by_kernel() and self.view.fused_approx is not None
        self.kv = kv if self.fused else None  # the selector the kernel decides for
        if kv is not None and self.fused:
            kv.reserve_rows(self.ledger.arrays.max_workers)
        self.params = {}

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles drop the admission kernel's argument table (`shm.argtable`: it holds this
        process's addresses of the original arrays) and its entry point; the copy builds its own on first use."""
        return {**self.__dict__, "_key": None, "_arrays": (), "_args": (), "_kernel": None}

    def params_of(self, cq: PolicyClassQueue) -> np.ndarray:
        """`admit_kv`'s params for class `cq` (packed again when its config or the `[selector]` table changes)."""
        got = self.params.get(cq.index)
        if got is None or got[0] is not cq.config:
            p = pack_kv_params(self.selector, self.selector_cfg, cq.config)
            p[P["inv_bs"]] = 1.0 / float(self.ledger.block_size)
            got = self.params[cq.index] = (cq.config, p)
        params: np.ndarray = got[1]
        return params

    def _objects(self) -> tuple[Any, ...]:
        view = self.view
        sel = self.selector
        recent = sel.recent if isinstance(sel, KvSelector) else None  # the kernel's selector's recent work
        return self.explain, recent, self.ledger.arrays, view.approx, view.depth_out, self.elig

    def kernel_arrays(self) -> tuple[Any, ...]:
        """`admit_kv_packed`'s last arguments: (block_size, stride, the table of `admit_kv`'s 41 fixed
        arrays). Built once, again when one of the objects it reads is replaced (explain ring, the
        selector's recent-work array, ledger arrays, approximate index, depth or eligibility array);
        the arrays stay referenced beside the table while it holds their addresses (`shm.argtable`)."""
        key = self._objects()
        k = self._key
        if k is not None and all(a is b for a, b in zip(k, key, strict=True)):
            return self._args
        ring, recent, a, ix, depth, elig = key
        arrays = (
            elig,
            self.placeable,
            ix.keys,
            ix.used,
            ix.perm,
            ix.ttlm,
            ix.ttl_exp,
            ix.scratch,
            depth,
            a.w_generation,
            a.w_active_blocks,
            a.w_active_prefill,
            a.w_active_requests,
            a.w_max_batched_tokens,
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
            recent,
            self.scratch,
            ring.elig,
            ring.depth,
            ring.blocks,
            ring.prefill,
            ring.terms,
            self.out,
        )
        ledger = self.ledger
        self._args = (ledger.block_size, ledger.stride, pack_admit_arrays(arrays))
        self._key, self._arrays = key, arrays
        return self._args

    def admit(
        self, spec: RequestSpec, cq: PolicyClassQueue, n_elig: int, seq: Iterator[int], now_us: int
    ) -> Admit | None:
        """Admit `spec` at once with one `admit_kv` kernel call (`book`), or None: UNDECIDED, nothing
        changed, the caller goes on to the Python steps (module docstring).

        Args:
            spec: the request; cq: its class; n_elig: the count `eligible_mask` wrote into `elig` for
                its pin and allowed set; seq: the enqueue_seq counter (drawn only when admitted).
        The kernel may decide when some worker is eligible, the request is not pinned and its class
        has no admission policy and no ready backlog (and `book`'s own conditions hold).
        """
        if not (n_elig and spec.pinned is None and cq.admission is None and cq.n_waiting == len(cq.deferred)):
            return None
        got = self.book(spec, cq, now_us, now_us)
        if got is None:
            return None
        row, slot, gen, ob, cached, snapshot, wrote = got
        rid, isl = spec.request_id, spec.isl_tokens
        entry = QueueEntry(rid, next(seq), now_us, spec.priority, spec.strict_priority, snapshot, isl, None, cq.index)
        live = Live(spec, entry, LEASED, slot, gen)
        entry.payload = live
        live.wrote = wrote
        self.leases.register(live)  # a lease already: indexed by slot too
        return Admit(rid, spec.owner, self.ledger.rows.key_of(row), slot, gen, ob, cached, 0, cq.name)

    def book(self, spec: RequestSpec, cq: PolicyClassQueue, enqueue_us: int, now_us: int) -> tuple[Any, ...] | None:
        """The compiled decision: book `spec` (class `cq`, unpinned, `elig` written for its allowed set)
        with ONE `admit_kv` kernel call, then the Python half every booking needs (id maps, recent-work
        clock, home term, overlap versions and speculative record, explain record, decision count).

        Returns (row, slot, generation, overlap blocks, cached tokens, snapshot cost, what the overlap
        indexes were written: `Live.wrote`); or None — UNDECIDED, nothing booked — when the admitter is
        not `fused`, the hashes are not uint64, the selector does not decide this prompt by kernel
        (`KvSelector.kernel_may_decide`), the owner is known gone, the slot table is full, the class is
        busy or the decision is not a unique finite minimum. `enqueue_us` is the booking's enqueue time.
        """
        hashes, isl = spec.block_hashes, spec.isl_tokens
        sel, approx = self.kv, self.view.fused_approx
        dt = hashes.dtype
        if (
            not self.fused
            or sel is None
            or approx is None
            or (dt is not _U64 and dt != _U64)
            or not sel.kernel_may_decide(isl)
            or not self.leases.owner_alive(spec.owner)
        ):
            return None
        ledger, view, ring, rid = self.ledger, self.view, self.explain, spec.request_id
        try:
            taken = ledger.take_slot(rid)
        except ValueError:  # the Python path raises it
            return None
        if taken is None:  # slot table full: the Python path rejects
            return None
        slot = taken[0]
        self.placeable_mask(None, spec.allowed_workers)  # memoised: usually a hit
        own_depth = view.approx_only()
        if not own_depth:
            view.depth(hashes, now_us)
        memo = self.params.get(cq.index)  # `params_of`, its memo checked here
        params = memo[1] if memo is not None and memo[0] is cq.config else self.params_of(cq)
        k = self._key  # `kernel_arrays`, its memo checked here
        if (
            k is not None
            and k[0] is ring
            and k[1] is sel.recent
            and k[2] is ledger.arrays
            and k[3] is view.approx
            and k[4] is view.depth_out
            and k[5] is self.elig
        ):
            args = self._args
        else:
            args = self.kernel_arrays()
        kernel = self._kernel
        if kernel is None:
            kernel = self._kernel = _admit_entry()
        if hashes.strides != _ONE_WORD:  # not a C-contiguous vector: the entry point would misread it
            kernel = admit_kv_packed
        recent_at = sel.recent_at_us
        expected = spec.expected_osl
        row = kernel(
            hashes,
            isl,
            now_us,
            slot,
            -1 if expected is None else expected,
            cq.index,
            enqueue_us,
            spec.owner,
            min(now_us + view.ttl_us, INT64_MAX - 1),
            sel.decay(now_us),
            1 if now_us > recent_at else 0,
            0 if own_depth else 1,
            ring.head,
            params,
            args[0],
            args[1],
            args[2],
        )  # not `*args`: no tuple built
        if own_depth:
            view.drop_memo()  # the kernel wrote depth_out
        if row < 0:
            ledger.give_back(slot)
            if row == UNDECIDED:
                ring.lose_head()
            return None
        # the Python half: maps, recent-work clock, home term, overlap versions, explain record
        out = self.out.tolist()
        gen, ob, cached = out[OUT_GENERATION], out[OUT_OVERLAP], out[OUT_CACHED]
        ledger.booked(slot, rid, row)
        if now_us > recent_at and sel.recent_weight > 0.0:
            sel.recent_at_us = now_us
        if sel.home_weight > 0.0 and cached > 0 and cached >= sel.home_min_cached_share * isl:
            sel.note_home(row, isl, isl - cached, now_us)  # what `admitted` counts (its condition, checked first)
        wrote = None
        if len(hashes):
            approx.version += 1
            approx.evictions += out[OUT_EVICTED]
            approx_d = ob if own_depth else int(view.approx_depth[row])
            wrote = (
                (row, hashes, approx_d, -1)
                if view.speculative is None  # `record_speculative` with no index
                else view.record_speculative(hashes, row, now_us, approx_d)
            )
        ring.commit(rid, row, now_us, self.fleet_ids())
        self.decisions_total += 1
        return row, slot, gen, ob, cached, out[OUT_SNAPSHOT], wrote

    @property
    def selector_cfg(self) -> SelectorConfig:
        """The `[selector]` table (a profile reload assigns it; the kernel parameters follow)."""
        return self._selector_cfg

    @selector_cfg.setter
    def selector_cfg(self, cfg: SelectorConfig) -> None:
        self._selector_cfg = cfg
        self.params = {}

    # ---- busy / eligibility (current load) ---------------------------------------------------
    def busy_count(self, cls: ClassConfig, elig: np.ndarray) -> int:
        """Rows of `elig` (uint8[W]) whose active prefill tokens exceed the class's busy threshold (either
        `prefill_busy_threshold` or `prefill_busy_threshold_frac` of the row's max batched tokens;
        docs/DESIGN.md §4.1): one `count_busy` kernel call, the one statement of the rule (the admission
        kernel calls it too). 0 when the class sets neither threshold."""
        thr, frac = cls.prefill_busy_threshold, cls.prefill_busy_threshold_frac
        if thr is None and frac is None:
            return 0
        a = self.ledger.arrays
        busy: int = count_busy(
            a.w_active_prefill,
            a.w_max_batched_tokens,
            elig,
            -1 if thr is None else int(thr),
            -1.0 if frac is None else float(frac),
        )
        return busy

    def class_busy(self, cls: ClassConfig, elig: np.ndarray, n_elig: int) -> bool:
        """True when at least busy_worker_ratio of the `n_elig` eligible rows (`elig`) are busy
        (`busy_count`; docs/DESIGN.md §4.1); never for a class without a busy threshold."""
        if n_elig == 0 or (cls.prefill_busy_threshold is None and cls.prefill_busy_threshold_frac is None):
            return False
        return self.busy_count(cls, elig) >= cls.busy_worker_ratio * n_elig - 1e-9

    def lane_ready(self, class_idx: int, worker: WorkerKey) -> bool:
        """May the lane of `worker` (class `class_idx`) dispatch its head now: the worker eligible and
        not busy (`busy_count` over its row alone)?"""
        if self.ledger.eligible_mask(worker, None, self.elig) == 0:
            return False
        return self.busy_count(self.pq.classes[class_idx].config, self.elig) == 0

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
        rows = self._placeable_rows
        d: list[int] = depth.tolist()  # a list max: a few rows, no ufunc overhead
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
        if pin is None:  # the compiled decision first; the Python steps below for what it leaves UNDECIDED
            cq = self.pq.classes[entry.class_idx]
            got = self.book(spec, cq, entry.arrival_us, now_us)
            if got is not None:
                row, slot, gen, ob, cached, _, live.wrote = got
                self.leases.leased(live, slot, gen)
                wait = max(0, now_us - entry.arrival_us)
                return Admit(spec.request_id, spec.owner, self.ledger.key_of(row), slot, gen, ob, cached, wait, cq.name)
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
    ) -> tuple[int, Terms | None]:
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
        terms: Terms | None,
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

    def fleet_ids(self) -> tuple[Any, ...]:
        """(worker ids, dp ranks, present) copies for the explain ring, shared by every decision
        until the ledger's worker table changes (its `version`)."""
        v = self.ledger.version
        if self._ids_key != v:
            a = self.ledger.arrays
            self._ids_key, self._ids = v, (a.w_worker_id.copy(), a.w_dp_rank.copy(), a.w_present.copy())
        return self._ids

    def reject(
        self,
        spec: RequestSpec,
        reason: RejectReason,
        detail: str,
        cls_name: str,
        *,
        limit_kind: str | None = None,
        current: int | None = None,
        limit: int | None = None,
        revoked: bool = False,
    ) -> Reject:
        """A `Reject` record for `spec` (counted in `decisions_total`)."""
        self.decisions_total += 1
        return Reject(spec.request_id, spec.owner, reason, detail, cls_name, limit_kind, current, limit, revoked)

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
