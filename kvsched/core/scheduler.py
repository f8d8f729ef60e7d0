"""Scheduler: the only object the daemon actor and the virtual-time simulator drive (Dynamo's
`SchedulerQueueActor` state). Pure and synchronous; time comes in as `now_us` (µs). Every mutator
returns a list of `Admit` / `Reject` records for the caller to deliver.

The user-facing rules are in docs/PROTOCOL.md "Scheduling contracts" (placeable / eligible workers,
no_endpoints vs all_overloaded vs waiting, do_not_queue figures, id reuse, requeue, worker removal,
policy placements). How they are kept here:
* Validation order: `invalid` (len(block_hashes) > ceil(isl / B) or isl < 1) → `pinned_not_allowed`
  (a pin outside allowed_workers or inside excluded_workers; excluded_workers is folded into
  allowed_workers at enqueue: allowed, else every registered id, minus the excluded ids)
  → `duplicate_request` (live, or `cleanup_pending`) → `no_endpoints` → `all_overloaded`; then the
  admission policy decides, then the request runs now or waits (`_wait_reason`: overloaded, class
  busy on current prefill tokens, or a ready backlog — a new arrival never jumps its own class).
* `release()` frees the booking / removes the queued entry at once (lazy deletion) and buffers the
  policy events and the id (`cleanup_pending`); `drain_cleanup()` tells the policies (the id becomes
  reusable), runs ONE dispatch pass and compacts each container at most once. Keyed by (request_id,
  slot, generation): stale or repeated releases are no-ops; `slot == -1` only cancels a waiting request.
* Policy placements are validated (`_placement_ok`); ignored ones are counted in `invalid_placements`
  and reported once through `take_notices()`.
* Timeouts: deadline = min(deadline_us, enqueue + class queue_timeout_s), for ready and deferred
  requests; a requeued request's wait restarts at the requeue (class timeout only).
* `decisions_total` counts every Admit and Reject produced.

Source: Dynamo kv-router scheduling (queue hierarchy, lifecycle, guardrails); vLLM `request_queue.py`.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable


import numpy as np

from ..config import ClassConfig, Config
from ..shm.overlap import OverlapIndex
from .admission import (Aborted, Bypass, Completed, Defer, Dispatched, MakeReady, Ready, Reconcile,
                        create_admission_policy)
from .class_queue import PolicyClassQueue
from .dispatch import DEFERRED, LEASED, READY, Dispatch, Live
from .introspect import Introspect
from .ledger import Ledger
from .ordering import QueueEntry
from .policy_queue import PolicyQueue
from .recovery import Recovery
from .reload import ProfileReload
from .selector import WorkerSelector
from .types import Admit, Reject, RequestSpec, WorkerKey
from .waiting_share import WaitingShares

Outcomes = list[Admit | Reject]
SPECULATIVE_CAPACITY = 1 << 16  # entries of the speculative index (short-lived; few are live at once)
MAX_NOTICES = 64  # operator notices kept until `take_notices()` (older ones are dropped, still counted)


class Scheduler(Introspect, Dispatch, Recovery, ProfileReload):
    """Queues, admission policies and leases of one daemon instance.

    Args:
        config: the whole config (classes, selector, overload, daemon.block_size).
        ledger / overlap / selector: collaborators (shm-backed or private); `overlap` is the
            approximate index, learnt from routing decisions (TTL `selector.approx_ttl_s`).
        owner_alive: owner id -> False when the requester is known gone (admit_one then skips it).
        event_device / event_offload: KV-event-fed indexes (device tier, offload tiers), or None
            when no worker publishes events. Rows count as event-fed once `set_event_fed(row, True)`.
        speculative: short-TTL index of routing decisions on event-fed rows (created when
            `event_device` is given and this is None).
        speculative_ttl_s: TTL of the speculative entries (s); None = `approx_ttl_s / 24`.
        See `dispatch.py` for how the indexes are combined.
    Maps: request_id -> Live; slot -> Live (leased); owner -> request ids.
    """

    def __init__(self, config: Config, ledger: Ledger, overlap: OverlapIndex, selector: WorkerSelector,
                 owner_alive: Callable[[int], bool] = lambda owner: True, *,
                 event_device: OverlapIndex | None = None, event_offload: OverlapIndex | None = None,
                 speculative: OverlapIndex | None = None, speculative_ttl_s: float | None = None) -> None:
        self.config, self.ledger, self.overlap, self.selector = config, ledger, overlap, selector
        self.owner_alive = owner_alive
        self.event_device, self.event_offload = event_device, event_offload
        if speculative is None and event_device is not None:
            speculative = OverlapIndex(ledger.arrays.max_workers, SPECULATIVE_CAPACITY)
        self.speculative = speculative
        self._speculative_ttl_s = speculative_ttl_s
        self.pq = PolicyQueue([PolicyClassQueue(c, i, create_admission_policy(c.admission))
                               for i, c in enumerate(config.classes)])
        self._class_index = {c.name: i for i, c in enumerate(config.classes)}
        self._default = self._class_index[config.default_class]
        self._live: dict[str, Live] = {}
        self._by_slot: dict[int, Live] = {}
        self._by_owner: dict[int, set[str]] = {}
        self._events: list = []  # (class_idx, admission event) buffered until drain_cleanup
        self._cleanup_ids: set[str] = set()  # ids released / rejected since the policies were last told
        self.invalid_placements = 0  # admission-policy placements ignored as invalid
        self._notices: list[str] = []  # one line per ignored placement, for the operator's log
        self._timeouts: list[tuple[int, int, str, int]] = []  # (deadline_us, token, request_id, token)
        self._tokens = itertools.count(1)
        self._seq = itertools.count(1)
        self._dirty = False
        self._shutting_down = False
        self._shares = WaitingShares(config.daemon.max_waiting_share)
        self.decisions_total = 0
        self._init_dispatch(ledger.arrays.max_workers)

    # ---- workers -----------------------------------------------------------------------------
    def add_worker(self, key: WorkerKey, total_kv_blocks: int, max_num_batched_tokens: int) -> None:
        """Register a worker rank. Raises ValueError when full or already registered."""
        row = self.ledger.add_worker(key, total_kv_blocks, max_num_batched_tokens)
        self._forget_overlap(row)
        self._capacity_changed(row)

    def _forget_overlap(self, row: int) -> None:
        """Clear `row` from every overlap index; it is no longer event-fed (a new source re-marks it)."""
        for idx in (self.overlap, self.event_device, self.event_offload, self.speculative):
            if idx is not None:
                idx.clear_row(row)
        self.set_event_fed(row, False)

    def _rows(self, worker_id: int, dp_rank: int | None) -> list[int]:
        if dp_rank is None:
            rows = self.ledger.rows_of_worker_id(worker_id)
        else:
            row = self.ledger.row_of(WorkerKey(worker_id, dp_rank))
            rows = [] if row is None else [row]
        if not rows:
            raise KeyError(f"unknown worker {worker_id}:{'*' if dp_rank is None else dp_rank}")
        return rows

    def remove_worker(self, worker_id: int, dp_rank: int | None, now_us: int) -> Outcomes:
        """Remove a worker (all ranks when dp_rank is None). Its bookings are released (policies told
        Aborted). Every waiting request (ready or deferred) that no remaining registered worker can
        take — pinned to it, or allowed only on removed workers — is answered `no_endpoints` in this
        step; drained workers still count. A request an admission policy had placed on a removed
        worker goes back to its class's shared heap. O(waiting requests): removal is an operator act.
        Raises KeyError for an unknown worker."""
        removed = []
        for row in self._rows(worker_id, dp_rank):
            removed.append(self.ledger.key_of(row))
            for slot in self.ledger.remove_worker_row(row):
                live = self._by_slot.get(slot)
                if live is not None:
                    self._drop(live, abort=True)
            self._forget_overlap(row)
        gone = set(removed)
        names = ", ".join(map(str, removed))
        out: Outcomes = []
        left: dict[tuple, int] = {}  # (pin, allowed) -> registered placeable workers
        for cq in self.pq.classes:
            stranded = []
            for entry in list(cq.iter_all()):
                spec = entry.payload.spec
                k = (spec.pinned, spec.allowed_workers)
                if k not in left:
                    left[k] = self._placeable_mask(spec.pinned, spec.allowed_workers, drained_count=True)
                if left[k] == 0:
                    stranded.append(entry)
                elif entry.placement in gone:  # placed there by the admission policy
                    entry.cost = self._snapshot(spec, spec.pinned, now_us).cost
                    cq.unplace(entry)
            for entry in cq.remove_many(stranded):
                self._drop(entry.payload, abort=True)
                out.append(self._reject(entry.payload.spec, "no_endpoints",
                                        f"worker {names} removed; no registered worker can take it", cq.name))
            self.pq._reset_if_empty(cq)  # noqa: SLF001 - same package
        self.pq.compact()
        self._dirty = True
        return out

    def set_drained(self, worker_id: int, dp_rank: int | None, drained: bool, now_us: int) -> Outcomes:
        """Drain (no new admissions; leases finish) or undrain. Raises KeyError for an unknown worker."""
        for row in self._rows(worker_id, dp_rank):
            self.ledger.set_drained(row, drained)
            if not drained:
                self._capacity_changed(row)
        return [] if drained else self._dispatch(now_us)

    def set_max_waiting_share(self, share: float) -> None:
        """Change the per-connection share of each class limit (1.0 = no per-connection cap)."""
        self._shares.share = share

    # ---- enqueue -----------------------------------------------------------------------------
    def enqueue(self, spec: RequestSpec, now_us: int) -> Outcomes:
        """Decide one request: immediate admission, queue, defer, or Reject. [] = waiting."""
        c = self._class_index.get(spec.policy_class, self._default) if spec.policy_class else self._default
        cq = self.pq.classes[c]
        if spec.excluded_workers:
            self._fold_excluded(spec)
        bad = self._validate(spec, cq.name)
        if bad is not None:
            return [bad]
        n_elig = self.ledger.eligible_mask(spec.pinned, spec.allowed_workers, self._elig)
        if n_elig == 0:
            n_place = self._placeable_mask(spec.pinned, spec.allowed_workers)
            if n_place == 0:
                return [self._reject(spec, "no_endpoints", "no registered, undrained worker the request may use", cq.name)]
            if spec.do_not_queue or not _queueing(cq.config):
                return [self._reject(spec, "all_overloaded", f"all {n_place} workers the request may use are overloaded",
                                     cq.name)]
        snap = self._snapshot(spec, spec.pinned, now_us)
        entry = QueueEntry(spec.request_id, next(self._seq), now_us, spec.priority, spec.strict_priority, snap.cost,
                           spec.isl_tokens, spec.pinned, c)
        live = Live(spec, entry)
        entry.payload = live
        decision = cq.admission.decide(spec.request_id, spec, self._fleet(), now_us) if cq.admission else Bypass()
        live.tracked = not isinstance(decision, Bypass)
        if isinstance(decision, Defer):
            return self._hold(live, cq, now_us, "the admission policy deferred it", defer=True)
        if isinstance(decision, Ready) and decision.placement is not None:
            if self._placement_ok(spec, decision.placement, cq.name):
                self._place(live, decision.placement, now_us)
                n_elig = self.ledger.eligible_mask(entry.placement, spec.allowed_workers, self._elig)
        why = self._wait_reason(cq, n_elig, entry.placement != spec.pinned)
        if why is not None:
            return self._hold(live, cq, now_us, why, defer=False)
        self._register(live)
        got = self._admit_one(live, now_us)
        return [] if got is None else [got]

    def _wait_reason(self, cq: PolicyClassQueue, n_elig: int, placed: bool) -> str | None:
        """Why a new request of `cq` must wait (None: it may run now); `self._elig` holds its rows."""
        ahead = cq.n_ready
        if n_elig == 0:
            where = "the worker its admission policy chose is" if placed else "every worker it may use is"
            return f"{where} overloaded; {_requests(ahead)} ahead"
        if self._class_busy(cq.config, self._elig, n_elig):
            busy = self._busy_rows(cq.config)
            n_busy = int(np.count_nonzero(busy & (self._elig != 0)))
            return (f"class {cq.name!r} is busy ({n_busy} of {n_elig} eligible workers above its prefill "
                    f"threshold); {_requests(ahead)} ahead")
        if ahead:
            return f"backlog: {_requests(ahead)} ahead in class {cq.name!r} (a new arrival never jumps its class)"
        return None

    def _placement_ok(self, spec: RequestSpec, worker: WorkerKey, cls_name: str) -> bool:
        """Is an admission-policy placement valid (registered, within pin and allowed set)? An invalid
        one is counted and noted for the operator's log; the caller ignores it."""
        if (self.ledger.row_of(worker) is not None and (spec.pinned is None or spec.pinned == worker)
                and (spec.allowed_workers is None or worker.worker_id in spec.allowed_workers)):
            return True
        self.invalid_placements += 1
        if spec.pinned is not None and spec.pinned != worker:
            why = f"the request is pinned to {spec.pinned}"
        elif self.ledger.row_of(worker) is None:
            why = "no such worker is registered"
        else:
            why = f"the request is allowed only on workers {sorted(spec.allowed_workers)}"
        if len(self._notices) < MAX_NOTICES:
            self._notices.append(f"ignored admission placement of request {spec.request_id!r} (class {cls_name!r}) "
                                 f"on worker {worker}: {why}")
        return False

    def take_notices(self) -> list[str]:
        """Operator notices (ignored policy placements) since the last call, each returned once."""
        notes, self._notices = self._notices, []
        return notes

    def cleanup_pending(self, request_id: str) -> bool:
        """True when `request_id` was released (or rejected after its policy decided) and that cleanup
        has not reached the admission policies yet: an `enqueue` of it now is `duplicate_request`.
        The actor drains cleanup first when an Enqueue names such an id."""
        return request_id in self._cleanup_ids

    def _fold_excluded(self, spec: RequestSpec) -> None:
        """excluded_workers -> allowed_workers: (allowed, else the pin's id or every registered id) minus
        the excluded ids. A pin inside the excluded set then fails as `pinned_not_allowed`; workers
        registered after the enqueue are not eligible for this request."""
        if spec.allowed_workers is not None:
            base = spec.allowed_workers
        elif spec.pinned is not None:
            base = frozenset((spec.pinned.worker_id,))
        else:
            base = self.ledger.worker_ids()
        spec.allowed_workers = base - spec.excluded_workers
        spec.excluded_workers = None

    def _validate(self, spec: RequestSpec, cls_name: str) -> Reject | None:
        bs = self.ledger.block_size
        if spec.isl_tokens < 1 or len(spec.block_hashes) > -(-spec.isl_tokens // bs):
            return self._reject(spec, "invalid", f"{len(spec.block_hashes)} block hashes for {spec.isl_tokens} "
                                f"tokens (block size {bs})", cls_name)
        if spec.pinned is not None and spec.allowed_workers is not None and spec.pinned.worker_id not in spec.allowed_workers:
            return self._reject(spec, "pinned_not_allowed", f"pinned worker {spec.pinned} not in allowed_workers", cls_name)
        if spec.request_id in self._live:
            return self._reject(spec, "duplicate_request", "request id is live", cls_name)
        if spec.request_id in self._cleanup_ids:
            return self._reject(spec, "duplicate_request", "the earlier request with this id is still being cleaned up",
                                cls_name)
        if self._shutting_down:
            return self._reject(spec, "shutting_down", "scheduler is shutting down", cls_name)
        return None

    def _hold(self, live: Live, cq: PolicyClassQueue, now_us: int, why: str, defer: bool) -> Outcomes:
        """Put a request in its class's queue (or deferred map) after do_not_queue and limits.
        `why` says why it waits (the detail of a do_not_queue rejection)."""
        spec = live.spec
        if spec.do_not_queue:
            self._tell_aborted(live)
            return [self._reject(spec, "do_not_queue", f"the request would wait: {why}", cq.name,
                                 current=cq.n_ready)]
        had_backlog = cq.has_ready()
        n_ids = self.ledger.n_worker_ids()
        mine = self._shares.check(spec.owner, cq.index, spec.isl_tokens, cq.config, n_ids)
        if mine is not None:  # this connection already holds its share of the class's limit
            self._tell_aborted(live)
            return [self._reject(spec, "overloaded", f"this connection holds its max_waiting_share of class "
                                 f"{cq.name!r} {mine.limit_kind} limit", cq.name,
                                 limit_kind=mine.limit_kind, current=mine.current, limit=mine.limit)]
        over = (self.pq.defer if defer else self.pq.enqueue)(cq.index, live.entry, n_ids)
        if over is not None:
            self._tell_aborted(live)
            return [self._reject(spec, "queue_full", f"class {cq.name!r} {over.limit_kind} limit", cq.name,
                                 limit_kind=over.limit_kind, current=over.current, limit=over.limit)]
        live.state = DEFERRED if defer else READY
        self._shares.add(live)
        self._register(live)
        self._arm_timeout(live, now_us, spec.deadline_us)
        return self._dispatch(now_us) if had_backlog and not defer else []

    def _tell_aborted(self, live: Live) -> None:
        """A request rejected after its policy decided: tell the policy Aborted."""
        if live.tracked:
            self._events.append((live.entry.class_idx, Aborted(live.spec.request_id)))
            self._cleanup_ids.add(live.spec.request_id)

    def _place(self, live: Live, worker: WorkerKey, now_us: int) -> None:
        """Exact placement by an admission policy: lane of `worker`, cost re-snapshotted."""
        live.entry.placement = worker
        live.entry.cost = self._snapshot(live.spec, worker, now_us).cost

    def _arm_timeout(self, live: Live, now_us: int, deadline_us: int | None) -> None:
        timeout_s = self.pq.classes[live.entry.class_idx].config.queue_timeout_s
        if timeout_s is not None:
            t = now_us + int(timeout_s * 1_000_000)
            deadline_us = t if deadline_us is None else min(deadline_us, t)
        live.deadline_us = deadline_us
        live.wait_token = next(self._tokens)
        if deadline_us is not None:
            heapq.heappush(self._timeouts, (deadline_us, live.wait_token, live.spec.request_id, live.wait_token))

    # ---- leases ------------------------------------------------------------------------------
    def _lease(self, request_id: str, slot: int, generation: int) -> Live:
        live = self._by_slot.get(slot)
        if live is None or live.spec.request_id != request_id or live.generation != generation:
            raise KeyError(f"no lease ({request_id!r}, slot={slot}, generation={generation})")
        return live

    def update(self, request_id: str, slot: int, generation: int, kind: str, output_tokens: int | None,
               now_us: int) -> Outcomes:
        """Router progress on a lease. Raises KeyError for an unknown lease, ValueError for a bad kind.
        `requeue` releases the booking, re-enters the class (original enqueue_seq) and runs a
        dispatch pass whose records are returned."""
        live = self._lease(request_id, slot, generation)
        row = int(self.ledger.arrays.s_worker_row[slot])
        if kind == "dispatched":
            self.ledger.dispatched(slot, generation)
            if live.tracked and not live.told_dispatched:
                live.told_dispatched = True
                self._events.append((live.entry.class_idx, Dispatched(request_id)))
        elif kind == "prefill_done":
            if self.ledger.prefill_done(slot, generation):
                self._capacity_changed(row)
        elif kind == "progress":
            if self.ledger.set_output_tokens(slot, generation, output_tokens or 0):
                self._capacity_changed(row)
        elif kind == "requeue":
            return self._requeue(live, row, now_us)
        else:
            raise ValueError(f"unknown update kind {kind!r}")
        return []

    def _requeue(self, live: Live, row: int, now_us: int) -> Outcomes:
        self._withdraw_overlap(live)
        self.ledger.release(live.slot, live.generation)
        self._by_slot.pop(live.slot, None)
        live.state, live.slot, live.generation = READY, -1, 0
        self._shares.add(live)
        self.pq.requeue(live.entry)
        self._arm_timeout(live, now_us, None)
        self._capacity_changed(row)
        return self._dispatch(now_us)

    def release(self, request_id: str, slot: int, generation: int, outcome: str, context_tokens: int,
                now_us: int) -> None:
        """End of a request (idempotent; stale keys ignored). Policies are told at drain_cleanup."""
        live = self._live.get(request_id)
        if live is None:
            return
        if slot == -1:
            if outcome == "cancelled" and live.state in (READY, DEFERRED):
                self.pq.remove(live.entry)
                self._drop(live, abort=True)
                self._dirty = True
                return
            if outcome == "cancelled" or live.state != LEASED:
                return  # a cancel that lost the race with its admission: the holder releases by slot
            slot, generation = live.slot, live.generation  # Release(request_id) with the defaults
        if live.state != LEASED or live.slot != slot or live.generation != generation:
            return
        row = int(self.ledger.arrays.s_worker_row[slot])
        self.ledger.release(slot, generation)
        self._capacity_changed(row)
        self._drop(live, abort=outcome != "completed")
        if outcome == "completed" and live.tracked:
            self._events.append((live.entry.class_idx, Completed(request_id, context_tokens)))

    # ---- periodic ----------------------------------------------------------------------------
    def drain_cleanup(self, now_us: int) -> Outcomes:
        """Tell the policies about buffered releases, apply their MakeReady, then ONE dispatch pass;
        the containers that had removals are compacted (at most once each)."""
        self._tell_policies(now_us)
        out = self._dispatch(now_us) if self._dirty else []
        self.pq.compact()
        return out

    def _tell_policies(self, now_us: int) -> None:
        while self._events:
            events, self._events = self._events, []
            fleet = self._fleet()
            for c, event in events:
                policy = self.pq.classes[c].admission if c < len(self.pq.classes) else None
                if policy is not None:
                    self._apply_make_ready(c, policy.notify(event, fleet, now_us), now_us)
        self._cleanup_ids.clear()

    def _apply_make_ready(self, c: int, answers: list[MakeReady], now_us: int) -> None:
        for mr in answers:
            live = self._live.get(mr.request_id)
            if live is None or live.entry.class_idx != c or live.state not in (READY, DEFERRED):
                continue
            placement = mr.placement
            if placement is not None and not self._placement_ok(live.spec, placement, self.pq.classes[c].name):
                placement = None  # invalid: a deferred request is released to its own place
            if placement is not None:
                if live.state == READY and live.entry.placement is not None:
                    continue  # already in a worker lane: ignored
                live.entry.cost = self._snapshot(live.spec, placement, now_us).cost  # before re-keying
            elif live.state == READY:
                continue  # already ready: duplicate answer, ignored
            moved = self.pq.classes[c].make_ready(mr.request_id, placement)
            if moved is not None:
                live.state = READY
                self._dirty = True

    def fold_words(self) -> bool:
        """Fold the routers' shared-memory words (one kernel call, `Ledger.fold_progress`).

        Same effect as the `Update(dispatched | prefill_done | progress)` frames: a slot whose
        `dispatched` flag appeared tells its admission policy `Dispatched` (at most once per lease);
        freed capacity re-checks the blocked lanes of the workers it changed and marks a dispatch pass
        due (run by `drain_cleanup`).
        Returns:
            bool: True when something changed (then call `drain_cleanup`).
        """
        rows = self.ledger.fold_progress_rows()
        for row in rows:  # only the workers whose capacity changed
            self._capacity_changed(row)
        told = False
        for slot in self.ledger.take_dispatched():
            live = self._by_slot.get(slot)
            if live is not None and live.tracked and not live.told_dispatched:
                live.told_dispatched = True
                self._events.append((live.entry.class_idx, Dispatched(live.spec.request_id)))
                told = True
        return bool(rows) or told

    @property
    def waiting(self) -> bool:
        """True while some request waits in a class queue or is deferred (O(1))."""
        return len(self._live) > len(self._by_slot)

    def tick(self, now_us: int) -> Outcomes:
        """Fold progress, time out waiting requests, reconcile policies, dispatch if needed."""
        self.fold_words()
        out = self._expire(now_us)
        if self._expire_orphans(now_us):
            self._dirty = True
        fleet = None
        for cq in self.pq.classes:
            if cq.admission is not None:
                fleet = fleet or self._fleet()
                self._apply_make_ready(cq.index, cq.admission.notify(Reconcile(), fleet, now_us), now_us)
        self._tell_policies(now_us)
        if self._dirty:
            out += self._dispatch(now_us)
        self.pq.compact()
        return out

    def _expire(self, now_us: int) -> Outcomes:
        out: Outcomes = []
        heap = self._timeouts
        while heap and heap[0][0] <= now_us:
            _, _, rid, token = heapq.heappop(heap)
            live = self._live.get(rid)
            if live is None or live.wait_token != token or live.state not in (READY, DEFERRED):
                continue
            cq = self.pq.classes[live.entry.class_idx]
            self.pq.remove(live.entry)
            self._drop(live, abort=True)
            waited = (now_us - live.entry.arrival_us) / 1e6
            out.append(self._reject(live.spec, "timeout", f"waited {waited:.3f} s", cq.name))
            self._dirty = True
        return out

    def shutdown(self, now_us: int) -> list[Reject]:
        """Every waiting / deferred request → Reject "shutting_down"; later enqueues too."""
        self._shutting_down = True
        out = []
        for cq in self.pq.classes:
            entries = list(cq.iter_all())
            cq.remove_many(entries)
            self.pq._reset_if_empty(cq)  # noqa: SLF001 - same package
            for entry in entries:
                self._drop(entry.payload, abort=True)
                out.append(self._reject(entry.payload.spec, "shutting_down", "scheduler is shutting down", cq.name))
        self._tell_policies(now_us)
        self.pq.compact()
        return out


def _queueing(cls: ClassConfig) -> bool:
    """A class with a busy threshold queues; one without rejects `all_overloaded` at once."""
    return cls.prefill_busy_threshold is not None or cls.prefill_busy_threshold_frac is not None


def _requests(n: int) -> str:
    return f"{n} request{'' if n == 1 else 's'} waiting"
