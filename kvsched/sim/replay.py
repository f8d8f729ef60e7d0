"""`kvsched replay`: replay a request trace through the scheduler and a simulated fleet.

Wall-clock mode (`replay_wall.py`): a private daemon (unless `endpoint` names a running one) with the
fleet's capacities, the fleet process, and R router processes; routers replay the arrivals, schedule
through the daemon, stream from the fleet and release. Virtual mode (`virtual=True`): the same engine
model and core in process, in virtual time. Both end with the same `Summary` (`summary.json`) and the
per-request `results.jsonl` in `out_dir`. The options and the daemon config are `replay_config.py`'s
(re-exported here).
"""

from __future__ import annotations

from ..config import Config
from .classes import ClassAssignment
from .fleet_spec import FleetSpec
from .progress_bar import progress_bar
from .replay_config import (
    ReplayOptions,
    config_dict_toml,
    fleet_spec_for,
    load_profile,
    profile_class_names,
    replay_config,
    replay_config_dict,
    resolve_classes,
)
from .replay_wall import run_wall
from .summary import Summary, summarize, write_results, write_summary
from .trace import Trace, load_trace
from .virtual import run_virtual

__all__ = [
    "ReplayOptions",
    "config_dict_toml",
    "fleet_spec_for",
    "ledger_is_zero_inprocess",
    "load_profile",
    "profile_class_names",
    "replay_config",
    "replay_config_dict",
    "resolve_classes",
    "run_replay",
]


def run_replay(opts: ReplayOptions, console=None) -> Summary:
    """Run one replay (wall-clock or virtual), write `summary.json` + `results.jsonl`, return the summary."""
    trace = load_trace(opts.trace, opts.limit)
    if opts.block_size is not None:
        trace.block_size = opts.block_size
    if len(trace) == 0:
        raise ValueError(f"{opts.trace}: no requests")
    spec = fleet_spec_for(opts, trace)
    profile = load_profile(opts.profile) if opts.profile is not None else None
    classes = resolve_classes(opts, trace, profile)
    opts.out.mkdir(parents=True, exist_ok=True)
    if opts.virtual:
        results, wall_s, ledger_zero = _run_virtual(opts, trace, spec, console, profile, classes)
        routers = 0
    else:
        results, wall_s, ledger_zero = run_wall(opts, trace, spec, console, profile, classes)
        routers = opts.routers
    write_results(sorted(results, key=lambda r: r.index), opts.out / "results.jsonl")
    summary = summarize(
        results,
        mode="virtual" if opts.virtual else "wall",
        trace=str(opts.trace),
        workers=spec.workers,
        routers=routers,
        selector="dynamo" if opts.router_via == "dynamo" and not opts.virtual else opts.selector,
        speedup=1.0 if opts.virtual else opts.speedup,
        load_scale=opts.load_scale,
        wall_time_s=wall_s,
        infinite_cache_hit_tokens=trace.infinite_cache_hit_tokens(),
        fleet_lru_hit_tokens=trace.fleet_lru_hit_tokens(spec.workers * spec.blocks_per_engine),
        ledger_zero=ledger_zero,
        notes=opts.notes,
        profile=str(opts.profile) if opts.profile is not None else None,
        class_rule=opts.class_rule,
        class_order=profile_class_names(profile),
    )
    write_summary(summary, opts.out)
    return summary


def _run_virtual(
    opts: ReplayOptions, trace: Trace, spec: FleetSpec, console, profile: Config | None, classes: ClassAssignment
):

    config = replay_config(spec, opts, profile) if profile is not None else None
    with progress_bar(console, len(trace), "virtual replay") as advance:
        run = run_virtual(
            trace,
            spec,
            selector=opts.selector,
            load_scale=opts.load_scale,
            seed=opts.seed,
            config=config,
            progress=advance,
            classes=classes,
            overlap_mode=opts.overlap_mode or ("events" if opts.kv_events else "approx"),
        )
    return run.results, run.wall_time_s, ledger_is_zero_inprocess(run.scheduler)


def ledger_is_zero_inprocess(scheduler) -> bool | None:
    """True when every worker row of an in-process scheduler's ledger is back to zero load."""
    arrays = getattr(getattr(scheduler, "ledger", None), "arrays", None)
    if arrays is None:
        return None
    names = [n for n in ("w_active_blocks", "w_active_prefill", "w_active_requests") if hasattr(arrays, n)]
    if not names:
        return None
    return all(int(abs(getattr(arrays, n)).sum()) == 0 for n in names)
