"""Live reload of the scheduling profile (docs/DESIGN.md §4.16): quanta, limits, thresholds, timeouts,
admission options and new classes apply at once; removing or renaming a class that holds requests,
or swapping an admission policy that tracks requests, is refused and the old profile kept.

The `[selector]` table: `prefill_load_scale`, `overlap_credit`, `approx_ttl_s` and
`offload_overlap_credit` are read per decision and apply at once. A change to any other selector key
(`type`, `seed`, `temperature`, the `kv` weights) rebuilds the selector from the new table; a rebuilt
selector of the same type keeps what it learnt (`WorkerSelector.learnt`: the `kv` selector's decayed
recent work and home counts, round robin's cursor, the cache_aware baseline's cache sizes), one of another type
starts empty; the RNG restarts from `seed`, and the `kv` predicted-seconds model (when on) restarts
with no bookings. `reload_profile` returns the changed keys so the reply and the log name them.

A plain function over the scheduler's parts; pure and synchronous like the rest of the core.
"""

from __future__ import annotations

from typing import Collection

from ..config import ClassConfig, Config, SelectorConfig
from .admission import create_admission_policy
from .class_queue import PolicyClassQueue
from .leases import DEFERRED, READY
from .policy_queue import PolicyQueue
from .selector import create_selector


# `[selector]` keys a reload applies (read per decision by the admitter and the overlap view)
RELOADABLE_SELECTOR_KEYS = frozenset({"prefill_load_scale", "overlap_credit", "approx_ttl_s",
                                      "offload_overlap_credit"})


def selector_keys_needing_rebuild(old: SelectorConfig, new: SelectorConfig) -> list[str]:
    """`selector.<key>` for every key whose value differs between `old` and `new` and that the built
    selector holds (not in `RELOADABLE_SELECTOR_KEYS`), in declaration order."""
    return [f"selector.{k}" for k in SelectorConfig.__struct_fields__
            if k not in RELOADABLE_SELECTOR_KEYS and getattr(old, k) != getattr(new, k)]


# Config sections a reload does not apply: they shape the daemon's segments, sockets and fleet at start
RESTART_ONLY_SECTIONS = ("daemon", "overload")


def restart_only_changes(running: Config, new: Config, given: Collection[str] | None = None) -> list[str]:
    """What differs between the `running` config and `new` that a reload does not apply: `daemon.<key>`
    and `overload.<key>` per changed key, and `workers (added …, removed …, changed …)` by worker_id
    (`[[workers]]` change at a restart, or at runtime with `kvsched add-worker` / `remove-worker`).

    Args:
        given: the keys the reloaded sources set (`load_config_keys`: `daemon.<key>`, `workers`, ...),
            or None to compare every key. With it, a key the reloaded file leaves at its default is not
            named: a profile-only file (only `default_class` / `[[classes]]`) names nothing, and a daemon
            whose workers came from `--workers N` is not told its workers were "removed".
    """
    def compared(key: str) -> bool:
        return given is None or key in given

    out = [f"{section}.{k}" for section in RESTART_ONLY_SECTIONS
           for k in type(getattr(running, section)).__struct_fields__
           if compared(f"{section}.{k}") and getattr(getattr(running, section), k) != getattr(getattr(new, section), k)]
    if not compared("workers"):
        return out
    old_w, new_w = {w.worker_id: w for w in running.workers}, {w.worker_id: w for w in new.workers}
    parts = [f"{what} {', '.join(map(str, ids))}" for what, ids in (
        ("added", sorted(new_w.keys() - old_w.keys())), ("removed", sorted(old_w.keys() - new_w.keys())),
        ("changed", sorted(i for i in old_w.keys() & new_w.keys() if old_w[i] != new_w[i]))) if ids]
    if parts:
        out.append(f"workers ({'; '.join(parts)})")
    return out


def reload_profile(sched, config: Config) -> list[str]:  # noqa: ANN001 - a Scheduler
    """Apply a new scheduling profile to `sched` (docs/DESIGN.md §4.16 reload rules).

    Returns:
        `selector_keys_needing_rebuild(old, new)`: the changed `[selector]` keys for which the selector
        was rebuilt (module docstring; the caller reports them). [] = the selector was kept.
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
    rebuilt = selector_keys_needing_rebuild(sched.selector_config, config.selector)
    selector = create_selector(config.selector) if rebuilt else None  # may raise: nothing changed yet
    _apply(sched, config, old)
    if selector is not None:
        _swap_selector(sched, selector, config.selector)
    return rebuilt


def _swap_selector(sched, selector, cfg: SelectorConfig) -> None:  # noqa: ANN001 - a Scheduler, a WorkerSelector
    """Install a rebuilt selector: carry the learnt state of one of the same type, then let the admitter
    re-derive what it derives from a selector (fused kernel path, its kernel parameters)."""
    old = sched.selector
    if type(old) is type(selector):
        for name in selector.learnt:
            setattr(selector, name, getattr(old, name))
    sched.selector = selector
    sched.selector_config = cfg
    sched.admitter.use_selector(selector)


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
