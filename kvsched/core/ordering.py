"""Queue entries and the ordering keys of the three class orderings (docs/DESIGN.md §4.4).

Every key is a tuple compared ascending (the smallest key runs first), shaped
`(-strict_priority, score_part..., enqueue_seq)`:

* `strict_priority` first (higher wins);
* the score: FCFS = (0, enqueue_seq) for a *requeued* request — ahead of every not-yet-admitted
  request of its `strict_priority` tier, requeued ones in their original order — else
  (1, arrival - jump µs), i.e. score = jump - arrival offset (s); WSPT score = (1 + jump) / cost, with
  jump = max(0, priority) seconds of virtual earlier arrival and cost = max(1, uncached tokens) from
  the enqueue `CostSnapshot`; `priority` ordering = vLLM's (lower `priority` value first, then
  arrival time). Priority / WSPT requeues re-enter by their normal key;
* `enqueue_seq` last (earlier wins), so two live entries never compare equal.

Source: docs/DESIGN.md §2.2, §4.4; Dynamo's `PolicyQueueEntry` (priority key, enqueue sequence,
token snapshot); vLLM `request_queue.py` (`Request.__lt__`: priority, then arrival_time).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from .types import WorkerKey

US_PER_S = 1_000_000
REQUEUED, ARRIVED = 0, 1  # FCFS sub-order inside a strict_priority tier

Key = tuple


class QueueEntry(msgspec.Struct, eq=False):
    """One waiting request plus its ordering inputs and accounting snapshot (docs/DESIGN.md §4.4,
    §4.6). A mutable `msgspec.Struct` (one is built per request; ~4x cheaper than a slots
    dataclass); `eq=False`: compared and hashed by identity.

    Attributes:
        request_id: unique among live requests.
        enqueue_seq: scheduler-wide arrival counter; kept across requeues (docs/DESIGN.md §2.2 requeue).
        arrival_us: enqueue time (µs, scheduler clock); the FCFS / priority arrival.
        priority: jump in seconds (fcfs / wspt) or vLLM priority (priority ordering).
        strict_priority: higher first; outranks every score.
        cost: max(1, uncached prompt tokens) from the enqueue snapshot; tokens (WSPT, DRR).
        isl_tokens: raw prompt tokens (ISL limit accounting).
        placement: the worker lane this entry waits in, or None for the class's shared heap.
        class_idx: index of its class in the PolicyQueue.
        payload: caller data (the Scheduler stores its request record here).
        key: ordering key, assigned by the RequestQueue that holds the entry.
        requeued: its worker gave it back at least once (FCFS: it then sorts ahead of new arrivals
            of its strict_priority tier, by enqueue_seq).
    """

    request_id: str
    enqueue_seq: int = 0
    arrival_us: int = 0
    priority: int = 0
    strict_priority: int = 0
    cost: int = 1
    isl_tokens: int = 1
    placement: WorkerKey | None = None
    class_idx: int = 0
    payload: object = None
    key: Key = ()
    requeued: bool = False


def jump_s(priority: int) -> int:
    """The jump of fcfs / wspt orderings: max(0, priority), seconds of virtual earlier arrival."""
    return priority if priority > 0 else 0


def fcfs_key(e: QueueEntry) -> Key:
    """FCFS: score = jump - arrival offset; higher score first, i.e. smaller (arrival - jump) µs.
    A requeued entry goes ahead of every arrival of its strict_priority tier, by enqueue_seq."""
    if e.requeued:
        return (-e.strict_priority, REQUEUED, e.enqueue_seq)
    return (-e.strict_priority, ARRIVED, e.arrival_us - jump_s(e.priority) * US_PER_S, e.enqueue_seq)


def priority_key(e: QueueEntry) -> Key:
    """vLLM's order: lower `priority` value first, then earlier arrival (vLLM `Request.__lt__`)."""
    return (-e.strict_priority, e.priority, e.arrival_us, e.enqueue_seq)


def wspt_key(e: QueueEntry) -> Key:
    """WSPT: score = (1 + jump) / cost (cost = max(1, uncached tokens)); higher score first."""
    return (-e.strict_priority, -(1 + jump_s(e.priority)) / max(1, e.cost), e.enqueue_seq)


KEY_FUNCS: dict[str, Callable[[QueueEntry], Key]] = {
    "fcfs": fcfs_key,
    "priority": priority_key,
    "wspt": wspt_key,
}
