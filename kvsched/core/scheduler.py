"""Scheduler: the facade the daemon actor and the virtual-time simulator drive (Dynamo's
`SchedulerQueueActor` state). Pure and synchronous; time comes in as `now_us` (µs). Every mutator
returns a list of `Admit` / `Reject` records for the caller to deliver.

The work is done by parts with one job each, each the only writer of its own state
(docs/ARCHITECTURE.md "The core"):
* `OverlapView` (overlap_view.py): the overlap indexes, the memo and the credit rule;
* `Admitter` (admitter.py): readiness, cost snapshots, project → select → reserve, the dispatch pass;
* `LeaseTable` (leases.py): live requests by id / slot / owner, ownership, adoption, orphans;
* `Intake` (intake.py): validation, placements, why a request waits, limits, deadlines, the
  admission policies' answers, the waiting requests a removed worker strands;
* `PolicyFeed` (policy_feed.py): admission-policy events buffered until `drain_cleanup`;
* `PolicyQueue` / `PolicyClassQueue` (policy_queue.py, class_queue.py): the class queues and DRR;
* `WaitingShares` (waiting_share.py): each connection's share of the class limits.
The facade keeps the dirty flag and the class names, and coordinates the parts, through their public
methods, where one act spans several: a lifecycle (`enqueue`, `update`, `release`), requests ended by
someone other than their holder (`cancel_owner`, `cancel`, `shutdown`), a worker's removal, the timed
work (`fold_words`, `tick`), a profile reload (`reload`). Admin views: each part describes itself.

Lifecycle rules kept here: `release()` frees the booking / removes the queued entry at once (lazy
deletion) and buffers the policy events and the id; `drain_cleanup()` tells the policies (the id
becomes reusable), runs ONE dispatch pass and compacts each container at most once. Keyed by
(request_id, slot, generation): stale or repeated releases are no-ops; `slot == -1` only cancels a
waiting request. `decisions_total` counts every Admit and Reject produced.

Source: Dynamo kv-router scheduling (queue hierarchy, lifecycle, guardrails); vLLM `request_queue.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..config import ClassConfig, Config
from ..protocol import ClassRow, ExplainReply, LeaseRow, WorkerRow
from ..shm.overlap import OverlapIndex
from .admission import Bypass, Defer, Ready, create_admission_policy
from .admitter import Admitter
from .class_queue import PolicyClassQueue
from .intake import Intake
from .leases import LeaseTable, OrphanCounts
from .live import DEFERRED, LEASED, READY, Live
from .ordering import QueueEntry
from .overlap_view import ApproxIndex, OverlapView
from .policy_feed import PolicyFeed
from .policy_queue import PolicyQueue
from .reload import selector_keys_needing_rebuild
from .selector import WorkerSelector, create_selector
from .types import Admit, Reject, RequestSpec, WorkerKey
from .waiting_share import WaitingShares

if TYPE_CHECKING:
    from .ledger import Ledger

Outcomes = list[Admit | Reject]
BYPASS = Bypass()  # the decision of a class without an admission policy (one shared record)


class Scheduler:
    """Queues, admission policies and leases of one daemon instance. Build it with
    `kvsched.core.create.create_scheduler`.

    Args:
        config: the whole config (classes, selector, overload, daemon.block_size).
        ledger / overlap / selector: collaborators (shm-backed or private); `overlap` is the
            approximate index, learnt from routing decisions (TTL `selector.approx_ttl_s`).
        owner_alive: owner id -> False when the requester is known gone (admit_one then skips it).
        same_process: (owner a, owner b) -> True when both are connections of one process (Reattach
            may then move requests from a to b).
        event_device / event_offload / speculative / speculative_ttl_s: see `OverlapView`.
    """

    def __init__(
        self,
        config: Config,
        ledger: Ledger,
        overlap: OverlapIndex | ApproxIndex,
        selector: WorkerSelector,
        owner_alive: Callable[[int], bool] = lambda owner: True,
        *,
        same_process: Callable[[int, int], bool] = lambda a, b: False,
        event_device: OverlapIndex | None = None,
        event_offload: OverlapIndex | None = None,
        speculative: OverlapIndex | None = None,
        speculative_ttl_s: float | None = None,
    ) -> None:
        self.config, self.ledger, self.selector = config, ledger, selector
        self.selector_config = config.selector  # what `selector` was built from (`reload` may rebuild it)
        self.view = OverlapView(
            ledger,
            overlap,
            device=event_device,
            offload=event_offload,
            speculative=speculative,
            selector=config.selector,
            speculative_ttl_s=speculative_ttl_s,
        )
        self.feed = PolicyFeed()
        self.shares = WaitingShares(config.daemon.max_waiting_share)
        self.lease_table = LeaseTable(ledger, self.shares, self.feed, owner_alive, same_process)
        pq = PolicyQueue(
            [PolicyClassQueue(c, i, create_admission_policy(c.admission)) for i, c in enumerate(config.classes)]
        )
        self.admitter = Admitter(ledger, self.view, selector, self.lease_table, pq, config.selector)
        self.intake = Intake(ledger, self.admitter, self.lease_table, self.feed, self.shares)
        self.set_classes(config)
        self._dirty = False

    def set_classes(self, config: Config) -> None:
        """Class name -> index for `enqueue` (start, reload)."""
        self._class_index = {c.name: i for i, c in enumerate(config.classes)}
        self._default = self._class_index[config.default_class]

    # ---- parts, as read-only attributes (the daemon's wiring, metrics and tests read them) ---------
    pq = property(lambda self: self.admitter.pq, doc="The `PolicyQueue` (class queues + DRR).")
    overlap = property(lambda self: self.view.approx, doc="The approximate overlap index.")
    event_device = property(lambda self: self.view.device, doc="The KV-event-fed device index, or None.")
    event_offload = property(lambda self: self.view.offload, doc="The KV-event-fed offload index, or None.")
    speculative = property(lambda self: self.view.speculative, doc="The speculative index, or None.")
    decisions_total = property(lambda self: self.admitter.decisions_total, doc="Admits + Rejects produced.")
    invalid_placements = property(
        lambda self: self.intake.invalid_placements, doc="Admission-policy placements ignored as invalid."
    )
    queued = property(lambda self: len(self.admitter.pq), doc="Ready requests waiting (deferred excluded).")
    deferred = property(lambda self: self.admitter.pq.n_deferred, doc="Requests held by admission policies.")
    active_leases = property(lambda self: len(self.lease_table.by_slot), doc="Leases held.")
    waiting = property(lambda self: self.lease_table.waiting, doc="Some request waits or is deferred (O(1)).")

    # ---- workers -----------------------------------------------------------------------------
    def add_worker(self, key: WorkerKey, total_kv_blocks: int, max_num_batched_tokens: int) -> None:
        """Register a worker rank. Raises ValueError when full or already registered."""
        row = self.ledger.add_worker(key, total_kv_blocks, max_num_batched_tokens)
        self.view.forget_row(row)
        self._capacity_changed(row)

    def set_event_fed(self, row: int, fed: bool) -> None:
        """Mark `row` as fed (or no longer fed) by a KV-event stream (`OverlapView.set_event_fed`)."""
        self.view.set_event_fed(row, fed)

    def ranks_of(self, worker_id: int) -> int:
        """Registered ranks of `worker_id` (0 when unknown)."""
        return self.ledger.ranks_of(worker_id)

    def lease_started(self, slot: int, generation: int) -> tuple[str, int] | None:
        """(policy class name, admission time in µs) of the live lease in `slot` at `generation`, or
        None (no such slot, a free slot, or another generation: a stale or repeated release)."""
        a = self.ledger.arrays
        # `.item` gives Python ints: no numpy scalar per read, no mixed-type comparison
        if not (0 <= slot < len(a.s_state)) or a.s_state.item(slot) == 0 or a.s_generation.item(slot) != generation:
            return None
        idx, classes = a.s_class.item(slot), self.pq.classes
        return (classes[idx].name, a.s_admit_us.item(slot)) if 0 <= idx < len(classes) else None

    def rows_of(self, worker_id: int, dp_rank: int | None) -> list[int]:
        """Ledger rows of a worker (every rank when dp_rank is None). Raises KeyError when unknown."""
        return self.ledger.rows_of(worker_id, dp_rank)

    def remove_worker(self, worker_id: int, dp_rank: int | None, now_us: int) -> Outcomes:
        """Remove a worker (every rank when dp_rank is None). The user-facing rule (docs/PROTOCOL.md
        "Scheduling contracts", worker removal): its bookings are released (policies told Aborted) and the
        holder of each is sent a revocation notice (`Reject(reason="no_endpoints", revoked=True)`, detail
        naming the worker: the client marks the lease lost); the waiting requests no remaining worker can
        take are answered `no_endpoints` (`Intake.strand`). Returns the notices, then the rejections.
        O(waiting requests + its leases): removal is an operator act.
        Raises KeyError for an unknown worker (nothing changed)."""
        ledger, table = self.ledger, self.lease_table
        gone: list[WorkerKey] = []
        out: Outcomes = []
        for row in ledger.rows_of(worker_id, dp_rank):
            key = ledger.key_of(row)
            gone.append(key)
            for slot in ledger.remove_worker_row(row):
                live = table.by_slot.get(slot)
                if live is not None:
                    table.drop(live, abort=True)
                    out.append(_lease_lost(live, key, self.pq.classes[live.entry.class_idx].name))
            self.view.forget_row(row)
        out += self.intake.strand(gone, now_us)
        self.pq.compact()
        self._dirty = True
        return out

    def set_drained(self, worker_id: int, dp_rank: int | None, drained: bool, now_us: int) -> Outcomes:
        """Drain (no new admissions; leases finish) or undrain. Raises KeyError for an unknown worker."""
        for row in self.rows_of(worker_id, dp_rank):
            self.ledger.set_drained(row, drained)
            if not drained:
                self._capacity_changed(row)
        return [] if drained else self._dispatch(now_us)

    def set_max_waiting_share(self, share: float) -> None:
        """Change the per-connection share of each class limit (1.0 = no per-connection cap)."""
        self.shares.share = share

    # ---- enqueue -----------------------------------------------------------------------------
    def enqueue(self, spec: RequestSpec, now_us: int) -> Outcomes:
        """Decide one request: immediate admission, queue, defer, or Reject. [] = waiting."""
        c = self._class_index.get(spec.policy_class, self._default) if spec.policy_class else self._default
        intake, adm, ledger = self.intake, self.admitter, self.ledger
        cq = adm.pq.classes[c]
        if spec.excluded_workers:
            intake.fold_excluded(spec)
        bad = intake.validate(spec, cq.name)
        if bad is not None:
            return [bad]
        n_elig = ledger.rows.eligible_mask(spec.pinned, spec.allowed_workers, adm.elig)
        got = adm.admit(spec, cq, n_elig, intake.seq, now_us)  # one kernel call; None: the Python steps below
        if got is not None:
            return [got]
        if n_elig == 0:
            n_place = adm.placeable_mask(spec.pinned, spec.allowed_workers)
            if n_place == 0:
                return [
                    adm.reject(spec, "no_endpoints", "no registered, undrained worker the request may use", cq.name)
                ]
            if spec.do_not_queue or not _queueing(cq.config):
                return [
                    adm.reject(
                        spec, "all_overloaded", f"all {n_place} workers the request may use are overloaded", cq.name
                    )
                ]
        cost = adm.snapshot_cost(spec, spec.pinned, now_us)
        entry = QueueEntry(
            spec.request_id,
            next(intake.seq),
            now_us,
            spec.priority,
            spec.strict_priority,
            cost,
            spec.isl_tokens,
            spec.pinned,
            c,
        )
        live = Live(spec, entry)
        entry.payload = live
        decision = cq.admission.decide(spec.request_id, spec, adm.fleet(), now_us) if cq.admission else BYPASS
        live.tracked = decision is not BYPASS and not isinstance(decision, Bypass)
        if isinstance(decision, Defer):
            return self._hold(live, cq, now_us, "the admission policy deferred it", defer=True)
        if (
            isinstance(decision, Ready)
            and decision.placement is not None
            and intake.placement_ok(spec, decision.placement, cq.name)
        ):
            entry.placement = decision.placement
            entry.cost = adm.snapshot_cost(spec, decision.placement, now_us)
            n_elig = ledger.eligible_mask(entry.placement, spec.allowed_workers, adm.elig)
        why = intake.wait_reason(cq, n_elig, entry.placement != spec.pinned)
        if why is not None:
            return self._hold(live, cq, now_us, why, defer=False)
        self.lease_table.register(live)
        decided = adm.admit_one(live, now_us)
        return [] if decided is None else [decided]

    def _hold(self, live: Live, cq: PolicyClassQueue, now_us: int, why: str, defer: bool) -> Outcomes:
        held = self.intake.hold(live, cq, now_us, why, defer)
        if isinstance(held, Reject):
            return [held]
        return self._dispatch(now_us) if held else []

    def cleanup_pending(self, request_id: str) -> bool:
        """True when `request_id` was released (or rejected after its policy decided) and that cleanup
        has not reached the admission policies yet: an `enqueue` of it now is `duplicate_request`.
        The actor drains cleanup first when an Enqueue names such an id."""
        return request_id in self.feed.cleanup_ids

    def take_notices(self) -> list[str]:
        """Operator notices (ignored policy placements) since the last call, each returned once."""
        return self.intake.take_notices()

    # ---- leases ------------------------------------------------------------------------------
    def update(
        self, request_id: str, slot: int, generation: int, kind: str, output_tokens: int | None, now_us: int
    ) -> Outcomes:
        """Router progress on a lease. Raises KeyError for an unknown lease, ValueError for a bad kind.
        `requeue` releases the booking, re-enters the class (original enqueue_seq) and runs a
        dispatch pass whose records are returned."""
        live = self.lease_table.by_slot.get(slot)  # `LeaseTable.lease`, inlined (one call fewer per Update)
        if live is None or live.generation != generation or live.spec.request_id != request_id:
            raise KeyError(f"no lease ({request_id!r}, slot={slot}, generation={generation})")
        ledger = self.ledger
        if kind == "dispatched":
            ledger.dispatched(slot, generation)
            if live.tracked and not live.told_dispatched:
                self.feed.dispatched(live)
        elif kind == "prefill_done":
            row = ledger.prefill_done_row(slot, generation)
            if row >= 0:
                self._capacity_changed(row)
        elif kind == "progress":
            row = ledger.output_tokens_row(slot, generation, output_tokens or 0)
            if row >= 0:
                self._capacity_changed(row)
        elif kind == "requeue":
            return self._requeue(live, int(ledger.arrays.s_worker_row[slot]), now_us)
        else:
            raise ValueError(f"unknown update kind {kind!r}")
        return []

    def _requeue(self, live: Live, row: int, now_us: int) -> Outcomes:
        if live.wrote is not None:
            self.view.withdraw(live.wrote)
        self.ledger.release(live.slot, live.generation)
        self.lease_table.unlease(live)
        self.pq.requeue(live.entry)
        self.intake.arm_timeout(live, now_us, None)
        self._capacity_changed(row)
        return self._dispatch(now_us)

    def release(
        self, request_id: str, slot: int, generation: int, outcome: str, context_tokens: int, now_us: int
    ) -> None:
        """End of a request (idempotent; stale keys ignored). Policies are told at drain_cleanup."""
        live = self.lease_table.live.get(request_id)
        if live is None:
            return
        if slot == -1:
            if outcome == "cancelled" and live.state in (READY, DEFERRED):
                self.pq.remove(live.entry)
                self.lease_table.drop(live, abort=True)
                self._dirty = True
                return
            if outcome == "cancelled" or live.state != LEASED:
                return  # a cancel that lost the race with its admission: the holder releases by slot
            slot, generation = live.slot, live.generation  # Release(request_id) with the defaults
        if live.state != LEASED or live.slot != slot or live.generation != generation:
            return
        self._free_booking(live)
        self.lease_table.drop(live, outcome != "completed")
        if outcome == "completed" and live.tracked:
            self.feed.completed(live, context_tokens)

    def _free_booking(self, live: Live) -> None:
        """Free a live lease's booking (one kernel call: refcounts, aggregates, slot) and note the
        capacity change; the caller drops the request."""
        row = self.ledger.release_booking(live.slot, live.generation)
        if row < 0:  # the booking was already gone (cannot happen while the lease is live)
            row = int(self.ledger.arrays.s_worker_row[live.slot])
        self._capacity_changed(row)

    # ---- requests ended by someone other than their holder (docs/PROTOCOL.md "Scheduling contracts")
    def cancel_owner(self, owner: int, now_us: int) -> None:
        """Router death: every lease of `owner` is released "aborted" and every waiting request of it
        cancelled, with the outcome of one `release` each (policies told Aborted at `drain_cleanup`, in
        the same order); the waiting ones leave their queues and counts in one pass, so a dead flooder's
        whole queue costs O(its requests) once instead of a release each."""
        leased, waiting = self.lease_table.drop_owner(owner)
        if waiting:
            self.pq.remove_many(waiting)
            self._dirty = True
        for live in leased:
            self._free_booking(live)

    def cancel(self, request_id: str, now_us: int) -> list[Reject] | None:
        """Admin cancel of `request_id`: remove it while it waits, or abort its lease; None when unknown.
        Returns one `Reject("cancelled")` for the owner: for a waiting request the answer to its Enqueue,
        for a lease a revocation notice (`revoked=True`) telling the holder to stop."""
        live = self.lease_table.live.get(request_id)
        if live is None:
            return None
        cls_name = self.pq.classes[live.entry.class_idx].name
        leased = live.state == LEASED
        if leased:
            self.release(request_id, live.slot, live.generation, "aborted", 0, now_us)
        else:
            self.release(request_id, -1, 0, "cancelled", 0, now_us)
        detail = "lease revoked by an operator" if leased else "cancelled by an operator"
        return [self.admitter.reject(live.spec, "cancelled", detail, cls_name, revoked=leased)]

    def shutdown(self, now_us: int) -> list[Reject]:
        """Every waiting or deferred request → one `Reject("shutting_down")`, class by class; every later
        enqueue is answered the same way (`Intake.shut_down`). Policies are told, containers compacted."""
        self.intake.shut_down()
        pq = self.pq
        entries = [entry for cq in pq.classes for entry in cq.iter_all()]
        pq.remove_many(entries)
        lives = [entry.payload for entry in entries]
        for live in lives:
            self.lease_table.drop(live, abort=True)
        out = [
            self.admitter.reject(
                live.spec, "shutting_down", "scheduler is shutting down", pq.classes[live.entry.class_idx].name
            )
            for live in lives
        ]
        self._tell_policies(now_us)
        pq.compact()
        return out

    # ---- ownership (LeaseTable) --------------------------------------------------------------
    def owner_of(self, request_id: str) -> int | None:
        return self.lease_table.owner_of(request_id)

    def owned_count(self, owner: int) -> int:
        return self.lease_table.owned_count(owner)

    def may_take_over(self, request_id: str, claimant: int) -> bool:
        return self.lease_table.may_take_over(request_id, claimant)

    def adopt_lease(self, request_id: str, slot: int, generation: int, owner: int, now_us: int) -> bool:
        return self.lease_table.adopt_lease(request_id, slot, generation, owner)

    def adopt_waiting(self, request_id: str, owner: int) -> Admit | bool:
        return self.lease_table.adopt_waiting(request_id, owner)

    def restore_after_restart(self, now_us: int, grace_us: int) -> OrphanCounts:
        """Adopt every booking of the slot table as an orphan lease (`LeaseTable.adopt_slot_table`).

        Every router word (progress and state) is folded first, so a `dispatched` / `prefill_done` /
        output-token store made while no daemon ran counts; then the aggregates are recomputed from
        the slot table (the previous process may have died between two writes). Orphans are
        released by `tick` at `now_us + grace_us` unless claimed first.
        """
        ledger = self.ledger
        ledger.fold_progress(every_slot=True)
        ledger.take_dispatched()  # no policy tracks an orphan
        ledger.rebuild_aggregates()
        return self.lease_table.adopt_slot_table(
            [cq.name for cq in self.pq.classes], self._default, self.intake.seq, now_us, grace_us
        )

    def credit_stall(self, stall_us: int) -> None:
        """The actor's loop stalled `stall_us` µs: not part of the orphans' grace (`LeaseTable.credit_stall`)."""
        self.lease_table.credit_stall(stall_us)

    def take_orphan_report(self) -> OrphanCounts | None:
        """The orphan counts once their grace deadline passed (once), else None."""
        return self.lease_table.take_orphan_report()

    # ---- periodic ----------------------------------------------------------------------------
    def drain_cleanup(self, now_us: int) -> Outcomes:
        """Tell the policies about buffered releases, apply their MakeReady, then ONE dispatch pass;
        the containers that had removals are compacted (at most once each)."""
        feed = self.feed
        if feed.events:
            self._tell_policies(now_us)
        elif feed.cleanup_ids:  # nothing to tell: the released ids are reusable now
            feed.cleaned()
        out = []
        if self._dirty:
            if self._any_ready():
                out = self.admitter.dispatch(now_us)
            self._dirty = False
        self.admitter.pq.compact()  # only the classes that had removals (most cleanups have none)
        return out

    def _any_ready(self) -> bool:
        """Some class holds a ready entry (a dispatch pass with none admits nothing and changes nothing)."""
        return any(cq.n_waiting > len(cq.deferred) for cq in self.admitter.pq.classes)

    def _tell_policies(self, now_us: int) -> None:
        if self.intake.tell_policies(now_us):
            self._dirty = True

    def fold_words(self) -> bool:
        """Fold the routers' shared-memory words (one kernel call, `Ledger.fold`). Same effect as the
        `Update(dispatched | prefill_done | progress)` frames: a slot whose `dispatched` flag appeared
        tells its admission policy `Dispatched` (at most once per lease); freed capacity re-checks the
        blocked lanes of the workers it changed and marks a dispatch pass due. The daemon's actor calls
        it on every wake and while requests wait; `tick` calls it first.
        Returns:
            bool: True when something changed (then call `drain_cleanup`).
        """
        rows, dispatched = self.ledger.fold()
        if not rows and not dispatched:
            return False
        for row in rows:  # only the workers whose capacity changed
            self._capacity_changed(row)
        told = self.lease_table.note_dispatched(dispatched)
        return bool(rows) or told

    def tick(self, now_us: int) -> Outcomes:
        """The timed work, in this order: fold the routers' words (`fold_words`), reject the waiting
        requests past their queue deadline (`Intake.expire`), release the orphan leases whose grace
        ended unclaimed (outcome `aborted`), send `Reconcile` to every class's admission policy
        (`Intake.reconcile`); then tell the policies, run a dispatch pass if one is due, compact.
        The daemon calls it every `progress_fold_ms`; the virtual-time driver likewise."""
        self.fold_words()
        out: Outcomes = list(self.intake.expire(now_us))
        orphans = self.lease_table.expired_orphans(now_us)
        for live in orphans:
            if live.state == LEASED:
                self.release(live.spec.request_id, live.slot, live.generation, "aborted", 0, now_us)
        if self.intake.reconcile(now_us) or out or orphans:
            self._dirty = True
        self._tell_policies(now_us)
        if self._dirty:
            out += self._dispatch(now_us)
        self.pq.compact()
        return out

    def reload(self, config: Config) -> list[str]:
        """Apply a new scheduling profile (docs/DESIGN.md §4.16; `kvsched.core.reload` says which keys a
        reload applies): the class queues are rebuilt (`PolicyQueue.reconfigured`: requests, policies'
        state and DRR credit kept per class name), deadlines re-armed from each request's arrival, the
        waiting counts recounted; a changed `[selector]` key the selector holds rebuilds it, keeping what
        one of the same type learnt (`WorkerSelector.carry_learnt`).
        Returns:
            the changed `[selector]` keys for which the selector was rebuilt ([] = kept).
        Raises:
            ValueError (old profile kept): a class holding requests would be removed or renamed, an
                admission policy that tracks requests would be replaced by another type
                (`PolicyQueue.check_profile`), or the new selector cannot be built.
        """
        self.pq.check_profile(config.classes, self.lease_table.leased_classes())
        rebuilt = selector_keys_needing_rebuild(self.selector_config, config.selector)
        selector = create_selector(config.selector) if rebuilt else None  # may raise: nothing changed yet
        pq, remap = self.pq.reconfigured(config.classes)
        self.lease_table.renumber_classes(remap)
        self.feed.remap(remap)
        self.admitter.pq = pq
        self.config = config
        self.admitter.selector_cfg = config.selector
        self.set_classes(config)
        self.view.configure(config.selector)
        self.intake.rearm_all()
        self.shares.rebuild(self.lease_table.waiting_lives())
        if selector is not None:
            selector.carry_learnt(self.selector)
            self.selector, self.selector_config = selector, config.selector
            self.admitter.use_selector(selector)
        self._dirty = True
        return rebuilt

    # ---- dispatch ----------------------------------------------------------------------------
    def _dispatch(self, now_us: int) -> Outcomes:
        out = self.admitter.dispatch(now_us)
        self._dirty = False
        return out

    def _capacity_changed(self, row: int) -> None:
        """A worker's load changed: its blocked lanes are checked again; a dispatch pass is due."""
        pq = self.admitter.pq
        for cq in pq.classes:
            if cq.blocked_workers:
                pq.on_capacity_change(self.ledger.key_of(row))
                break
        self._dirty = True

    # ---- admin views (each part describes itself; O(classes + workers + leases), never per decision)
    def queues(self, now_us: int) -> list[ClassRow]:
        """One row per class (`PolicyClassQueue.class_row`)."""
        return [cq.class_row(now_us) for cq in self.pq.classes]

    def workers(self) -> list[WorkerRow]:
        """One row per registered worker rank (`Ledger.worker_rows`)."""
        return self.ledger.worker_rows()

    def leases(
        self, now_us: int, worker_id: int | None = None, policy_class: str | None = None, limit: int = 1000
    ) -> list[LeaseRow]:
        """Up to `limit` live leases, optionally of one worker id / one class (`LeaseTable.lease_rows`)."""
        return self.lease_table.lease_rows([cq.name for cq in self.pq.classes], now_us, worker_id, policy_class, limit)

    def explain(self, request_id: str) -> ExplainReply | None:
        """The per-worker figures of the most recent admission of `request_id` among the last ~1024
        (`ExplainRing.explain`), or None."""
        return self.admitter.explain.explain(request_id, self.selector.name)


def _lease_lost(live: Live, key: WorkerKey, cls_name: str) -> Reject:
    """The revocation notice sent to the holder of a lease on removed worker `key` (not a decision:
    `decisions_total` is not bumped). The client reads a revocation whose reason is not `cancelled` as
    a lost lease (docs/PROTOCOL.md "Scheduling contracts")."""
    return Reject(
        live.spec.request_id,
        live.spec.owner,
        "no_endpoints",
        f"lease lost: worker {key.worker_id}:{key.dp_rank} was removed by an operator",
        cls_name,
        revoked=True,
    )


def _queueing(cls: ClassConfig) -> bool:
    """A class with a busy threshold queues; one without rejects `all_overloaded` at once."""
    return cls.prefill_busy_threshold is not None or cls.prefill_busy_threshold_frac is not None
