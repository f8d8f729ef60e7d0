"""Live reload of the scheduling profile (docs/DESIGN.md §4.16): quanta, limits, thresholds, timeouts,
admission options and new classes apply at once; removing or renaming a class that holds requests,
or swapping an admission policy that tracks requests, is refused and the old profile kept.

The `[selector]` table: `prefill_load_scale`, `overlap_credit`, `approx_ttl_s` and
`offload_overlap_credit` apply at once (they are read per decision); every other selector key (`type`,
`seed`, the `kv` weights) is fixed when the selector is built at start. A reload that changes one of
those keeps the running selector and its learnt state, and `reload_profile` returns the keys so the
admin reply and the daemon log name them ("takes effect at restart").

A plain function over the scheduler's parts; pure and synchronous like the rest of the core.
"""

from __future__ import annotations

from ..config import ClassConfig, Config, SelectorConfig
from .admission import create_admission_policy
from .class_queue import PolicyClassQueue
from .leases import DEFERRED, READY
from .policy_queue import PolicyQueue


# `[selector]` keys a reload applies (read per decision by the admitter and the overlap view)
RELOADABLE_SELECTOR_KEYS = frozenset({"prefill_load_scale", "overlap_credit", "approx_ttl_s",
                                      "offload_overlap_credit"})


def selector_keys_needing_restart(old: SelectorConfig, new: SelectorConfig) -> list[str]:
    """`selector.<key>` for every key whose value differs between `old` and `new` and that a reload
    does not apply (not in `RELOADABLE_SELECTOR_KEYS`), in declaration order."""
    return [f"selector.{k}" for k in SelectorConfig.__struct_fields__
            if k not in RELOADABLE_SELECTOR_KEYS and getattr(old, k) != getattr(new, k)]


def reload_profile(sched, config: Config) -> list[str]:  # noqa: ANN001 - a Scheduler
    """Apply a new scheduling profile to `sched` (docs/DESIGN.md §4.16 reload rules).

    Returns:
        `selector_keys_needing_restart(old, new)`: changed `[selector]` keys that did NOT take effect
        (the running selector is kept; the caller warns). [] = everything applied.
    Raises:
        ValueError (old profile kept): a class holding requests would be removed/renamed, or an
        admission policy that tracks requests would be replaced by another type.
    """
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
    not_applied = selector_keys_needing_restart(sched.selector_config, config.selector)
    _apply(sched, config, old)
    return not_applied


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
