"""`FleetSpec`: the simulated fleet's shape, shared by both drivers and the daemon's config.

One description yields the engines (`make_engines`), the in-process `Config` (`build_config`) and
the TOML file a replay daemon starts from (`config_toml`), so the scheduler always knows the same
capacities the engines have. Workers are `worker_id` 0..workers-1, one rank each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import Config, SelectorConfig, config_from_dict
from ..protocol import WorkerKey
from .engine import SimEngine
from .profile import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineProfile, kv_blocks_for


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """Shape of a simulated fleet.

    Attributes:
        workers: engines (worker ids 0..workers-1, dp_rank 0).
        block_size: tokens per KV block (512 for the Mooncake trace).
        kv_blocks: KV blocks per engine; None = the H100/Llama-3-8B default for this block size.
        max_num_batched_tokens: per-step token budget per engine.
        max_blocks_per_request: hashes the daemon keeps per lease (>= the trace's longest request).
        max_slots: concurrent leases in the daemon.
        profile: step-time coefficients.
    """

    workers: int = 4
    block_size: int = 512
    kv_blocks: int | None = None
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_blocks_per_request: int = 256
    max_slots: int = 4096
    profile: EngineProfile = field(default_factory=EngineProfile)

    @property
    def blocks_per_engine(self) -> int:
        return self.kv_blocks if self.kv_blocks is not None else kv_blocks_for(self.block_size)

    def worker_keys(self) -> list[WorkerKey]:
        """The fleet's worker keys, WorkerKey(w, 0) for w in 0..workers-1, in worker-id order."""
        return [WorkerKey(w, 0) for w in range(self.workers)]


def make_engines(spec: FleetSpec, max_macro_us: int = 1_000_000) -> dict[WorkerKey, SimEngine]:
    """One `SimEngine` per worker of `spec`."""
    return {
        key: SimEngine(
            spec.blocks_per_engine,
            spec.block_size,
            spec.max_num_batched_tokens,
            profile=spec.profile,
            max_macro_us=max_macro_us,
        )
        for key in spec.worker_keys()
    }


# The selector's keys that are spans of the simulated timeline (decays and lifetimes the daemon measures
# on its clock): a wall-clock replay at speedup S divides them by S so they span the same simulated time
# as in `--virtual`. Each class's `queue_timeout_s` is scaled the same way (replay_config.py). Not scaled:
# the predicted-seconds keys (`lead_max_extra_ttft_s`, `prefill_seconds_ref_us`, `prefill_us_per_token`,
# `prefill_attn_us_per_token_ktoken`) compare the cost model's predictions of simulated engine time, which
# no clock enters; and the process timers (`[daemon]` heartbeat / liveness / fold / shutdown / health,
# `kv_events_stale_after_s`), which watch the processes and sockets themselves, not the trace's timeline.
SIMULATED_TIME_SELECTOR_KEYS = ("approx_ttl_s", "recent_half_life_s", "home_half_life_s")


def scaled_selector_times(selector: SelectorConfig, time_scale: float) -> dict[str, float]:
    """{key: value / time_scale} for `SIMULATED_TIME_SELECTOR_KEYS` of `selector` (s)."""
    return {key: getattr(selector, key) / time_scale for key in SIMULATED_TIME_SELECTOR_KEYS}


def config_dict(
    spec: FleetSpec,
    selector: str = "kv",
    seed: int | None = None,
    time_scale: float = 1.0,
    kv_events: tuple[tuple[str, str | None], ...] = (),
) -> dict[str, Any]:
    """The config as a plain dict (the shape TOML parses to).

    `time_scale` (the replay's speedup) divides the simulated-time spans the daemon measures on its
    clock (`SIMULATED_TIME_SELECTOR_KEYS`: `approx_ttl_s`, `recent_half_life_s`, `home_half_life_s`),
    so they mean the same span of simulated time as in a `--virtual` run. `kv_events`: (pub,
    replay) endpoints per worker (`fleet.kv_event_endpoints`), written as `kv_events_endpoint` /
    `kv_replay_endpoint`; () = no KV events.
    """
    sel: dict[str, Any] = {"type": selector}
    if seed is not None:
        sel["seed"] = seed
    if time_scale != 1.0:
        sel.update(scaled_selector_times(SelectorConfig(), time_scale))
    workers: list[dict[str, object]] = [
        {
            "worker_id": w,
            "dp_size": 1,
            "total_kv_blocks": spec.blocks_per_engine,
            "max_num_batched_tokens": spec.max_num_batched_tokens,
        }
        for w in range(spec.workers)
    ]
    for w, (pub, replay) in zip(workers, kv_events, strict=False):  # kv_events () = no KV events
        w["kv_events_endpoint"] = pub
        if replay:
            w["kv_replay_endpoint"] = replay
    return {
        "daemon": {
            "block_size": spec.block_size,
            "max_workers": max(1, spec.workers),
            "max_slots": spec.max_slots,
            "max_blocks_per_request": spec.max_blocks_per_request,
        },
        "selector": sel,
        "workers": workers,
    }


def build_config(
    spec: FleetSpec,
    selector: str = "kv",
    seed: int | None = None,
    time_scale: float = 1.0,
    kv_events: tuple[tuple[str, str | None], ...] = (),
) -> Config:
    """A validated `Config` for `spec` (the same one `config_toml` writes for the daemon)."""
    return config_from_dict(config_dict(spec, selector, seed, time_scale, kv_events), where="replay fleet")


def config_toml(
    spec: FleetSpec,
    selector: str = "kv",
    seed: int | None = None,
    time_scale: float = 1.0,
    kv_events: tuple[tuple[str, str | None], ...] = (),
) -> str:
    """TOML text of `config_dict` (flat tables of scalars and one array of tables)."""
    raw = config_dict(spec, selector, seed, time_scale, kv_events)
    lines: list[str] = ["# written by kvsched replay: the simulated fleet's capacities", ""]
    for table in ("daemon", "selector"):
        lines.append(f"[{table}]")
        lines.extend(f"{k} = {_toml_scalar(v)}" for k, v in raw[table].items())
        lines.append("")
    for w in raw["workers"]:
        lines.append("[[workers]]")
        lines.extend(f"{k} = {_toml_scalar(v)}" for k, v in w.items())
        lines.append("")
    return "\n".join(lines)


def _toml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"unsupported TOML value {v!r}")
