"""PolicyQueue: every class queue plus deficit round robin (DRR) across classes.

DRR is in uncached prompt tokens (an entry's `cost`). `pop_next` does, in order:

1. **carry**: the last winner keeps spending its credit while its next dispatchable head is
   affordable (docs/DESIGN.md §4.7);
2. **spend existing credit** before granting a quantum: the first class from the round cursor whose
   candidate's cost is within its credit wins;
3. **one quantum per ring visit**: walking the ring from the cursor, each class with a candidate earns
   its quantum; the first one that can then afford its candidate wins;
4. **whole rounds**: if nothing is affordable after one visit, every class that has a candidate is
   granted the minimum number r of whole rounds (r x quantum) at once that lets some class afford its
   candidate; then the first affordable class from the cursor wins.

The cursor moves to winner + 1. A class with no ready entry has its credit reset to 0; a class
whose heads are all blocked (ready entries but no candidate) keeps its credit but earns none.
A single-class profile still goes through here; DRR then has no cross-class effect.

Source: Dynamo's kv-router scheduling (queue hierarchy, DRR with a round cursor and a carried class);
docs/DESIGN.md §4.7 DRR across classes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from ..config import ClassConfig
from .admission import create_admission_policy
from .class_queue import LimitExceeded, PolicyClassQueue
from .ordering import QueueEntry
from .types import WorkerKey

ClassWorkerReady = Callable[[int, WorkerKey], bool]  # (class_idx, worker) -> lane may dispatch
ClassSharedReady = Callable[[int, QueueEntry], bool]  # (class_idx, shared root) -> may dispatch


class PolicyQueue:
    """All class queues of one scheduler and the DRR state.

    Invariants: `classes[i].index == i`; `0 <= cursor < len(classes)`; `carry` is None or the
    index of the last winner.
    """

    __slots__ = ("carry", "classes", "cursor")

    def __init__(self, classes: Sequence[ClassConfig | PolicyClassQueue]) -> None:
        self.classes: list[PolicyClassQueue] = [
            c if isinstance(c, PolicyClassQueue) else PolicyClassQueue(c, i) for i, c in enumerate(classes)
        ]
        for i, cq in enumerate(self.classes):
            cq.index = i
            for entry in cq.iter_all():
                entry.class_idx = i
        self.cursor = 0
        self.carry: int | None = None

    # ---- adding ------------------------------------------------------------------------------
    def enqueue(
        self, class_idx: int, entry: QueueEntry, n_worker_ids: int, room: tuple[int, int] = (0, 0)
    ) -> LimitExceeded | None:
        """Limit-check then add a ready entry (`room`: see `PolicyClassQueue.check_limits`). Returns the
        exceeded limit (nothing added) or None."""
        cq = self.classes[class_idx]
        over = cq.check_limits(n_worker_ids, room)
        if over is None:
            cq.add(entry)
        return over

    def defer(
        self, class_idx: int, entry: QueueEntry, n_worker_ids: int, room: tuple[int, int] = (0, 0)
    ) -> LimitExceeded | None:
        """Limit-check then hold for the class's admission policy."""
        cq = self.classes[class_idx]
        over = cq.check_limits(n_worker_ids, room)
        if over is None:
            cq.defer(entry)
        return over

    def requeue(self, entry: QueueEntry) -> None:
        """A request its worker gave back re-enters its class with its original enqueue_seq (FCFS:
        ahead of new arrivals of its strict_priority tier, requeues in their original order; else by
        key); no limit check."""
        entry.requeued = True
        self.classes[entry.class_idx].add(entry)

    def put_back(self, entry: QueueEntry) -> None:
        """Return an entry `pop_next` just gave out (nothing could run it); its key is unchanged."""
        self.classes[entry.class_idx].add(entry)

    def compact(self) -> int:
        """End of a cleanup batch: compact the containers that had removals (at most once each)."""
        done = 0
        for cq in self.classes:  # a loop, not sum(generator): this runs once per cleanup pass
            done += cq.compact()
        return done

    def remove(self, entry: QueueEntry) -> bool:
        """Remove one waiting (ready or deferred) entry; resets an emptied class's credit."""
        return bool(self.remove_many((entry,)))

    def remove_many(self, entries: Iterable[QueueEntry]) -> list[QueueEntry]:
        """Remove waiting (ready or deferred) entries of any classes (lazy deletion, O(1) each: the
        containers are compacted by the next `compact`); each class touched whose ready entries are
        all gone has its credit reset. Returns the removed entries, in the given order."""
        classes = self.classes
        touched: dict[int, PolicyClassQueue] = {}
        removed: list[QueueEntry] = []
        last = None
        for entry in entries:
            cq = classes[entry.class_idx]
            if cq.discard(entry):
                removed.append(entry)
                if cq is not last:
                    touched[cq.index] = last = cq
        for cq in touched.values():
            cq.settle()
            self._reset_if_empty(cq)
        return removed

    # ---- a profile reload --------------------------------------------------------------------
    def check_profile(self, classes: list[ClassConfig], leased: set[int]) -> None:
        """Refuse a profile these queues cannot take (docs/DESIGN.md §4.16): a class holding requests
        (waiting here, or a lease: `leased` class indexes) missing from `classes`, or an admission
        policy that tracks requests replaced by one of another type.

        Raises:
            ValueError: naming the class (nothing changed).
        """
        new_names = {c.name for c in classes}
        old = {cq.name: cq for cq in self.classes}
        for name, cq in old.items():
            if name not in new_names and (cq.n_waiting or cq.index in leased):
                raise ValueError(f"reload refused: class {name!r} holds requests and is not in the new profile")
        for c in classes:
            was = old.get(c.name)
            if was is None or was.admission is None:
                continue
            was_cfg = was.config.admission  # not None: the class has a policy
            same = c.admission is not None and was_cfg is not None and c.admission.type == was_cfg.type
            if not same and was.admission.tracked():
                raise ValueError(f"reload refused: class {c.name!r} admission policy tracks requests")

    def reconfigured(self, classes: list[ClassConfig]) -> tuple[PolicyQueue, dict[int, int]]:
        """The queues of a new profile (`check_profile` passed): a class kept by name keeps its requests
        and its policy's state (`PolicyClassQueue.reconfigured`), a new one starts empty, a dropped one
        goes. Returns (the new `PolicyQueue`, old class index -> new for every class kept); the DRR ring
        starts over."""
        old = {cq.name: cq for cq in self.classes}
        remap: dict[int, int] = {}
        queues = []
        for i, c in enumerate(classes):
            cq = old.get(c.name)
            if cq is None:
                cq = PolicyClassQueue(c, i, create_admission_policy(c.admission))
            else:
                remap[cq.index] = i
                cq = cq.reconfigured(c, i)
            queues.append(cq)
        return PolicyQueue(queues), remap

    # ---- sizes -------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Ready entries over all classes (deferred excluded)."""
        return sum(c.n_ready for c in self.classes)

    @property
    def n_deferred(self) -> int:
        return sum(len(c.deferred) for c in self.classes)

    def __iter__(self) -> Iterator[QueueEntry]:
        for cq in self.classes:
            yield from cq.iter_ready()

    def on_capacity_change(self, worker: WorkerKey) -> None:
        """A worker's capacity changed: re-check its blocked lanes in every class."""
        for cq in self.classes:
            if worker in cq.blocked_workers:
                cq.on_capacity_change(worker)

    # ---- DRR ---------------------------------------------------------------------------------
    def pop_next(self, worker_ready: ClassWorkerReady, shared_ready: ClassSharedReady) -> QueueEntry | None:
        """Remove and return the DRR winner's next dispatchable entry, or None when no class has
        one. The caller admits it (or drops it) — it is no longer queued."""
        classes = self.classes
        if self.carry is not None:
            cq = classes[self.carry]
            cand = self._candidate(cq, worker_ready, shared_ready)
            if cand is not None and cand.cost <= cq.deficit:
                return self._take(cq, cand)
            self.carry = None
        n = len(classes)
        order = [(self.cursor + k) % n for k in range(n)]
        cands: dict[int, QueueEntry] = {}
        for i in order:
            cand = self._candidate(classes[i], worker_ready, shared_ready)
            if cand is not None:
                cands[i] = cand
        if not cands:
            return None
        for i, cand in cands.items():  # spend existing credit (dict keeps ring order)
            if cand.cost <= classes[i].deficit:
                return self._take(classes[i], cand)
        for i, cand in cands.items():  # one quantum per ring visit
            cq = classes[i]
            cq.deficit += cq.config.quantum
            if cand.cost <= cq.deficit:
                return self._take(cq, cand)
        rounds = min(-(-(c.cost - classes[i].deficit) // classes[i].config.quantum) for i, c in cands.items())
        for i in cands:  # minimum number of whole rounds, granted to every class with a candidate
            classes[i].deficit += rounds * classes[i].config.quantum
        for i, cand in cands.items():
            if cand.cost <= classes[i].deficit:
                return self._take(classes[i], cand)
        raise AssertionError("DRR: whole-round grant left nothing affordable")

    def _candidate(
        self, cq: PolicyClassQueue, worker_ready: ClassWorkerReady, shared_ready: ClassSharedReady
    ) -> QueueEntry | None:
        if not cq.has_ready():
            cq.deficit = 0
            return None
        idx = cq.index
        return cq.next_dispatchable(lambda w: worker_ready(idx, w), lambda e: shared_ready(idx, e))

    def _take(self, cq: PolicyClassQueue, cand: QueueEntry) -> QueueEntry:
        cq.pop(cand)
        cq.deficit -= cand.cost
        self.cursor = (cq.index + 1) % len(self.classes)
        self.carry = cq.index
        self._reset_if_empty(cq)
        return cand

    def _reset_if_empty(self, cq: PolicyClassQueue) -> None:
        if not cq.has_ready():
            cq.deficit = 0
            if self.carry == cq.index:
                self.carry = None
