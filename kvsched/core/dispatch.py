"""The dispatch half of the Scheduler: readiness predicates, cost snapshots, `admit_one` and the
dispatch pass (docs/DESIGN.md §4.17 Guardrails: admit_one is the only path to a worker).

`admit_one` = project (one `Ledger.project` kernel call) → select (pure selector; pinned → that
worker) → skip if the owner is known gone → reserve (`Ledger.reserve`) → `Admit` record; then the
request's hashes are written to the approximate overlap index for the chosen row with
ttl = `selector.approx_ttl_s`, and, when the row is fed by KV events, to the speculative index
with the short `speculative_ttl_s`. The actor delivers the record and, if delivery fails, calls
`Scheduler.release(..., "aborted")` (docs/DESIGN.md §4.11: a failed delivery must release).

Overlap (docs/DESIGN.md §6.4), one combination for the cost snapshot and for admit_one (`_overlap_depth`):

* rows without a KV-event source, and rows whose stream is stale (`FLAG_STALE`): the approximate
  index only (routing decisions, TTL `approx_ttl_s`);
* event-fed rows that are fresh: `credited_overlap(device, offload, speculative)` =
  max(device, speculative) + `offload_overlap_credit` per offload-only block beyond it. The long-TTL
  approximate entries are NOT used for them: the events say what the engine really holds (evictions
  included), the approximate index only guesses.
* The speculative entry covers the time between the routing decision and the engine's
  BlockStored (engine queueing + prefill + transport). Its TTL is `approx_ttl_s / 24` (5 s at the
  default 120 s): long enough for a long prompt's prefill under load, short enough that a guess the
  engine never confirms (rejected request, eviction) stops counting within seconds; tying it to
  `approx_ttl_s` carries the replay's time scaling (`approx_ttl_s / speedup`) through.
* The credited overlap is floored to whole blocks (the projection kernel takes int32 blocks).
* A requeue withdraws what its own admission wrote: the hashes past the row's prefix depth in each
  index at admission time (the ones that admission added, not ones it only refreshed), so a
  requeued request is never credited with blocks it never cached.

Busy / overload are read from CURRENT load (never projected), so an oversized request is never stuck
forever. A worker is *placeable* for a request when it is registered, not drained and within the
request's pin and allowed set; *eligible* when placeable and not overloaded. The cost snapshot uses
the best placeable worker (docs/PROTOCOL.md "Scheduling contracts").
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..config import ClassConfig, Config
from ..kvevents.apply import credited_overlap
from ..shm.layout import FLAG_DRAINED, FLAG_STALE
from ..shm.overlap import OverlapIndex
from .admission import Aborted, Event, FleetView
from .ledger import Ledger
from .ordering import QueueEntry
from .policy_queue import PolicyQueue
from .selector import SelectionView, WorkerSelector
from .types import EMPTY_HASHES, Admit, CostSnapshot, Reject, RequestSpec, WorkerKey

READY, DEFERRED, LEASED = "ready", "deferred", "leased"
EXPLAIN_RING = 1024
SPECULATIVE_TTL_FRACTION = 1 / 24  # speculative TTL = approx_ttl_s * this (5 s at the default 120 s)


@dataclass(slots=True, eq=False)
class Live:
    """One live request (waiting, deferred or leased); `entry.payload is self`.

    Attributes:
        spec: the request as enqueued.
        entry: its queue entry (ordering inputs, cost, placement = effective pin, class index).
        state: "ready" (queued), "deferred" (held by the admission policy) or "leased".
        slot / generation: the lease while leased, else -1 / 0.
        tracked: the class's admission policy receives this request's events.
        told_dispatched: Dispatched was already sent to the policy (at most once).
        deadline_us: absolute queue-wait deadline (µs), or None.
        wait_token: bumps on every (re)queue so stale timeout heap items are skipped.
        wrote: what its admission added to the overlap indexes while leased: (row, hashes added
            to the approximate index, hashes added to the speculative index or None), else None.
        share_key: the (owner, class) key of `WaitingShares` while it is counted as waiting.
    """

    spec: RequestSpec
    entry: QueueEntry
    state: str = READY
    slot: int = -1
    generation: int = 0
    tracked: bool = False
    told_dispatched: bool = False
    deadline_us: int | None = None
    wait_token: int = 0
    wrote: tuple | None = None
    share_key: tuple[int, int] | None = None  # (owner, class index) it is counted under while waiting


class Dispatch:
    """Mixin of `Scheduler`: attributes are created by `Scheduler.__init__`."""

    config: Config
    ledger: Ledger
    overlap: OverlapIndex
    event_device: OverlapIndex | None
    event_offload: OverlapIndex | None
    speculative: OverlapIndex | None
    selector: WorkerSelector
    owner_alive: Callable[[int], bool]
    pq: PolicyQueue
    _live: dict[str, Live]
    _by_slot: dict[int, Live]
    _by_owner: dict[int, set[str]]
    _events: list[tuple[int, Event]]
    _cleanup_ids: set[str]
    _dirty: bool
    decisions_total: int

    def _init_dispatch(self, max_workers: int) -> None:
        self._elig = np.zeros(max_workers, np.uint8)
        self._placeable = np.zeros(max_workers, np.uint8)  # placeable rows of the last _placeable_mask
        self._approx_depth = np.zeros(max_workers, np.int32)  # raw depths in the approximate index
        self._spec_raw = np.zeros(max_workers, np.int32)  # raw depths in the speculative index
        self._depth = np.zeros(max_workers, np.int32)
        self._explain: deque[tuple] = deque(maxlen=EXPLAIN_RING)
        self._event_fed = np.zeros(max_workers, np.uint8)  # row -> 1 when a KV-event source feeds it
        self._dev_depth = np.zeros(max_workers, np.int32)
        self._off_depth = np.zeros(max_workers, np.int32)
        self._spec_depth = np.zeros(max_workers, np.int32)
        self._stale = np.zeros(max_workers, np.bool_)
        self._credit = np.zeros(max_workers, np.float64)
        self._depth_key: tuple | None = None
        self._depth_of: np.ndarray | None = None  # the hashes array the memo is for (identity)
        self._set_ttls()

    def _set_ttls(self) -> None:
        """TTLs (µs) of the approximate and speculative entries, from `selector.approx_ttl_s`."""
        approx_s = self.config.selector.approx_ttl_s
        self._ttl_us = int(approx_s * 1_000_000)
        spec_s = self._speculative_ttl_s if self._speculative_ttl_s is not None else approx_s * SPECULATIVE_TTL_FRACTION
        self._spec_ttl_us = max(1, int(spec_s * 1_000_000))

    # ---- overlap -----------------------------------------------------------------------------
    def set_event_fed(self, row: int, fed: bool) -> None:
        """Mark `row` as fed (or no longer fed) by a KV-event stream; unfed rows use the approximate index."""
        self._event_fed[row] = 1 if fed else 0
        self._depth_key = None

    def _overlap_depth(self, hashes: np.ndarray, now_us: int) -> np.ndarray:
        """Write into `self._depth` the overlap blocks to credit per row (module docstring); returns it.

        Memoised on (hashes object, now_us, every index's version, ledger version): the cost snapshot
        and admit_one of an immediate admission ask for the same depths back to back."""
        key = (id(hashes), now_us, self.ledger.version,
               *(getattr(ix, "version", 0) for ix in (self.overlap, self.event_device, self.event_offload,
                                                      self.speculative) if ix is not None))
        if key == self._depth_key and self._depth_of is hashes:
            return self._depth
        self._depth_key, self._depth_of = key, hashes
        self.overlap.depth(hashes, now_us, self._approx_depth)
        self._depth[:] = self._approx_depth
        dev = self.event_device
        if dev is None or not self._event_fed.any():
            return self._depth
        dev.depth(hashes, now_us, self._dev_depth)
        off = None
        if self.event_offload is not None:
            self.event_offload.depth(hashes, now_us, self._off_depth)
            off = self._off_depth
        self.speculative.depth(hashes, now_us, self._spec_depth)
        self._spec_raw[:] = self._spec_depth
        stale = self._stale
        np.equal(self._event_fed, 0, out=stale)
        stale |= (self.ledger.arrays.w_flags & FLAG_STALE) != 0
        np.copyto(self._spec_depth, self._depth, where=stale)  # stale / unfed rows: approximate only
        credited_overlap(self._dev_depth, off, self._spec_depth, stale,
                         self.config.selector.offload_overlap_credit, self._credit)
        np.floor(self._credit, out=self._credit)
        self._depth[:] = self._credit
        return self._depth

    # ---- busy / eligibility (current load) ---------------------------------------------------
    def _busy_rows(self, cls: ClassConfig) -> np.ndarray | None:
        """bool[W]: rows whose active prefill tokens exceed the class threshold; None = never busy."""
        a = self.ledger.arrays
        busy = None
        if cls.prefill_busy_threshold is not None:
            busy = a.w_active_prefill > cls.prefill_busy_threshold
        if cls.prefill_busy_threshold_frac is not None:
            frac = a.w_active_prefill > cls.prefill_busy_threshold_frac * a.w_max_batched_tokens
            busy = frac if busy is None else busy | frac
        return busy

    def _class_busy(self, cls: ClassConfig, elig: np.ndarray, n_elig: int) -> bool:
        """True when at least busy_worker_ratio of the eligible rows are busy (docs/DESIGN.md §4.1)."""
        busy = self._busy_rows(cls)
        if busy is None or n_elig == 0:
            return False
        n_busy = int(np.count_nonzero(busy & (elig != 0)))
        return n_busy >= cls.busy_worker_ratio * n_elig - 1e-9

    def _lane_ready(self, class_idx: int, worker: WorkerKey) -> bool:
        """May the lane of `worker` (class `class_idx`) dispatch its head now?"""
        row = self.ledger.row_of(worker)
        if row is None or self.ledger.eligible_mask(worker, None, self._elig) == 0:
            return False
        busy = self._busy_rows(self.pq.classes[class_idx].config)
        return busy is None or not bool(busy[row])

    def _shared_ready(self, class_idx: int, entry: QueueEntry) -> bool:
        """May the shared root run now: some allowed worker eligible and the class not busy?"""
        spec: RequestSpec = entry.payload.spec
        n = self.ledger.eligible_mask(None, spec.allowed_workers, self._elig)
        return n > 0 and not self._class_busy(self.pq.classes[class_idx].config, self._elig, n)

    def _placeable_mask(self, pinned: WorkerKey | None, allowed: frozenset[int] | None,
                        drained_count: bool = False) -> int:
        """Write uint8[max_workers] `self._placeable`: rows placeable for a request with this pin and
        allowed set (registered, not drained, within pin / allowed; overload ignored). With
        `drained_count`, drained rows count too (worker removal: drain is temporary). Returns how many."""
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
        self._placeable[:] = ok
        return int(np.count_nonzero(ok))

    def _snapshot(self, spec: RequestSpec, pinned: WorkerKey | None, now_us: int) -> CostSnapshot:
        """Cost snapshot: cached tokens on the pinned worker, else on the best *placeable* worker,
        overloaded or not (Dynamo kv-router guardrail: WSPT uses the best allowed worker's cached
        tokens); raw ISL only when there is no cache data or no placeable worker."""
        hashes = spec.block_hashes
        if len(hashes) == 0:
            return CostSnapshot.of(spec.isl_tokens, 0)
        if pinned is not None:
            row = self.ledger.row_of(pinned)
            if row is None:
                return CostSnapshot.of(spec.isl_tokens, 0)
            self._overlap_depth(hashes, now_us)
            return CostSnapshot.of(spec.isl_tokens, int(self._depth[row]) * self.ledger.block_size)
        if self._placeable_mask(None, spec.allowed_workers) == 0:
            return CostSnapshot.of(spec.isl_tokens, 0)
        self._overlap_depth(hashes, now_us)
        depth = int(self._depth[self._placeable != 0].max())
        return CostSnapshot.of(spec.isl_tokens, depth * self.ledger.block_size)

    def _fleet(self) -> FleetView:
        a = self.ledger.arrays
        present = a.w_present != 0
        return FleetView(int(a.w_active_blocks[present].sum()), int(a.w_total_kv_blocks[present].sum()),
                         self.ledger.block_size)

    # ---- admit_one ---------------------------------------------------------------------------
    def _admit_one(self, live: Live, now_us: int) -> Admit | Reject | None:
        """The only path to a worker. Returns Admit, Reject("overloaded": slot table full), or None
        (no eligible worker: the caller keeps the request; or owner gone: request dropped)."""
        spec, entry = live.spec, live.entry
        pin = entry.placement
        if self.ledger.eligible_mask(pin, spec.allowed_workers, self._elig) == 0:
            return None
        hashes = spec.block_hashes if len(spec.block_hashes) else EMPTY_HASHES
        blocks, prefill, costs = self._project(hashes, spec.isl_tokens, now_us)
        view = self._view(blocks, prefill, spec.isl_tokens, now_us)
        row, terms = self._select(pin, costs, len(hashes), view)
        if row < 0:
            return None
        if not self.owner_alive(spec.owner):
            self._drop(live, abort=True)
            return None
        return self._reserve(live, row, hashes, blocks, prefill, costs, now_us, view, terms)

    def _project(self, hashes: np.ndarray, isl_tokens: int, now_us: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if len(hashes):
            self._overlap_depth(hashes, now_us)
        else:
            self._depth[:] = 0
            self._depth_key = None
        sel = self.config.selector
        return self.ledger.project(hashes, isl_tokens, self._depth, self._elig, sel.prefill_load_scale, sel.overlap_credit)

    def _view(self, blocks: np.ndarray, prefill: np.ndarray, isl_tokens: int, now_us: int) -> SelectionView:
        a = self.ledger.arrays
        return SelectionView(prefill, blocks, a.w_active_prefill, a.w_active_blocks, a.w_total_kv_blocks,
                             a.w_max_batched_tokens, int(isl_tokens), self.ledger.block_size, now_us)

    def _select(self, pin: WorkerKey | None, costs: np.ndarray, request_blocks: int = 0,
                view: SelectionView | None = None) -> tuple[int, dict | None]:
        """(row or -1, the selector's cost terms if it computed them on the way)."""
        if pin is not None:
            row = self.ledger.row_of(pin)
            return (-1 if row is None else row), None
        return self.selector.select_explained(costs, self._elig, self.ledger.arrays.w_active_requests,
                                              overlap_blocks=self._depth, request_blocks=request_blocks, view=view)

    def _reserve(self, live: Live, row: int, hashes: np.ndarray, blocks: np.ndarray, prefill: np.ndarray,
                 costs: np.ndarray, now_us: int, view: SelectionView, terms: dict | None = None) -> Admit | Reject:
        spec, entry = live.spec, live.entry
        bs = self.ledger.block_size
        overlap_blocks = int(self._depth[row])
        cached = min(spec.isl_tokens, overlap_blocks * bs)
        cls_name = self.pq.classes[entry.class_idx].name
        got = self.ledger.reserve(spec.request_id, row, spec.isl_tokens, hashes, cached, spec.expected_osl,
                                  entry.class_idx, entry.arrival_us, now_us, spec.owner)
        if got is None:
            self._drop(live, abort=True)
            return self._reject(spec, "overloaded", "slot table full", cls_name)
        self._shares.remove(live)
        live.state, (live.slot, live.generation) = LEASED, got
        self._by_slot[live.slot] = live
        if len(hashes):
            live.wrote = self._record_overlap(hashes, row, now_us)
        self.selector.note_admitted(row, overlap_blocks, len(hashes))
        a = self.ledger.arrays
        if terms is None:  # pinned, or a selector that does not compute terms on the way: before `admitted`
            terms = self.selector.terms(costs, self._elig, self._depth, view)
        self.selector.admitted(row, spec.isl_tokens - cached, now_us)
        self._explain.append((spec.request_id, row, now_us, self._elig.copy(), self._depth.copy(), blocks.copy(),
                              prefill.copy(), costs.copy(), a.w_worker_id.copy(), a.w_dp_rank.copy(), a.w_present.copy(),
                              terms))
        self.decisions_total += 1
        return Admit(spec.request_id, spec.owner, self.ledger.key_of(row), live.slot, live.generation,
                     overlap_blocks, cached, max(0, now_us - entry.arrival_us), cls_name)

    def _record_overlap(self, hashes: np.ndarray, row: int, now_us: int) -> tuple:
        """Write an admission's hashes to the approximate index (and the speculative one for an
        event-fed row). Returns (row, added approximate, added speculative or None): the hashes past
        the row's prefix depth in each index, which `_withdraw_overlap` removes on requeue. Needs
        `_overlap_depth(hashes, now_us)` computed just before (admit_one's projection does it)."""
        added = hashes[int(self._approx_depth[row]):]
        self.overlap.insert(hashes, row, now_us, self._ttl_us)
        spec_added = None
        if self.speculative is not None and self._event_fed[row]:
            if self.event_device is None:  # _overlap_depth computed no speculative depth
                self.speculative.depth(hashes, now_us, self._spec_raw)
            spec_added = hashes[int(self._spec_raw[row]):]
            self.speculative.insert(hashes, row, now_us, self._spec_ttl_us)
        return row, added, spec_added

    def _withdraw_overlap(self, live: Live) -> None:
        """A requeue: remove what this request's own admission added to the overlap indexes."""
        if live.wrote is None:
            return
        row, added, spec_added = live.wrote
        live.wrote = None
        if len(added):
            self.overlap.remove(added, row)
        if spec_added is not None and len(spec_added) and self.speculative is not None:
            self.speculative.remove(spec_added, row)

    def _reject(self, spec: RequestSpec, reason: str, detail: str, cls_name: str, **figures) -> Reject:
        self.decisions_total += 1
        return Reject(spec.request_id, spec.owner, reason, detail, cls_name, **figures)

    # ---- the dispatch pass -------------------------------------------------------------------
    def _dispatch(self, now_us: int) -> list[Admit | Reject]:
        """While some class has a dispatchable head (DRR picks the class), admit_one it."""
        out: list[Admit | Reject] = []
        while self.ledger.n_free_slots() > 0:  # slot table full: keep waiting, not reject
            entry = self.pq.pop_next(self._lane_ready, self._shared_ready)
            if entry is None:
                break
            live: Live = entry.payload
            got = self._admit_one(live, now_us)
            if got is not None:
                out.append(got)
            elif live.state == READY and live.spec.request_id in self._live:
                self.pq.put_back(entry)  # nothing eligible after all: keep it, stop this pass
                break
        self._dirty = False
        return out

    # ---- bookkeeping -------------------------------------------------------------------------
    def _register(self, live: Live) -> None:
        self._live[live.spec.request_id] = live
        self._by_owner.setdefault(live.spec.owner, set()).add(live.spec.request_id)

    def _drop(self, live: Live, abort: bool) -> None:
        """Forget a live request (its queue entry / lease must already be gone)."""
        rid = live.spec.request_id
        if self._live.get(rid) is live:
            del self._live[rid]
            self._cleanup_ids.add(rid)  # reusable once this cleanup reaches the policies
            ids = self._by_owner.get(live.spec.owner)
            if ids is not None:
                ids.discard(rid)
                if not ids:
                    del self._by_owner[live.spec.owner]
        if live.state == LEASED:
            self._by_slot.pop(live.slot, None)
        self._shares.remove(live)
        live.state = "gone"
        if abort and live.tracked:
            self._events.append((live.entry.class_idx, Aborted(rid)))
        live.wrote = None

    def _capacity_changed(self, row: int) -> None:
        self.pq.on_capacity_change(self.ledger.key_of(row))
        self._dirty = True
