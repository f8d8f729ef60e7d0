"""What a live reload of the scheduling profile applies (docs/DESIGN.md §4.16): quanta, limits, thresholds,
timeouts, admission options and new classes apply at once (`Scheduler.reload`); removing or renaming a
class that holds requests, or swapping an admission policy that tracks requests, is refused and the old
profile kept (`PolicyQueue.check_profile`).

The `[selector]` table: `prefill_load_scale`, `overlap_credit`, `approx_ttl_s` and
`offload_overlap_credit` are read per decision and apply at once. A change to any other selector key
(`type`, `seed`, `temperature`, the `kv` weights) rebuilds the selector from the new table; a rebuilt
selector of the same type keeps what it learnt (`WorkerSelector.carry_learnt`: the `kv` selector's
decayed recent work and home counts, round robin's cursor, the cache_aware baseline's cache sizes), one
of another type starts empty; the RNG restarts from `seed`, and the `kv` predicted-seconds model (when
on) restarts with no bookings. `Scheduler.reload` returns the changed keys so the reply and the log
name them. The `daemon` and `overload` sections and the worker list change only at a restart
(`restart_only_changes` names what a reload left unapplied).

Pure functions over two configs.
"""

from __future__ import annotations

from collections.abc import Collection

from ..config import Config, SelectorConfig

# `[selector]` keys a reload applies (read per decision by the admitter and the overlap view)
RELOADABLE_SELECTOR_KEYS = frozenset({"prefill_load_scale", "overlap_credit", "approx_ttl_s", "offload_overlap_credit"})


def selector_keys_needing_rebuild(old: SelectorConfig, new: SelectorConfig) -> list[str]:
    """`selector.<key>` for every key whose value differs between `old` and `new` and that the built
    selector holds (not in `RELOADABLE_SELECTOR_KEYS`), in declaration order."""
    return [
        f"selector.{k}"
        for k in SelectorConfig.__struct_fields__
        if k not in RELOADABLE_SELECTOR_KEYS and getattr(old, k) != getattr(new, k)
    ]


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

    out = [
        f"{section}.{k}"
        for section in RESTART_ONLY_SECTIONS
        for k in type(getattr(running, section)).__struct_fields__
        if compared(f"{section}.{k}") and getattr(getattr(running, section), k) != getattr(getattr(new, section), k)
    ]
    if not compared("workers"):
        return out
    old_w, new_w = {w.worker_id: w for w in running.workers}, {w.worker_id: w for w in new.workers}
    parts = [
        f"{what} {', '.join(map(str, ids))}"
        for what, ids in (
            ("added", sorted(new_w.keys() - old_w.keys())),
            ("removed", sorted(old_w.keys() - new_w.keys())),
            ("changed", sorted(i for i in old_w.keys() & new_w.keys() if old_w[i] != new_w[i])),
        )
        if ids
    ]
    if parts:
        out.append(f"workers ({'; '.join(parts)})")
    return out
