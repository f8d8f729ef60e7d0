"""What a `kvsched replay` runs with: its options (`ReplayOptions`), the simulated fleet's shape for
a trace, each trace row's policy class under the `--class-rule`, and the daemon config — the fleet's
capacities with a `--profile`'s classes, selector and overload merged in — as a `Config` (virtual
mode) or as TOML text (the private daemon of a wall-clock replay). No processes, no I/O but reading
the profile and the trace's class column.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from ..config import Config, config_from_dict, load_config
from .classes import ClassAssignment, assign_classes, check_class_names, parse_class_rule, read_class_column
from .fleet_spec import FleetSpec, config_dict, scaled_selector_times
from .trace import Trace


@dataclass(slots=True)
class ReplayOptions:
    """Everything `kvsched replay` takes (see `replay_cli.replay` for the meaning of each)."""

    trace: Path
    routers: int = 4
    workers: int = 4
    speedup: float = 1.0
    load_scale: float = 1.0
    limit: int | None = None
    virtual: bool = False
    endpoint: str | None = None
    admin_endpoint: str | None = None
    out: Path = Path("out/replay")
    block_size: int | None = None
    kv_blocks: int | None = None
    max_num_batched_tokens: int = 8192
    selector: str = "kv"
    seed: int | None = 0
    keep_runtime_dir: bool = False
    notes: list[str] = field(default_factory=list)
    profile: Path | None = None  # TOML with default_class + [[classes]] (+ [selector], [overload])
    class_rule: str = "none"  # see classes.py / --class-rule
    kv_events: bool = True  # engines publish KV events to the daemon (virtual: overlap_mode "events")
    kv_encoding: str = "array"  # "array" | "map" (vLLM event encodings)
    kv_transport: str = "ipc"  # KV-event sockets: "ipc" (runtime dir) | "tcp" (loopback)
    overlap_mode: str | None = None  # virtual only: "events" | "approx" | "none"; None = from kv_events
    router_via: str = "daemon"  # wall only: "daemon" | "dynamo" (NVIDIA Dynamo's selection service routes)
    overlap_sample_every: int = 0  # wall, daemon routing: compare the daemon's and Dynamo's overlap every N-th row
    # wall, private daemon: wait this long for it to be ready (its first start compiles the kernels: ~1 min on
    # a busy 2-core machine; the same 300 s as the k8s startupProbe / systemd TimeoutStartSec in docs/DEPLOY.md)
    daemon_ready_timeout_s: float = 300.0


def fleet_spec_for(opts: ReplayOptions, trace: Trace) -> FleetSpec:
    """The fleet shape for this trace: block size (512 for Mooncake) and room for its longest request."""
    block_size = opts.block_size or trace.block_size
    longest = int((trace.hash_offsets[1:] - trace.hash_offsets[:-1]).max()) if len(trace) else 0
    longest = max(longest, int(-(-int(trace.isl.max()) // block_size)) if len(trace) else 0)
    return FleetSpec(
        workers=opts.workers,
        block_size=block_size,
        kv_blocks=opts.kv_blocks,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        max_blocks_per_request=max(256, longest),
    )


def load_profile(path: Path) -> Config:
    """A scheduling profile (any kvsched config file; `include` honoured). Raises ConfigError."""
    return load_config(path)


def profile_class_names(profile: Config | None) -> list[str]:
    """The profile's class names in order (no profile: the default config's single class)."""
    return [c.name for c in (profile or Config()).classes]


def resolve_classes(opts: ReplayOptions, trace: Trace, profile: Config | None) -> ClassAssignment:
    """Every trace row's policy class under `opts.class_rule`.

    Raises:
        ClassRuleError: the rule does not parse, or names (or a trace column holds) a class the
            profile does not define; the message lists the profile's classes.
    """
    known = profile_class_names(profile)
    rule = parse_class_rule(opts.class_rule, known)
    column = read_class_column(opts.trace, rule.column, opts.limit) if rule.kind == "column" else None
    default = (profile or Config()).default_class
    assignment = assign_classes(rule, trace.isl, default, column)
    check_class_names(assignment.names, known)
    return assignment


def replay_config_dict(
    spec: FleetSpec, opts: ReplayOptions, profile: Config | None, time_scale: float = 1.0, kv_events: tuple = ()
) -> dict[str, Any]:
    """The replay's config with the profile merged in (the shape TOML parses to).

    The replay's own `[daemon]` and `[[workers]]` always win (block size, capacities, endpoints come
    from the simulated fleet; the profile's are ignored). From the profile: `default_class`,
    `[[classes]]`, `[overload]` and `[selector]` except `type` (from --selector) and `seed` (from
    --seed unless that is None). The simulated-time spans the daemon measures on its clock (the
    selector's `approx_ttl_s`, `recent_half_life_s`, `home_half_life_s` — `fleet_spec.SIMULATED_TIME_SELECTOR_KEYS`,
    which also says what is not scaled and why — and each class's `queue_timeout_s`) are divided by
    `time_scale` (the speedup) so they keep their simulated length.
    """
    raw = config_dict(spec, opts.selector, opts.seed, time_scale, kv_events)
    if profile is None:
        return raw
    sel = _set_fields(profile.selector)
    sel.pop("type", None)
    if opts.seed is not None:
        sel.pop("seed", None)
    sel.update(scaled_selector_times(profile.selector, time_scale))
    raw["selector"].update(sel)
    overload = _set_fields(profile.overload)
    if overload:
        raw["overload"] = overload
    raw["default_class"] = profile.default_class
    raw["classes"] = []
    for c in profile.classes:
        d = _set_fields(c)
        if c.queue_timeout_s is not None:
            d["queue_timeout_s"] = c.queue_timeout_s / time_scale
        raw["classes"].append(d)
    return raw


def _set_fields(struct: msgspec.Struct) -> dict[str, Any]:
    """A struct as a dict without its None fields (TOML has no null), nested structs as dicts."""
    return {k: v for k, v in msgspec.to_builtins(struct).items() if v is not None}


def replay_config(spec: FleetSpec, opts: ReplayOptions, profile: Config | None, time_scale: float = 1.0) -> Config:
    """`replay_config_dict` validated into a `Config` (the virtual driver's)."""
    return config_from_dict(replay_config_dict(spec, opts, profile, time_scale), where="replay config")


def config_dict_toml(raw: dict[str, Any]) -> str:
    """TOML text of a config dict: top-level scalars, tables of scalars, arrays of tables (whose
    values are scalars or one level of sub-tables, e.g. `[classes.admission]`)."""
    lines = ["# written by kvsched replay: the simulated fleet's capacities + the --profile classes", ""]
    lines += [f"{k} = {_toml_value(v)}" for k, v in raw.items() if not isinstance(v, (dict, list))]
    for key, value in raw.items():
        if isinstance(value, dict):
            lines += ["", f"[{key}]", *(f"{k} = {_toml_value(v)}" for k, v in value.items())]
        elif isinstance(value, list):
            for item in value:
                lines += ["", f"[[{key}]]"]
                lines += [f"{k} = {_toml_value(v)}" for k, v in item.items() if not isinstance(v, dict)]
                for sub, table in ((k, v) for k, v in item.items() if isinstance(v, dict)):
                    lines += [f"[{key}.{sub}]", *(f"{k} = {_toml_value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"cannot write {v!r} to the replay's TOML")
        return repr(v)
    if isinstance(v, str):
        return msgspec.json.encode(v).decode()  # a JSON string is a valid TOML basic string
    raise TypeError(f"unsupported TOML value {v!r}")
