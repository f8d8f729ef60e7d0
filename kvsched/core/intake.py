"""Intake: what happens to a request before it runs — validation, admission-policy placements,
why it must wait, putting it in its class's queue under the limits, its queue-wait deadline, the
admission policies' answers (`MakeReady`), and the waiting requests a worker's removal strands.

The user-facing rules are in docs/PROTOCOL.md "Scheduling contracts":
* Validation order: `invalid` (len(block_hashes) > ceil(isl / B) or isl < 1) → `pinned_not_allowed`
  (a pin outside allowed_workers or inside excluded_workers; excluded_workers is folded into
  allowed_workers at enqueue: allowed, else every registered id, minus the excluded ids)
  → `duplicate_request` (live, or its cleanup pending) → `shutting_down`.
* A request waits when every worker it may use is overloaded, when its class is busy on current
  prefill tokens, or behind a ready backlog (a new arrival never jumps its own class).
* Policy placements are validated (`placement_ok`); ignored ones are counted in
  `invalid_placements` and reported once through `take_notices()`.
* Timeouts: deadline = min(deadline_us, enqueue + class queue_timeout_s), for ready and deferred
  requests; a requeued request's wait restarts at the requeue (class timeout only).
* Policies are told their buffered events once per cleanup, oldest first (`tell_policies`), and
  `Reconcile` on every tick (`reconcile`); their `MakeReady` answers move requests (`make_ready`).
* Worker removal (`strand`): every waiting request (ready or deferred) that no remaining registered
  worker can take — pinned to a removed worker, or allowed only on removed workers — is answered
  `no_endpoints` (drained workers still count); one an admission policy had placed on a removed worker
  goes back to its class's shared heap.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .admission import MakeReady, Reconcile
from .live import DEFERRED, READY, Live
from .types import Reject, RequestSpec, WorkerKey

if TYPE_CHECKING:
    from .admitter import Admitter
    from .class_queue import PolicyClassQueue
    from .leases import LeaseTable
    from .ledger import Ledger
    from .ordering import QueueEntry
    from .policy_feed import PolicyFeed
    from .waiting_share import WaitingShares

MAX_NOTICES = 64  # operator notices kept until `take_notices()` (older ones are dropped, still counted)


class Intake:
    """Validation, waiting and deadlines of one scheduler's requests.

    Args:
        ledger / admitter / leases / feed / shares: the scheduler's parts (`Ledger`, `Admitter`,
            `LeaseTable`, `PolicyFeed`, `WaitingShares`); the class queues are `admitter.pq`.
    Attributes:
        invalid_placements: admission-policy placements ignored as invalid.
        seq: the enqueue_seq counter (FCFS order of equal keys).
    """

    def __init__(
        self, ledger: Ledger, admitter: Admitter, leases: LeaseTable, feed: PolicyFeed, shares: WaitingShares
    ) -> None:
        self.ledger, self.admitter, self.leases, self.feed, self.shares = ledger, admitter, leases, feed, shares
        self.invalid_placements = 0
        self._notices: list[str] = []
        self.timeouts: list[tuple[int, int, str, int]] = []  # (deadline_us, token, request_id, token)
        self._tokens = itertools.count(1)
        self.seq = itertools.count(1)
        self.shutting_down = False

    # ---- validation --------------------------------------------------------------------------
    def fold_excluded(self, spec: RequestSpec) -> None:
        """excluded_workers -> allowed_workers: (allowed, else the pin's id or every registered id) minus
        the excluded ids. A pin inside the excluded set then fails as `pinned_not_allowed`; workers
        registered after the enqueue are not eligible for this request. No excluded ids: unchanged."""
        excluded = spec.excluded_workers
        if not excluded:
            return
        if spec.allowed_workers is not None:
            base = spec.allowed_workers
        elif spec.pinned is not None:
            base = frozenset((spec.pinned.worker_id,))
        else:
            base = self.ledger.worker_ids()
        spec.allowed_workers = base - excluded
        spec.excluded_workers = None

    def validate(self, spec: RequestSpec, cls_name: str) -> Reject | None:
        bs = self.ledger.block_size
        reject = self.admitter.reject
        if spec.isl_tokens < 1 or len(spec.block_hashes) > -(-spec.isl_tokens // bs):
            return reject(
                spec,
                "invalid",
                f"{len(spec.block_hashes)} block hashes for {spec.isl_tokens} tokens (block size {bs})",
                cls_name,
            )
        if (
            spec.pinned is not None
            and spec.allowed_workers is not None
            and spec.pinned.worker_id not in spec.allowed_workers
        ):
            return reject(spec, "pinned_not_allowed", f"pinned worker {spec.pinned} not in allowed_workers", cls_name)
        if spec.request_id in self.leases.live:
            return reject(spec, "duplicate_request", "request id is live", cls_name)
        if spec.request_id in self.feed.cleanup_ids:
            return reject(
                spec, "duplicate_request", "the earlier request with this id is still being cleaned up", cls_name
            )
        if self.shutting_down:
            return reject(spec, "shutting_down", "scheduler is shutting down", cls_name)
        return None

    def placement_ok(self, spec: RequestSpec, worker: WorkerKey, cls_name: str) -> bool:
        """Is an admission-policy placement valid (registered, within pin and allowed set)? An invalid
        one is counted and noted for the operator's log; the caller ignores it."""
        if (
            self.ledger.row_of(worker) is not None
            and (spec.pinned is None or spec.pinned == worker)
            and (spec.allowed_workers is None or worker.worker_id in spec.allowed_workers)
        ):
            return True
        self.invalid_placements += 1
        if spec.pinned is not None and spec.pinned != worker:
            why = f"the request is pinned to {spec.pinned}"
        elif self.ledger.row_of(worker) is None or spec.allowed_workers is None:  # the latter: not reached
            why = "no such worker is registered"
        else:
            why = f"the request is allowed only on workers {sorted(spec.allowed_workers)}"
        if len(self._notices) < MAX_NOTICES:
            self._notices.append(
                f"ignored admission placement of request {spec.request_id!r} (class {cls_name!r}) "
                f"on worker {worker}: {why}"
            )
        return False

    def take_notices(self) -> list[str]:
        """Operator notices (ignored policy placements) since the last call, each returned once."""
        notes, self._notices = self._notices, []
        return notes

    # ---- waiting -----------------------------------------------------------------------------
    def wait_reason(self, cq: PolicyClassQueue, n_elig: int, placed: bool) -> str | None:
        """Why a new request of `cq` must wait (None: it may run now); `admitter.elig` holds its rows."""
        ahead = cq.n_ready
        if n_elig == 0:
            where = "the worker its admission policy chose is" if placed else "every worker it may use is"
            return f"{where} overloaded; {_requests(ahead)} ahead"
        adm = self.admitter
        if adm.class_busy(cq.config, adm.elig, n_elig):
            n_busy = adm.busy_count(cq.config, adm.elig)
            return (
                f"class {cq.name!r} is busy ({n_busy} of {n_elig} eligible workers above its prefill "
                f"threshold); {_requests(ahead)} ahead"
            )
        if ahead:
            return f"backlog: {_requests(ahead)} ahead in class {cq.name!r} (a new arrival never jumps its class)"
        return None

    def hold(self, live: Live, cq: PolicyClassQueue, now_us: int, why: str, defer: bool) -> Reject | bool:
        """Put a request in its class's queue (or deferred map) after do_not_queue and limits.
        `why` says why it waits (the detail of a do_not_queue rejection). Returns the Reject, or
        whether a dispatch pass is due now (the class already had a ready backlog)."""
        spec, reject = live.spec, self.admitter.reject
        if spec.do_not_queue:
            self.feed.rejected(live)
            return reject(spec, "do_not_queue", f"the request would wait: {why}", cq.name, current=cq.n_ready)
        had_backlog = cq.has_ready()
        n_ids = self.ledger.n_worker_ids()
        mine = self.shares.check(spec.owner, cq.index, cq.config, n_ids)
        if mine is not None:  # this connection holds its share while other connections wait
            self.feed.rejected(live)
            return reject(
                spec,
                "overloaded",
                f"this connection holds its max_waiting_share of class "
                f"{cq.name!r} {mine.limit_kind} limit while other connections wait",
                cq.name,
                limit_kind=mine.limit_kind,
                current=mine.current,
                limit=mine.limit,
            )
        pq = self.admitter.pq
        room = self.shares.room(spec.owner, cq.index, cq.config, n_ids)
        over = (pq.defer if defer else pq.enqueue)(cq.index, live.entry, n_ids, room)
        if over is not None:
            self.feed.rejected(live)
            return reject(
                spec,
                "queue_full",
                f"class {cq.name!r} {over.limit_kind} limit",
                cq.name,
                limit_kind=over.limit_kind,
                current=over.current,
                limit=over.limit,
            )
        live.state = DEFERRED if defer else READY
        self.shares.add(live)
        self.leases.register(live)
        self.arm_timeout(live, now_us, spec.deadline_us)
        return had_backlog and not defer

    def arm_timeout(self, live: Live, now_us: int, deadline_us: int | None) -> None:
        timeout_s = self.admitter.pq.classes[live.entry.class_idx].config.queue_timeout_s
        if timeout_s is not None:
            t = now_us + int(timeout_s * 1_000_000)
            deadline_us = t if deadline_us is None else min(deadline_us, t)
        live.deadline_us = deadline_us
        live.wait_token = next(self._tokens)
        if deadline_us is not None:
            heapq.heappush(self.timeouts, (deadline_us, live.wait_token, live.spec.request_id, live.wait_token))

    def rearm_all(self) -> None:
        """Re-arm every waiting request's deadline from its arrival (a reload changed the timeouts)."""
        self.timeouts = []
        for live in self.leases.live.values():
            if live.state in (READY, DEFERRED):
                self.arm_timeout(live, live.entry.arrival_us, live.spec.deadline_us)

    def expire(self, now_us: int) -> list[Reject]:
        """Reject "timeout" every waiting request whose deadline passed."""
        out: list[Reject] = []
        heap, pq = self.timeouts, self.admitter.pq
        while heap and heap[0][0] <= now_us:
            _, _, rid, token = heapq.heappop(heap)
            live = self.leases.live.get(rid)
            if live is None or live.wait_token != token or live.state not in (READY, DEFERRED):
                continue
            cq = pq.classes[live.entry.class_idx]
            pq.remove(live.entry)
            self.leases.drop(live, abort=True)
            waited = (now_us - live.entry.arrival_us) / 1e6
            out.append(self.admitter.reject(live.spec, "timeout", f"waited {waited:.3f} s", cq.name))
        return out

    def shut_down(self) -> None:
        """From now on every enqueue is answered `shutting_down` (`validate`)."""
        self.shutting_down = True

    # ---- the admission policies' answers -----------------------------------------------------
    def tell_policies(self, now_us: int) -> bool:
        """Tell each class's admission policy its buffered events (oldest first) and apply the
        `MakeReady` answers; the cleaned-up ids become reusable. Returns True when a request moved
        (a dispatch pass is due)."""
        feed, moved = self.feed, False
        while feed.events:
            events = feed.take()
            fleet = self.admitter.fleet()
            classes = self.admitter.pq.classes
            for c, event in events:
                policy = classes[c].admission if c < len(classes) else None
                if policy is not None:
                    moved |= self.make_ready(c, policy.notify(event, fleet, now_us), now_us)
        feed.cleaned()
        return moved

    def reconcile(self, now_us: int) -> bool:
        """Send `Reconcile` to every class's admission policy and apply its answers (a tick). True when
        a request moved."""
        moved, fleet = False, None
        for cq in self.admitter.pq.classes:
            if cq.admission is not None:
                fleet = fleet or self.admitter.fleet()
                moved |= self.make_ready(cq.index, cq.admission.notify(Reconcile(), fleet, now_us), now_us)
        return moved

    def make_ready(self, c: int, answers: list[MakeReady], now_us: int) -> bool:
        """Apply class `c`'s policy's `MakeReady` answers: a deferred request becomes ready (in its own
        place or an exact, valid placement); a ready one moves to a worker lane at most once; unknown
        or duplicate ids are ignored. Returns True when a request moved."""
        moved = False
        cq = self.admitter.pq.classes[c]
        for mr in answers:
            live = self.leases.live.get(mr.request_id)
            if live is None or live.entry.class_idx != c or live.state not in (READY, DEFERRED):
                continue
            placement = mr.placement
            if placement is not None and not self.placement_ok(live.spec, placement, cq.name):
                placement = None  # invalid: a deferred request is released to its own place
            if placement is not None:
                if live.state == READY and live.entry.placement is not None:
                    continue  # already in a worker lane: ignored
                live.entry.cost = self.admitter.snapshot_cost(live.spec, placement, now_us)  # before re-keying
            elif live.state == READY:
                continue  # already ready: duplicate answer, ignored
            if cq.make_ready(mr.request_id, placement) is not None:
                live.state = READY
                moved = True
        return moved

    # ---- worker removal ----------------------------------------------------------------------
    def strand(self, gone: Iterable[WorkerKey], now_us: int) -> list[Reject]:
        """The removed workers `gone` (already out of the ledger) leave waiting requests behind: the
        ones no registered worker can take are removed and answered `no_endpoints`, the ones placed on
        a removed worker go back to their class's shared heap, cost re-snapshot (module docstring).
        The answers go class by class, each class's deferred requests first, then its ready ones in
        queue order. O(waiting requests): removal is an operator act."""
        gone = list(gone)
        gone_set, names = set(gone), ", ".join(map(str, gone))
        adm, pq = self.admitter, self.admitter.pq
        left: dict[tuple[Any, ...], int] = {}  # (pin, allowed) -> registered placeable workers
        out: list[Reject] = []
        for cq in pq.classes:
            stranded: list[QueueEntry] = []
            deferred: list[QueueEntry] = []
            for entry in list(cq.iter_all()):
                spec = entry.payload.spec
                k = (spec.pinned, spec.allowed_workers)
                if k not in left:
                    left[k] = adm.placeable_mask(spec.pinned, spec.allowed_workers, drained_count=True)
                if left[k] == 0:
                    (deferred if cq.deferred.get(entry.request_id) is entry else stranded).append(entry)
                elif entry.placement in gone_set:  # placed there by the admission policy
                    entry.cost = adm.snapshot_cost(spec, spec.pinned, now_us)
                    cq.unplace(entry)
            removed = pq.remove_many(deferred + stranded)
            lives = [entry.payload for entry in removed]
            for live in lives:
                self.leases.drop(live, abort=True)
            out += [
                adm.reject(
                    live.spec, "no_endpoints", f"worker {names} removed; no registered worker can take it", cq.name
                )
                for live in lives
            ]
        return out


def _requests(n: int) -> str:
    return f"{n} request{'' if n == 1 else 's'} waiting"
