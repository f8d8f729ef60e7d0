"""The timed work of the scheduler: fold the routers' shared-memory words, time out waiting requests,
release unclaimed orphan leases, reconcile the admission policies.

Plain functions over the scheduler's parts (docs/ARCHITECTURE.md "The core"); pure and synchronous
like the rest of the core, time comes in as `now_us` (µs). The daemon's actor calls `fold_words` on
every wake and while requests wait, and `Scheduler.tick` every `progress_fold_ms`; the virtual-time
driver calls the same. What follows a tick (telling the policies, one dispatch pass, compaction)
stays in `Scheduler.tick`, as in `drain_cleanup`.
"""

from __future__ import annotations

from .admission import Reconcile
from .leases import LEASED
from .policy_feed import apply_make_ready
from .types import Admit, Reject


def fold_words(sched) -> bool:  # noqa: ANN001 - a Scheduler
    """Fold the routers' shared-memory words (one kernel call, `Ledger.fold`).

    Same effect as the `Update(dispatched | prefill_done | progress)` frames: a slot whose
    `dispatched` flag appeared tells its admission policy `Dispatched` (at most once per lease);
    freed capacity re-checks the blocked lanes of the workers it changed and marks a dispatch pass
    due (run by `drain_cleanup`).
    Returns:
        bool: True when something changed (then call `drain_cleanup`).
    """
    rows, dispatched = sched.ledger.fold()
    if not rows and not dispatched:
        return False
    for row in rows:  # only the workers whose capacity changed
        sched._capacity_changed(row)  # noqa: SLF001 - same package
    told = False
    by_slot = sched.lease_table.by_slot
    for slot in dispatched:
        live = by_slot.get(slot)
        if live is not None and live.tracked and not live.told_dispatched:
            sched.feed.dispatched(live)
            told = True
    return bool(rows) or told


def expire(sched, now_us: int) -> tuple[list[Admit | Reject], bool]:  # noqa: ANN001 - a Scheduler
    """The timed part of a tick, in this order: fold the words, reject the waiting requests past
    their queue deadline (`Intake.expire`), release the orphan leases whose grace ended unclaimed
    (outcome `aborted`), send `Reconcile` to every class's admission policy and apply its
    `MakeReady` answers.

    Returns:
        (outcomes, changed): the deadline rejections, and True when a dispatch pass is due
        (freed capacity marks that itself, through `Scheduler.release`).
    """
    sched.fold_words()  # through the facade, as a tick always did
    out: list[Admit | Reject] = sched.intake.expire(now_us)
    changed = bool(out)
    orphans = sched.lease_table.expired_orphans(now_us)
    for live in orphans:
        if live.state == LEASED:
            sched.release(live.spec.request_id, live.slot, live.generation, "aborted", 0, now_us)
    if orphans:
        changed = True
    fleet = None
    for cq in sched.pq.classes:
        if cq.admission is not None:
            fleet = fleet or sched.admitter.fleet()
            if apply_make_ready(sched, cq.index, cq.admission.notify(Reconcile(), fleet, now_us), now_us):
                changed = True
    return out, changed
