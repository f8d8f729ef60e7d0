"""Worker removal: what happens to the leases and waiting requests of a worker that leaves.

A plain function over the scheduler's parts; pure and synchronous like the rest of the core.
The user-facing rule (docs/PROTOCOL.md "Scheduling contracts", worker removal): its bookings are
released (policies told Aborted) and the holder of each is sent a revocation notice
(`Reject(reason="no_endpoints", revoked=True)`, detail naming the worker: the client marks the lease
lost); every waiting request (ready or deferred) that no remaining
registered worker can take — pinned to it, or allowed only on removed workers — is answered
`no_endpoints` at once (drained workers still count); a request an admission policy had placed on
a removed worker goes back to its class's shared heap.
"""

from __future__ import annotations

from .types import Admit, Reject, WorkerKey


def rows_of(ledger, worker_id: int, dp_rank: int | None) -> list[int]:  # noqa: ANN001 - a Ledger
    """Ledger rows of a worker (every rank when dp_rank is None). Raises KeyError when unknown."""
    if dp_rank is None:
        rows = ledger.rows_of_worker_id(worker_id)
    else:
        row = ledger.row_of(WorkerKey(worker_id, dp_rank))
        rows = [] if row is None else [row]
    if not rows:
        raise KeyError(f"unknown worker {worker_id}:{'*' if dp_rank is None else dp_rank}")
    return rows


def remove_worker(sched, worker_id: int, dp_rank: int | None, now_us: int) -> list[Admit | Reject]:  # noqa: ANN001
    """Remove a worker from `sched` (all ranks when dp_rank is None); returns the revocation notices
    of its leases, then the `no_endpoints` rejections of stranded waiting requests (module
    docstring). O(waiting requests + its leases): removal is an operator act.
    Raises KeyError for an unknown worker."""
    removed, table, adm, ledger = [], sched.lease_table, sched.admitter, sched.ledger
    out: list[Admit | Reject] = []
    for row in rows_of(ledger, worker_id, dp_rank):
        key = ledger.key_of(row)
        removed.append(key)
        for slot in ledger.remove_worker_row(row):
            live = table.by_slot.get(slot)
            if live is not None:
                table.drop(live, abort=True)
                out.append(_lease_lost(live, key, sched.pq.classes[live.entry.class_idx].name))
        sched.view.forget_row(row)
    gone = set(removed)
    names = ", ".join(map(str, removed))
    left: dict[tuple, int] = {}  # (pin, allowed) -> registered placeable workers
    pq = sched.pq
    for cq in pq.classes:
        stranded = []
        for entry in list(cq.iter_all()):
            spec = entry.payload.spec
            k = (spec.pinned, spec.allowed_workers)
            if k not in left:
                left[k] = adm.placeable_mask(spec.pinned, spec.allowed_workers, drained_count=True)
            if left[k] == 0:
                stranded.append(entry)
            elif entry.placement in gone:  # placed there by the admission policy
                entry.cost = adm.snapshot_cost(spec, spec.pinned, now_us)
                cq.unplace(entry)
        for entry in cq.remove_many(stranded):
            live = entry.payload
            table.drop(live, abort=True)
            out.append(adm.reject(live.spec, "no_endpoints",
                                  f"worker {names} removed; no registered worker can take it", cq.name))
        pq._reset_if_empty(cq)  # noqa: SLF001 - same package
    pq.compact()
    return out


def _lease_lost(live, key: WorkerKey, cls_name: str) -> Reject:  # noqa: ANN001 - a leases.Live
    """The revocation notice sent to the holder of a lease on removed worker `key` (not a decision:
    `decisions_total` is not bumped). The client reads a revocation whose reason is not
    `cancelled` as a lost lease (docs/PROTOCOL.md "Scheduling contracts")."""
    return Reject(live.spec.request_id, live.spec.owner, "no_endpoints",
                  f"lease lost: worker {key.worker_id}:{key.dp_rank} was removed by an operator",
                  cls_name, revoked=True)
