"""Live reload of the scheduling profile (docs/DESIGN.md §4.16): quanta, limits, thresholds, timeouts,
admission options and new classes apply at once; removing or renaming a class that holds requests,
or swapping an admission policy that tracks requests, is refused and the old profile kept.

Mixed into `Scheduler`; pure and synchronous like the rest of the core.
"""

from __future__ import annotations

from ..config import ClassConfig, Config
from .admission import create_admission_policy
from .class_queue import PolicyClassQueue
from .dispatch import DEFERRED, READY
from .policy_queue import PolicyQueue


class ProfileReload:
    """`reload(config)` for the Scheduler."""

    def reload(self, config: Config) -> None:
        """Apply a new scheduling profile (docs/DESIGN.md §4.16 reload rules). Raises ValueError (old profile
        kept) when a class holding requests would be removed/renamed, or an admission policy that
        tracks requests would be replaced by another type."""
        old = {cq.name: cq for cq in self.pq.classes}
        new_names = {c.name for c in config.classes}
        leased = {lv.entry.class_idx for lv in self._by_slot.values()}
        for name, cq in old.items():
            if name not in new_names and (cq.n_waiting or cq.index in leased):
                raise ValueError(f"reload refused: class {name!r} holds requests and is not in the new profile")
        for c in config.classes:
            cq = old.get(c.name)
            if cq is None or cq.admission is None:
                continue
            same = c.admission is not None and c.admission.type == cq.config.admission.type
            if not same and cq.admission.tracked():
                raise ValueError(f"reload refused: class {c.name!r} admission policy tracks requests")
        self._apply_reload(config, old)

    def _apply_reload(self, config: Config, old: dict[str, PolicyClassQueue]) -> None:
        remap: dict[int, int] = {}
        queues = []
        for i, c in enumerate(config.classes):
            cq = old.get(c.name)
            if cq is None:
                cq = PolicyClassQueue(c, i, create_admission_policy(c.admission))
            else:
                remap[cq.index] = i
                if c.admission is None:
                    cq.admission = None
                elif cq.admission is not None and cq.config.admission.type == c.admission.type:
                    cq.admission.reconfigure(c.admission)
                else:
                    cq.admission = create_admission_policy(c.admission)
                if c.ordering != cq.config.ordering:
                    cq = _reorder(cq, c, i)
                cq.index = i
                cq.config = c
                cq.unblock_all()
            queues.append(cq)
        for live in self._live.values():
            live.entry.class_idx = remap.get(live.entry.class_idx, live.entry.class_idx)
        self._events = [(remap[c], e) for c, e in self._events if c in remap]
        self.pq = PolicyQueue(queues)
        self.config = config
        self._class_index = {c.name: i for i, c in enumerate(config.classes)}
        self._default = self._class_index[config.default_class]
        self._set_ttls()
        self._timeouts = []
        for live in self._live.values():
            if live.state in (READY, DEFERRED):
                self._arm_timeout(live, live.entry.arrival_us, live.spec.deadline_us)
        self._shares.rebuild(live for live in self._live.values() if live.state in (READY, DEFERRED))
        self._dirty = True


def _reorder(cq: PolicyClassQueue, c: ClassConfig, index: int) -> PolicyClassQueue:
    """A copy of `cq` whose containers use the new ordering (entries re-keyed)."""
    fresh = PolicyClassQueue(c, index, cq.admission)
    for entry in list(cq.iter_ready()):
        fresh.add(entry)
    for entry in cq.deferred.values():
        fresh.defer(entry)
    fresh.deficit = cq.deficit
    return fresh
