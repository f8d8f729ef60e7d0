"""PolicyClassQueue: the ready storage of one policy class (docs/DESIGN.md §4.6).

```
PolicyClassQueue("agents")
├── admission        AdmissionPolicy | None (driven by the Scheduler)
├── deferred         request_id -> QueueEntry, held by the admission policy
├── pending          RequestQueue: WorkerPlacement::Any (the selector may choose any eligible worker)
├── lanes            WorkerKey -> RequestQueue of requests pinned to that worker (removed when empty)
├── blocked_workers  lanes whose worker was found full; skipped until on_capacity_change(worker)
└── lane heads       ordered index (lazy heap) of the head of every unblocked lane
```

Only roots are inspected. A full worker blocks only its own lane; a blocked lane is re-checked once
per capacity change of that worker, not once per pop. The class owns no worker configuration,
capacity or scoring state: the caller passes `worker_ready` / `shared_ready` predicates.

Known limitation kept from Dynamo's design (docs/DESIGN.md §4.14): a shared-heap head whose allowed
workers are all busy stalls the shared heap of its class until one frees (only roots are inspected);
pinned lanes and other classes keep flowing.

Source: Dynamo's per-class ready storage (kv-router scheduling); docs/DESIGN.md §4.6 Per-class storage,
§4.10 Limits, §4.8 Anti-bypass.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..config import ClassConfig
from ..protocol import ClassRow
from .admission import AdmissionPolicy, create_admission_policy
from .ordering import QueueEntry
from .request_queue import RequestQueue, create_request_queue
from .types import WorkerKey

_HEAD_SEQ = itertools.count(1)
WorkerReady = Callable[[WorkerKey], bool]  # may this lane's worker take its head now?
SharedReady = Callable[[QueueEntry], bool]  # may the shared root run now (some allowed worker free)?


@dataclass(frozen=True, slots=True)
class LimitExceeded:
    """A class limit that refuses one more waiting request (becomes Reject "queue_full")."""

    limit_kind: str  # "requests" | "isl_tokens"
    current: int  # requests, or prompt tokens, waiting (ready + deferred) before this one
    limit: int  # per-worker limit x registered worker ids


class PolicyClassQueue:
    """Ordering and accounting of one class.

    Invariants: every ready entry is in exactly one of `pending` / `lanes[w]`; `n_waiting` and
    `isl_waiting` count ready + deferred entries; `deficit` >= 0 (DRR credit, uncached tokens).
    """

    __slots__ = (
        "_head_of",
        "_heads",
        "_to_compact",
        "_unsettled",
        "admission",
        "blocked_workers",
        "config",
        "deferred",
        "deficit",
        "index",
        "isl_waiting",
        "lanes",
        "n_waiting",
        "pending",
    )

    def __init__(self, config: ClassConfig, index: int, admission: AdmissionPolicy | None = None) -> None:
        self.config = config
        self.index = index
        self.admission = admission
        self.pending: RequestQueue = create_request_queue(config.ordering)
        self.lanes: dict[WorkerKey, RequestQueue] = {}
        self.blocked_workers: set[WorkerKey] = set()
        self.deferred: dict[str, QueueEntry] = {}
        self.deficit = 0
        self.n_waiting = 0  # ready + deferred requests
        self.isl_waiting = 0  # ready + deferred prompt tokens
        self._heads: list[tuple[Any, ...]] = []  # (key, seq, worker) lazy heap of unblocked lane heads
        self._head_of: dict[WorkerKey, int] = {}  # worker -> seq of its valid heap item
        self._to_compact: dict[int, RequestQueue] = {}  # containers with removals since compact()
        self._unsettled: dict[WorkerKey, None] = {}  # lanes `discard` took from since `settle`

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.config.name

    @property
    def n_ready(self) -> int:
        """Ready entries (pending + lanes); the anti-bypass backlog."""
        return self.n_waiting - len(self.deferred)

    def has_ready(self) -> bool:
        return self.n_waiting > len(self.deferred)

    def iter_ready(self) -> Iterator[QueueEntry]:
        yield from self.pending
        for lane in self.lanes.values():
            yield from lane

    def iter_all(self) -> Iterator[QueueEntry]:
        yield from self.iter_ready()
        yield from self.deferred.values()

    def class_row(self, now_us: int) -> ClassRow:
        """This class for the admin socket: depth, deferred, waiting ISL tokens, oldest wait (s), DRR
        deficit, blocked lanes. O(waiting requests)."""
        oldest = min((e.arrival_us for e in self.iter_all()), default=now_us)
        return ClassRow(
            name=self.name,
            ordering=self.config.ordering,
            quantum=self.config.quantum,
            depth=self.n_ready,
            deferred=len(self.deferred),
            isl_tokens=self.isl_waiting,
            oldest_wait_s=max(0, now_us - oldest) / 1e6,
            deficit=self.deficit,
            blocked_lanes=len(self.blocked_workers),
        )

    # ---- a profile reload --------------------------------------------------------------------
    def reconfigured(self, config: ClassConfig, index: int) -> PolicyClassQueue:
        """This class under a reloaded profile's `config`, at `index` (docs/DESIGN.md §4.16): its admission
        policy is reconfigured when the type is kept, replaced (or removed) otherwise; a new ordering
        re-keys every entry into a fresh queue (returned instead of this one); blocked lanes are checked
        again. The caller has refused a change that would lose a tracking policy's state."""
        was = self.config.admission  # not None while the class has a policy
        if config.admission is None:
            self.admission = None
        elif self.admission is not None and was is not None and was.type == config.admission.type:
            self.admission.reconfigure(config.admission)
        else:
            self.admission = create_admission_policy(config.admission)
        cq = self
        if config.ordering != self.config.ordering:
            cq = PolicyClassQueue(config, index, self.admission)
            for entry in list(self.iter_ready()):
                cq.add(entry)
            for entry in self.deferred.values():
                cq.defer(entry)
            cq.deficit = self.deficit
        cq.index = index
        cq.config = config
        cq.unblock_all()
        return cq

    # ---- limits ------------------------------------------------------------------------------
    def check_limits(self, n_worker_ids: int, room: tuple[int, int] = (0, 0)) -> LimitExceeded | None:
        """Limits are checked BEFORE adding: the request that crosses a limit is accepted, the
        next one refused. Limits scale with the number of registered worker ids (docs/DESIGN.md §4.10).
        `room` (requests, ISL tokens) is how far past each limit this request may still be accepted
        (a connection's share, `WaitingShares.room`); the refusal reports the class limit itself."""
        cfg = self.config
        if cfg.request_queue_limit_per_worker is not None:
            limit = cfg.request_queue_limit_per_worker * n_worker_ids
            if self.n_waiting >= limit + room[0]:
                return LimitExceeded("requests", self.n_waiting, limit)
        if cfg.isl_token_queue_limit_per_worker is not None:
            limit = cfg.isl_token_queue_limit_per_worker * n_worker_ids
            if self.isl_waiting >= limit + room[1]:
                return LimitExceeded("isl_tokens", self.isl_waiting, limit)
        return None

    # ---- adding ------------------------------------------------------------------------------
    def add(self, entry: QueueEntry) -> None:
        """Add a ready entry to `pending` or to the lane of `entry.placement`, by its key (a
        `requeued` entry's FCFS key puts it ahead of new arrivals of its strict_priority tier)."""
        entry.class_idx = self.index
        self._container_add(entry)
        self.n_waiting += 1
        self.isl_waiting += entry.isl_tokens

    def defer(self, entry: QueueEntry) -> None:
        """Hold an entry for the admission policy (counts toward limits, not the ready backlog)."""
        if entry.request_id in self.deferred:
            raise ValueError(f"request {entry.request_id!r} is already deferred")
        entry.class_idx = self.index
        self.deferred[entry.request_id] = entry
        self.n_waiting += 1
        self.isl_waiting += entry.isl_tokens

    def make_ready(self, request_id: str, placement: WorkerKey | None) -> QueueEntry | None:
        """Release a deferred entry into `pending` (placement None) or a worker lane; or move a
        ready shared entry into a lane. Limits are not re-applied. Returns the moved entry, or
        None when the id is unknown / already where asked (ignored). The caller re-snapshots the
        cost of an exact placement before calling (entry.cost); a moved entry is re-keyed, except a
        requeued FCFS head (prepend band), which keeps its key."""
        entry = self.deferred.pop(request_id, None)
        if entry is not None:
            entry.placement = placement if placement is not None else entry.placement
            self._container_add(entry)
            return entry
        if placement is None or request_id not in self.pending:
            return None
        entry = self.pending.discard_requests([request_id])[0]
        self._to_compact[id(self.pending)] = self.pending
        entry.placement = placement
        self._container_add(entry)
        return entry

    def unplace(self, entry: QueueEntry) -> bool:
        """Move a ready entry from its worker lane back to `pending` (its worker was removed; the
        caller re-snapshots `entry.cost` first). Limits are not re-applied. False if not in a lane."""
        worker = entry.placement
        if worker is None:
            return False
        lane = self.lanes.get(worker)
        if lane is None or not lane.discard_entry(entry):
            return False
        self._to_compact[id(lane)] = lane
        self._lane_changed(worker)
        entry.placement = None
        self._container_add(entry)
        return True

    def find(self, request_id: str) -> QueueEntry | None:
        """The waiting entry with this id (deferred first), or None. O(1)."""
        entry = self.deferred.get(request_id)
        if entry is not None:
            return entry
        entry = self.pending.get(request_id)
        if entry is not None:
            return entry
        for lane in self.lanes.values():
            entry = lane.get(request_id)
            if entry is not None:
                return entry
        return None

    def _container_add(self, entry: QueueEntry) -> None:
        worker = entry.placement
        if worker is None:
            self.pending.add_request(entry)
            return
        self._lane(worker).add_request(entry)
        self._reindex(worker)

    def _lane(self, worker: WorkerKey) -> RequestQueue:
        lane = self.lanes.get(worker)
        if lane is None:
            lane = self.lanes[worker] = create_request_queue(self.config.ordering)
        return lane

    # ---- removing ----------------------------------------------------------------------------
    def remove(self, entry: QueueEntry) -> bool:
        """Remove one waiting entry (ready or deferred). Returns False when it is not here."""
        return bool(self.remove_many([entry]))

    def remove_many(self, entries: Iterable[QueueEntry]) -> list[QueueEntry]:
        """Remove waiting entries (lazy deletion, O(1) each; `discard` then `settle`). Containers are
        compacted by the next `compact()`, so a cleanup batch costs at most one compaction per
        container. Returns the removed entries, in the given order."""
        removed = [entry for entry in entries if self.discard(entry)]
        self.settle()
        return removed

    def discard(self, entry: QueueEntry) -> bool:
        """Take one waiting entry (ready or deferred) out, O(1), without re-indexing its lane's head:
        call `settle` once after a batch, before the class is dispatched from again. False when the
        entry is not here."""
        deferred = self.deferred
        if deferred and deferred.get(entry.request_id) is entry:
            del deferred[entry.request_id]
        else:
            worker = entry.placement
            lane: RequestQueue | None = self.pending if worker is None else self.lanes.get(worker)
            if lane is None or not lane.discard_entry(entry):
                return False
            if worker is not None:
                self._unsettled[worker] = None
            self._to_compact[id(lane)] = lane
        self.n_waiting -= 1
        self.isl_waiting -= entry.isl_tokens
        return True

    def settle(self) -> None:
        """Re-index the head of every lane `discard` took entries from (an emptied lane goes), in the
        order they first lost one."""
        if self._unsettled:
            for worker in self._unsettled:
                self._lane_changed(worker)
            self._unsettled.clear()

    def pop(self, entry: QueueEntry) -> None:
        """Remove `entry`, which must be the root of its container (as returned by
        `next_dispatchable`)."""
        worker = entry.placement
        lane = self.pending if worker is None else self.lanes[worker]
        got = lane.pop_request()
        assert got is entry, "pop() of an entry that is not its container's root"
        self.n_waiting -= 1
        self.isl_waiting -= entry.isl_tokens
        if worker is not None:
            self._lane_changed(worker)

    def compact(self) -> int:
        """Compact every container that had removals since the last call (each at most once, and
        only when its dead items outnumber its live ones). Returns the compactions done."""
        if not self._to_compact:  # most cleanup batches removed nothing from this class
            return 0
        done = sum(c.compact() for c in self._to_compact.values())
        self._to_compact.clear()
        return done

    # ---- the lane-head index -----------------------------------------------------------------
    def _lane_changed(self, worker: WorkerKey) -> None:
        lane = self.lanes.get(worker)
        if lane is not None and not lane:
            del self.lanes[worker]
            self.blocked_workers.discard(worker)
            self._head_of.pop(worker, None)
            return
        self._reindex(worker)

    def _reindex(self, worker: WorkerKey) -> None:
        """(Re)publish the head of an unblocked lane in the ordered index (lazy heap)."""
        if worker in self.blocked_workers:
            return
        head = self.lanes[worker].peek_request()
        seq = next(_HEAD_SEQ)  # never reused, so a stale item of a dropped lane stays stale
        self._head_of[worker] = seq
        heapq.heappush(self._heads, (head.key, seq, worker))
        if len(self._heads) > 4 * len(self.lanes) + 64:
            self._heads = [it for it in self._heads if self._head_of.get(it[2]) == it[1]]
            heapq.heapify(self._heads)

    def on_capacity_change(self, worker: WorkerKey) -> None:
        """The worker's capacity changed: its blocked lane (if any) is checked again once."""
        if worker in self.blocked_workers:
            self.blocked_workers.discard(worker)
            if worker in self.lanes:
                self._reindex(worker)

    def unblock_all(self) -> None:
        """Re-check every blocked lane (config reload, progress folding of unknown rows)."""
        for worker in list(self.blocked_workers):
            self.on_capacity_change(worker)

    # ---- dispatch ----------------------------------------------------------------------------
    def next_dispatchable(self, worker_ready: WorkerReady, shared_ready: SharedReady) -> QueueEntry | None:
        """The entry this class would dispatch next, or None; does not remove it.

        Compares the shared root (if `shared_ready(root)`) with the best unblocked lane head. Lane
        heads whose worker is not ready are moved to `blocked_workers` until that worker's next
        `on_capacity_change`, so each blocked lane is checked once per capacity change.
        """
        lane_head = self._best_lane_head(worker_ready)
        if self.pending:
            root = self.pending.peek_request()
            if (lane_head is None or root.key < lane_head.key) and shared_ready(root):
                return root
        return lane_head

    def _best_lane_head(self, worker_ready: WorkerReady) -> QueueEntry | None:
        heads = self._heads
        while heads:
            _key, seq, worker = heads[0]
            if self._head_of.get(worker) != seq:
                heapq.heappop(heads)  # superseded by a newer head of the same lane
                continue
            if worker_ready(worker):
                return self.lanes[worker].peek_request()
            heapq.heappop(heads)
            del self._head_of[worker]
            self.blocked_workers.add(worker)
        return None
