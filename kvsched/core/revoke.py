"""Requests ended by someone other than their holder: a router's death, an operator's cancel, the
daemon's shutdown.

Plain functions over the scheduler's parts, like `workers.py` and `reload.py`; pure and synchronous
like the rest of the core. The user-facing rules (docs/PROTOCOL.md "Scheduling contracts"): a dead
router's leases are aborted and its waiting requests cancelled; an operator's cancel answers the
owner with one `Reject("cancelled")` (a revocation notice, `revoked=True`, when it held a lease);
at shutdown every waiting or deferred request is answered `shutting_down`, and so is every later
enqueue.
"""

from __future__ import annotations

from .leases import LEASED
from .types import Reject


def cancel_owner(sched, owner: int, now_us: int) -> None:  # noqa: ANN001 - a Scheduler
    """Router death: every lease of `owner` is released "aborted", every waiting request of it
    "cancelled" (through `Scheduler.release`, so policies are told at `drain_cleanup`)."""
    table = sched.lease_table
    for rid in list(table.by_owner.get(owner, ())):
        live = table.live[rid]
        if live.state == LEASED:
            sched.release(rid, live.slot, live.generation, "aborted", 0, now_us)
        else:
            sched.release(rid, -1, 0, "cancelled", 0, now_us)


def cancel(sched, request_id: str, now_us: int) -> list[Reject] | None:  # noqa: ANN001 - a Scheduler
    """Admin cancel of `request_id`: remove it while it waits, or abort its lease; None when unknown.

    Returns one `Reject("cancelled")` for the owner: for a waiting request it is the answer to its
    Enqueue; for a lease it is a revocation notice (`revoked=True`) telling the holder to stop.
    """
    live = sched.lease_table.live.get(request_id)
    if live is None:
        return None
    cls_name = sched.pq.classes[live.entry.class_idx].name
    leased = live.state == LEASED
    if leased:
        sched.release(request_id, live.slot, live.generation, "aborted", 0, now_us)
    else:
        sched.release(request_id, -1, 0, "cancelled", 0, now_us)
    reject = sched.admitter.reject(live.spec, "cancelled", "cancelled by an operator", cls_name)
    if leased:
        reject = Reject(reject.request_id, reject.owner, reject.reason, "lease revoked by an operator",
                        reject.policy_class, revoked=True)
    return [reject]


def shutdown(sched, now_us: int) -> list[Reject]:  # noqa: ANN001 - a Scheduler
    """Every waiting / deferred request → Reject "shutting_down" (one each); `Intake` rejects
    later enqueues the same way. Policies are told, containers compacted."""
    sched.intake.shutting_down = True
    out = []
    pq = sched.pq
    for cq in pq.classes:
        entries = list(cq.iter_all())
        cq.remove_many(entries)
        pq._reset_if_empty(cq)  # noqa: SLF001 - same package
        for entry in entries:
            live = entry.payload
            sched.lease_table.drop(live, abort=True)
            out.append(sched.admitter.reject(live.spec, "shutting_down", "scheduler is shutting down",
                                             cq.name))
    sched._tell_policies(now_us)  # noqa: SLF001 - the facade's own step
    pq.compact()
    return out
