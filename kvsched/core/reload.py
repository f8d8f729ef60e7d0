"""Live reload of the scheduling profile (docs/DESIGN.md §4.16): quanta, limits, thresholds, timeouts,
admission options and new classes apply at once; removing or renaming a class that holds requests,
or swapping an admission policy that tracks requests, is refused and the old profile kept.

A plain function over the scheduler's parts; pure and synchronous like the rest of the core.
"""

from __future__ import annotations

from ..config import ClassConfig, Config
from .admission import create_admission_policy
from .class_queue import PolicyClassQueue
from .leases import DEFERRED, READY
from .policy_queue import PolicyQueue


def reload_profile(sched, config: Config) -> None:  # noqa: ANN001 - a Scheduler
    """Apply a new scheduling profile to `sched` (docs/DESIGN.md §4.16 reload rules). Raises
    ValueError (old profile kept) when a class holding requests would be removed/renamed, or an
    admission policy that tracks requests would be replaced by another type."""
    old = {cq.name: cq for cq in sched.pq.classes}
    new_names = {c.name for c in config.classes}
    leased = {lv.entry.class_idx for lv in sched.lease_table.by_slot.values()}
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
    _apply(sched, config, old)


def _apply(sched, config: Config, old: dict[str, PolicyClassQueue]) -> None:  # noqa: ANN001
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
    live_map = sched.lease_table.live
    for live in live_map.values():
        live.entry.class_idx = remap.get(live.entry.class_idx, live.entry.class_idx)
    sched.feed.remap(remap)
    sched.admitter.pq = PolicyQueue(queues)
    sched.config = config
    sched.admitter.selector_cfg = config.selector
    sched.set_classes(config)
    sched.view.configure(config.selector)
    sched.intake.rearm_all()
    sched.shares.rebuild(live for live in live_map.values() if live.state in (READY, DEFERRED))


def _reorder(cq: PolicyClassQueue, c: ClassConfig, index: int) -> PolicyClassQueue:
    """A copy of `cq` whose containers use the new ordering (entries re-keyed)."""
    fresh = PolicyClassQueue(c, index, cq.admission)
    for entry in list(cq.iter_ready()):
        fresh.add(entry)
    for entry in cq.deferred.values():
        fresh.defer(entry)
    fresh.deficit = cq.deficit
    return fresh
