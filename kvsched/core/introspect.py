"""Read-only views of a Scheduler for the admin socket and metrics (protocol row structs).

Plain functions: nothing here mutates scheduling state; each call is O(classes + workers + leases)
and is meant for admin requests, never for the decision path. `explain` reads the ring of the last
~1024 admissions (`core.explain_ring.ExplainRing`: the per-worker arrays at decision time).
"""

from __future__ import annotations

import numpy as np

from ..protocol import ClassRow, ExplainReply, ExplainRow, LeaseRow, WorkerRow
from ..shm.layout import FLAG_DRAINED, FLAG_OVERLOADED, FLAG_STALE

_STATE_NAMES = {1: "admitted", 2: "dispatched", 3: "prefill_done"}


def queue_rows(sched, now_us: int) -> list[ClassRow]:  # noqa: ANN001 - a Scheduler
    """One row per class: depth, deferred, waiting ISL tokens, oldest wait (s), DRR deficit."""
    rows = []
    for cq in sched.pq.classes:
        oldest = min((e.arrival_us for e in cq.iter_all()), default=now_us)
        rows.append(ClassRow(name=cq.name, ordering=cq.config.ordering, quantum=cq.config.quantum,
                             depth=cq.n_ready, deferred=len(cq.deferred), isl_tokens=cq.isl_waiting,
                             oldest_wait_s=max(0, now_us - oldest) / 1e6, deficit=cq.deficit,
                             blocked_lanes=len(cq.blocked_workers)))
    return rows


def worker_rows(ledger) -> list[WorkerRow]:  # noqa: ANN001 - a Ledger
    """One row per registered worker rank: capacity, current load, flags."""
    a = ledger.arrays
    return [WorkerRow(worker_id=int(a.w_worker_id[r]), dp_rank=int(a.w_dp_rank[r]),
                      total_kv_blocks=int(a.w_total_kv_blocks[r]), max_num_batched_tokens=int(a.w_max_batched_tokens[r]),
                      active_blocks=int(a.w_active_blocks[r]), active_prefill_tokens=int(a.w_active_prefill[r]),
                      active_requests=int(a.w_active_requests[r]), drained=bool(a.w_flags[r] & FLAG_DRAINED),
                      overloaded=bool(a.w_flags[r] & FLAG_OVERLOADED), stale=bool(a.w_flags[r] & FLAG_STALE))
            for r in ledger.live_rows().tolist()]


def lease_rows(sched, now_us: int, worker_id: int | None = None, policy_class: str | None = None,  # noqa: ANN001
               limit: int = 1000) -> list[LeaseRow]:
    """Up to `limit` live leases, optionally of one worker id / one class."""
    out = []
    ledger = sched.ledger
    for slot, live in sched.lease_table.by_slot.items():
        info = ledger.slot_info(slot)
        key = ledger.key_of(info.row)
        name = sched.pq.classes[live.entry.class_idx].name
        if (worker_id is not None and key.worker_id != worker_id) or (policy_class not in (None, name)):
            continue
        out.append(LeaseRow(request_id=live.spec.request_id, worker_id=key.worker_id, dp_rank=key.dp_rank, slot=slot,
                            generation=info.generation, policy_class=name, isl_tokens=info.isl, cached_tokens=info.cached,
                            output_tokens=info.output_tokens, age_s=max(0, now_us - info.admit_us) / 1e6,
                            state=_STATE_NAMES.get(info.state, "free")))
        if len(out) >= limit:
            break
    return out


def explain(ring, request_id: str, decided_by: str = "") -> ExplainReply | None:  # noqa: ANN001 - an ExplainRing
    """Per-worker rows of the most recent admission of `request_id` (last ~1024 decisions);
    `decided_by` = the selector type that chose. Rows carry the selector's cost terms only when it picked
    the lowest cost (`WorkerSelector.terms`); without terms, `cost` is the projection's, for reference."""
    rec = ring.find(request_id)
    if rec is None:
        return None
    _, row, now_us, elig, depth, blocks, prefill, costs, wid, rank, present, terms = rec
    total = sum(terms.values()) if terms else costs  # costs are kept only without terms
    rows = [ExplainRow(worker_id=int(wid[r]), dp_rank=int(rank[r]), eligible=bool(elig[r]),
                       overlap_blocks=int(depth[r]), potential_blocks=int(blocks[r]),
                       potential_prefill_tokens=int(prefill[r]),
                       cost=float(total[r]) if elig[r] and np.isfinite(total[r]) else -1.0,
                       terms={k: float(v[r]) for k, v in terms.items()} if elig[r] else {})
            for r in np.flatnonzero(present).tolist()]
    return ExplainReply(request_id=request_id, chosen_worker_id=int(wid[row]), chosen_dp_rank=int(rank[row]),
                        decided_at_s=now_us / 1e6, rows=rows, decided_by=decided_by)
