"""The configuration tree: one TOML file, env `KVSCHED_<SECTION>_<KEY>` and a few flags on top.

`load_config(path, env, overrides)` is the only loader (defaults < file < env < flags). Every table is a
`Section` (unknown keys are errors naming their path). `examples/kvsched.toml` is kept equal to the
defaults (a test checks it). Endpoint discovery (`data_endpoint`, `admin_endpoint`, docs/DESIGN.md §1.2)
lives in `kvsched.endpoints`.
"""

from __future__ import annotations

import math
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

import msgspec
from msgspec import Meta

from .endpoints import daemon_endpoints, endpoint_problem, is_loopback_endpoint
from .errors import ConfigError
from .protocol import BatchedTokens, KvBlocks


# An RNG seed: numpy.random.default_rng accepts any non-negative integer; kvsched takes 0..2**63-1 (TOML integers
# are 64-bit signed, and msgspec bounds must fit in int64).
Seed = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
# A token count compared with int64 ledger arrays and packed into float64 kernel parameters: at most
# 2**53 (exact in float64, far inside int64).
TokenCount = Annotated[int, Meta(ge=0, le=1 << 53)]


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of every TOML table: an unknown key is an error, not a silent default."""


class AdmissionConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """`admission = {type = "session_cap", ...}`: the policy name plus its options (checked by the
    policy's factory in `kvsched.core.admission`)."""

    type: Literal["session_cap", "kv_pressure"]
    max_active_per_session: Annotated[int, Meta(ge=1)] = 1  # session_cap: K
    high_water_frac: Annotated[float, Meta(gt=0, le=1)] = 0.9  # kv_pressure: defer above this
    low_water_frac: Annotated[float, Meta(gt=0, le=1)] = 0.7  # kv_pressure: resume below this

    def __post_init__(self) -> None:
        if self.type == "kv_pressure" and self.low_water_frac > self.high_water_frac:
            raise ValueError(f"admission low_water_frac ({self.low_water_frac}) must not exceed "
                             f"high_water_frac ({self.high_water_frac})")


class ClassConfig(Section):
    """One policy class (docs/DESIGN.md §4.1)."""

    name: Annotated[str, Meta(min_length=1, max_length=64)]
    quantum: Annotated[int, Meta(gt=0, le=1 << 53)] = 1024  # DRR weight, uncached prompt tokens per turn
    ordering: Literal["fcfs", "priority", "wspt"] = "fcfs"
    prefill_busy_threshold: TokenCount | None = None  # tokens; busy above this
    prefill_busy_threshold_frac: Annotated[float, Meta(gt=0)] | None = None  # of max_num_batched_tokens
    busy_worker_ratio: Annotated[float, Meta(gt=0, le=1)] = 1.0  # queue when this share is busy
    request_queue_limit_per_worker: Annotated[int, Meta(ge=0, le=1 << 53)] | None = None  # requests
    isl_token_queue_limit_per_worker: TokenCount | None = None  # tokens
    queue_timeout_s: Annotated[float, Meta(gt=0)] | None = None  # seconds
    admission: AdmissionConfig | None = None


def _default_classes() -> list[ClassConfig]:
    return [ClassConfig(name="default", prefill_busy_threshold_frac=1.0)]


class WorkerConfig(Section):
    """One engine instance with `dp_size` data-parallel ranks (ranks 0..dp_size-1)."""

    worker_id: Annotated[int, Meta(ge=0, le=0xFFFF_FFFF)]
    dp_size: Annotated[int, Meta(ge=1, le=1024)] = 1
    total_kv_blocks: KvBlocks = 8192  # KV blocks per rank, 1..2**40 (protocol.MAX_KV_BLOCKS)
    max_num_batched_tokens: BatchedTokens = 8192  # per-step token budget per rank, 1..2**31-1
    kv_events_endpoint: str | None = None  # e.g. tcp://10.0.0.5:5557 (port + dp_rank per rank)
    kv_replay_endpoint: str | None = None  # e.g. tcp://10.0.0.5:5558 (port + dp_rank per rank)
    kv_events_topic: str = ""  # SUB topic filter ("" = all)
    # KV-event stream silent or disconnected longer than this (s) -> worker marked stale (approximate index)
    kv_events_stale_after_s: Annotated[float, Meta(gt=0)] = 30.0
    # base URL of the engine's OpenAI-compatible server (e.g. http://10.0.0.5:8000), sent to routers in
    # `Admitted.url` (the gateway forwards there); "" = routers know the address themselves
    url: str = ""

    def __post_init__(self) -> None:
        for key in ("kv_events_endpoint", "kv_replay_endpoint"):
            value = getattr(self, key)
            problem = endpoint_problem(value) if value is not None else None
            if problem:
                raise ValueError(f"workers[worker_id={self.worker_id}].{key} {value!r}: {problem}")
        problem = url_problem(self.url) if self.url else None
        if problem:
            raise ValueError(f"workers[worker_id={self.worker_id}].url {self.url!r}: {problem}")


class SelectorConfig(Section):
    """Worker selection (docs/ROUTING.md: every selector, every term's source and measured effect)."""

    type: Literal["kv", "dynamo_cost", "round_robin", "random", "least_loaded", "power_of_two", "cache_aware",
                  "lmetric", "llmd", "llmd_sticky"] = "kv"
    # kv: cost in blocks = prefill_weight x projected uncached prefill blocks + active_blocks_weight x projected
    # active blocks - lead_bonus x min(exclusive overlap lead, lead_cap_blocks) + recent_weight x decayed recent blocks
    # + interference + home (both below; full formula in docs/ROUTING.md)
    prefill_weight: Annotated[float, Meta(ge=0)] = 16.0  # per block of projected uncached prefill
    active_blocks_weight: Annotated[float, Meta(ge=0)] = 0.1  # per projected active KV block
    lead_bonus: Annotated[float, Meta(ge=0)] = 400.0  # per block of exclusive overlap lead
    lead_cap_blocks: Annotated[float, Meta(ge=0)] = 64.0  # lead credited at most this many blocks
    # the lead bonus buys at most max(this many x max_num_batched_tokens, lead_max_wait_per_lead x the lead's
    # tokens) of extra queued prefill over another worker (0 = no cap)
    lead_max_wait_steps: Annotated[float, Meta(ge=0)] = 10.0
    lead_max_wait_per_lead: Annotated[float, Meta(ge=0)] = 3.0
    # no lead bonus while the leader's queued prefill exceeds this many x its max_num_batched_tokens
    lead_release_steps: Annotated[float, Meta(ge=0)] = 16.0
    # ... or while its decayed recent work exceeds this many x the other eligible workers' mean (0 = never)
    lead_release_recent_ratio: Annotated[float, Meta(ge=0)] = 2.0
    # ... or while its active requests exceed this many x the other eligible workers' mean (0 = never)
    lead_release_requests_ratio: Annotated[float, Meta(ge=0)] = 2.0
    recent_weight: Annotated[float, Meta(ge=0)] = 1.0  # per block of recently admitted uncached prompt
    recent_half_life_s: Annotated[float, Meta(gt=0)] = 30.0  # decay of recently admitted work (s)
    # per block of the request's own uncached prefill x active requests on the worker (LMetric's product; 0 = off)
    interference_weight: Annotated[float, Meta(ge=0)] = 1.0
    # the interference term may raise a worker's cost at most this many x the request's own full-prompt
    # prefill cost above the eligible worker with the least interference (0 = no cap)
    interference_cap_prompts: Annotated[float, Meta(ge=0)] = 0.1
    # predicted seconds (docs/ROUTING.md; both 0 = off): the lead wins while the predicted TTFT on its worker
    # is within this many s of the best other worker's ...
    lead_max_extra_ttft_s: Annotated[float, Meta(ge=0)] = 0.0
    # ... and/or the prefill term is the predicted TTFT in µs / this reference µs per token
    prefill_seconds_ref_us: Annotated[float, Meta(ge=0)] = 0.0
    prefill_us_per_token: Annotated[float, Meta(gt=0)] = 30.0  # prefill cost model: µs per token ...
    prefill_attn_us_per_token_ktoken: Annotated[float, Meta(ge=0)] = 1.33  # ... + this per 1,000 tokens of context
    # home (docs/ROUTING.md; 0 = off, and the fused admission kernel decides): a worker's share of recent cache-reusing admissions (decayed count of
    # admissions with at least home_min_cached_share of their prompt cached, relative to the eligible mean,
    # measured from the least) x the request's own uncached prefill blocks x prefill_weight x this weight, for
    # requests whose own uncached prefill there is at least home_min_prefill_tokens
    home_weight: Annotated[float, Meta(ge=0)] = 0.08
    home_half_life_s: Annotated[float, Meta(gt=0)] = 30.0
    home_min_cached_share: Annotated[float, Meta(ge=0, le=1)] = 0.5
    home_min_prefill_tokens: TokenCount = 16384
    # dynamo_cost (NVIDIA Dynamo's kv-router cost, its defaults)
    prefill_load_scale: Annotated[float, Meta(ge=0)] = 1.0  # weight of the prefill term
    overlap_credit: Annotated[float, Meta(ge=0)] = 1.0  # blocks of credit per overlapping block
    temperature: Annotated[float, Meta(ge=0)] = 0.0  # kv, dynamo_cost: 0 = argmin with random tie-break
    approx_ttl_s: Annotated[float, Meta(gt=0)] = 120.0  # approximate index entry lifetime (s)
    # credit of a block held only in an offload tier (CPU/disk KV events), as a fraction of a device block's
    offload_overlap_credit: Annotated[float, Meta(ge=0, le=1)] = 0.5
    seed: Seed | None = None  # RNG seed (0..2**63-1) for tie-breaks / softmax (None = random)


class OverloadConfig(Section):
    """Per-worker overload thresholds (docs/DESIGN.md §4.2): an overloaded worker is not eligible."""

    overload_active_blocks_frac: Annotated[float, Meta(gt=0)] | None = None  # of total_kv_blocks
    overload_prefill_tokens: TokenCount | None = None  # active prefill tokens


class DaemonConfig(Section):
    """Process, sockets and capacities of `kvsched-daemon`."""

    instance: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] = "default"
    endpoint: str = ""  # data socket; "" = discovery (docs/DESIGN.md §1.2); set, it wins over KVSCHED_ENDPOINT
    admin_endpoint: str = ""  # admin socket; "" = discovery; set, it wins over KVSCHED_ADMIN_ENDPOINT
    curve_secret_key_file: str | None = None  # z85 server secret key; required for a non-loopback TCP endpoint
    curve_authorized_keys_dir: str | None = None  # client public keys allowed (pyzmq certs); None = any client holding the server key
    block_size: Annotated[int, Meta(ge=1, le=1 << 20)] = 16  # tokens per KV block
    max_workers: Annotated[int, Meta(ge=1, le=4096)] = 64  # worker rows in the ledger
    max_slots: Annotated[int, Meta(ge=1, le=1 << 22)] = 8192  # concurrent leases
    max_blocks_per_request: Annotated[int, Meta(ge=1, le=1 << 20)] = 1024  # hashes kept per lease
    heartbeat_ms: Annotated[int, Meta(ge=10)] = 1000  # client heartbeat period when idle
    liveness_timeout_ms: Annotated[int, Meta(ge=50)] = 5000  # silent connection = dead
    frame_budget_per_wake: Annotated[int, Meta(ge=1)] = 512  # frames read per reader wake
    inflight_cap_per_connection: Annotated[int, Meta(ge=1)] = 4096  # outstanding Enqueues
    max_frame_bytes: Annotated[int, Meta(ge=1024)] = 1 << 20  # ZMQ_MAXMSGSIZE
    progress_fold_ms: Annotated[int, Meta(ge=1, le=1000)] = 10  # fold progress words at least this often
    fold_interval_ms: Annotated[int, Meta(ge=1, le=1000)] = 1  # while requests wait: fold words at least this often
    # SIGTERM: releases / progress of live leases are still served for up to this long (s)
    shutdown_timeout_s: Annotated[float, Meta(ge=0, le=3600)] = 5.0
    # one connection may hold at most this share of each queue limit of a class (1.0 = no cap)
    max_waiting_share: Annotated[float, Meta(gt=0, le=1)] = 0.5
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] = 0  # Prometheus HTTP; 0 = off
    metrics_host: str = "127.0.0.1"  # also serves /healthz and /readyz (docs/DEPLOY.md)
    health_stall_ms: Annotated[int, Meta(ge=1)] = 5000  # /healthz fails when the actor's tick is older (ms)
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # recompute the hashes of first-of-chain BlockStored events; warn, count and flag engines whose
    # hashes differ from block_hashes(mode="vllm", hash_seed=kv_hash_seed) (docs/VLLM.md)
    kv_hash_check: bool = True
    kv_hash_seed: str | None = None  # the engines' PYTHONHASHSEED, as routers pass it; None = vLLM >= 0.29 default

    def __post_init__(self) -> None:
        for key in ("endpoint", "admin_endpoint"):
            value = getattr(self, key)
            problem = endpoint_problem(value) if value else None
            if problem:
                raise ValueError(f"daemon.{key} {value!r}: {problem}")
            problem = curve_problem(value, self.curve_secret_key_file) if value else None
            if problem:
                raise ValueError(f"daemon.{key}: {problem}")
        if self.liveness_timeout_ms < 2 * self.heartbeat_ms:
            raise ValueError(
                f"daemon.liveness_timeout_ms ({self.liveness_timeout_ms}) must be at least twice "
                f"daemon.heartbeat_ms ({self.heartbeat_ms}), or idle routers are declared dead"
            )


class Config(Section):
    """The whole file. `[[classes]]` + `default_class` form the scheduling profile."""

    daemon: DaemonConfig = msgspec.field(default_factory=DaemonConfig)
    selector: SelectorConfig = msgspec.field(default_factory=SelectorConfig)
    overload: OverloadConfig = msgspec.field(default_factory=OverloadConfig)
    workers: list[WorkerConfig] = msgspec.field(default_factory=list)
    default_class: str = "default"
    classes: list[ClassConfig] = msgspec.field(default_factory=_default_classes)
    include: str | None = None  # another TOML file holding `default_class` + `[[classes]]`

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate class names in [[classes]]: {names}")
        if self.default_class not in names:
            raise ValueError(f"default_class {self.default_class!r} is not one of the classes {names}")
        keys = [w.worker_id for w in self.workers]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"duplicate worker_id in [[workers]]: {', '.join(map(str, dup))}")
        ranks = sum(w.dp_size for w in self.workers)
        if ranks > self.daemon.max_workers:
            raise ValueError(f"[[workers]] declare {ranks} ranks, more than daemon.max_workers={self.daemon.max_workers}")


def url_problem(url: str) -> str | None:
    """What is wrong with an engine's base URL (`[[workers]] url`), or None when it is usable.

    Accepted: `http://HOST[:PORT][/PATH]` and `https://...` — the gateway POSTs to URL + "/v1/..."
    (RFC 3986 syntax, checked with `urllib.parse`).
    """
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in 0..65535
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "expected http://HOST[:PORT] or https://HOST[:PORT]"
    return None


def curve_problem(endpoint: str, curve_secret_key_file: str | None) -> str | None:
    """The CURVE rule: a TCP endpoint not bound to loopback requires `daemon.curve_secret_key_file`."""
    if endpoint.startswith("tcp://") and not is_loopback_endpoint(endpoint) and not curve_secret_key_file:
        return (f"{endpoint} is a TCP endpoint off loopback: it requires daemon.curve_secret_key_file "
                "(CURVE keys)")
    return None


def check_endpoints(cfg: "Config", env: Mapping[str, str] | None = None) -> list[str]:
    """Problems of the endpoints the daemon would really use (discovery and `KVSCHED_*ENDPOINT`
    included): syntax and the CURVE rule. [] = fine. Used by `kvsched-daemon --check-config`."""
    d = cfg.daemon
    problems = []
    (data, _), (admin, _) = daemon_endpoints(d.instance, d.endpoint, d.admin_endpoint, env)
    for what, ep in (("data endpoint", data), ("admin endpoint", admin)):
        problem = endpoint_problem(ep) or curve_problem(ep, d.curve_secret_key_file)
        if problem:
            problems.append(f"{what} {ep!r}: {problem}")
    if d.curve_secret_key_file and not Path(d.curve_secret_key_file).is_file():
        problems.append(f"daemon.curve_secret_key_file {d.curve_secret_key_file}: no such file")
    return problems


_ENV_PREFIX = "KVSCHED_"

# The KVSCHED_<X>_<Y> variables that are not config overrides (docs/DESIGN.md §1.3); the loader
# leaves them alone and refuses any other whose <X> is not a section it can set.
NON_CONFIG_ENV = frozenset({
    "KVSCHED_ENDPOINT", "KVSCHED_ADMIN_ENDPOINT",  # discovery of routers and the CLI (kvsched.endpoints)
    "KVSCHED_DEBUG_STALL_S",  # debug aid: SIGUSR2 blocks the daemon's loop this long (s)
    "KVSCHED_TOKENIZER_DIR",  # docker-compose.yml: the tokenizer mounted into engines and gateway
    "KVSCHED_BENCH_CORE_SRC", "KVSCHED_REGEN_GOLDEN",  # bench/ and tests/
})


def config_env_names(env: Mapping[str, str]) -> list[str]:
    """The `KVSCHED_<X>_<Y>` variables of `env` the loader reads as config overrides (or refuses as
    unknown sections): every `KVSCHED_` name with an inner `_` that is not one of `NON_CONFIG_ENV`.
    Sorted. A process that writes its daemon's whole config (`kvsched replay`) drops these."""
    return sorted(name for name in env if name.startswith(_ENV_PREFIX) and name not in NON_CONFIG_ENV
                  and "_" in name[len(_ENV_PREFIX):].strip("_"))


def _env_overrides(env: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """`KVSCHED_<SECTION>_<KEY>=value` → {section: {key: value}} for the scalar sections.

    Raises:
        ConfigError: an unknown key of a section, or a `KVSCHED_<X>_<Y>` variable whose X is not
            daemon, selector or overload and that is not one of `NON_CONFIG_ENV` (e.g. the typo
            `KVSCHED_DEAMON_MAX_SLOTS`, which would otherwise be ignored in silence).
    """
    out: dict[str, dict[str, Any]] = {}
    sections = {"daemon": DaemonConfig, "selector": SelectorConfig, "overload": OverloadConfig}
    for name, value in env.items():
        if not name.startswith(_ENV_PREFIX) or name in NON_CONFIG_ENV:
            continue
        rest = name[len(_ENV_PREFIX):].lower()
        section = next((s for s in sections if rest.startswith(s + "_")), None)
        if section is None:
            if "_" in rest.strip("_"):  # KVSCHED_<X>_<Y>: meant as an override of section X
                raise ConfigError(
                    f"environment {name}: {rest.split('_')[0]!r} is not a config section that can be set "
                    f"from the environment (KVSCHED_<SECTION>_<KEY> with SECTION one of "
                    f"{', '.join(s.upper() for s in sections)}); other KVSCHED_ variables kvsched reads: "
                    f"{', '.join(sorted(NON_CONFIG_ENV))}")
            continue
        key = rest[len(section) + 1:]
        if key not in sections[section].__struct_fields__:
            raise ConfigError(f"environment {name}: unknown key {section}.{key}")
        out.setdefault(section, {})[key] = _parse_scalar(value)
    return out


def _parse_scalar(value: str) -> Any:
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = value
    return base


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:  # TOML is UTF-8 text (toml.io); tomllib raises this for other bytes
        raise ConfigError(f"{path}: invalid TOML: not UTF-8 text (byte {exc.start})") from None


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Load and validate the configuration (defaults < file < env < overrides).

    Args:
        path: TOML file, or None for defaults only. An `include = "profile.toml"` key (relative to
            the file) supplies `default_class` / `[[classes]]` unless the file sets them itself.
        env: environment mapping (default `os.environ`); `KVSCHED_DAEMON_BLOCK_SIZE=512` etc.
        overrides: nested dict from CLI flags, e.g. {"daemon": {"instance": "pool-a"}}.
    Returns:
        A validated `Config`.
    Raises:
        ConfigError: naming the file, key path and reason.
    """
    raw: dict[str, Any] = {}
    where = "defaults"
    if path is not None:
        p = Path(path)
        where = str(p)
        raw = _read_toml(p)
        inc = raw.get("include")
        if isinstance(inc, str):
            inc_raw = _read_toml((p.parent / inc).resolve())
            for key in ("default_class", "classes"):
                if key in inc_raw and key not in raw:
                    raw[key] = inc_raw[key]
    env_over = _env_overrides(os.environ if env is None else env)
    if env_over:
        where += " + KVSCHED_* environment (" + ", ".join(
            f"KVSCHED_{sec.upper()}_{key.upper()}" for sec, keys in env_over.items() for key in keys) + ")"
    raw = _deep_merge(raw, env_over)
    if overrides:
        raw = _deep_merge(raw, overrides)
    return config_from_dict(raw, where)


def config_from_dict(raw: Mapping[str, Any], where: str = "config") -> Config:
    """Validate a plain dict (as parsed from TOML) into a `Config`; errors name `where` and the path.

    Beyond the per-key types and bounds, every float key must be finite (`non_finite_keys`): TOML
    allows `inf` / `-inf`, and an infinite weight makes every cost inf/NaN.
    """
    try:
        cfg = msgspec.convert(raw, Config, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    except ValueError as exc:  # __post_init__ cross-field checks
        raise ConfigError(f"{where}: {exc}") from exc
    bad = non_finite_keys(cfg)
    if bad:
        raise ConfigError(f"{where}: " + "; ".join(f"{path} = {value!r}: expected a finite number"
                                                    for path, value in bad))
    return cfg


def non_finite_keys(node: Any, path: str = "") -> list[tuple[str, float]]:
    """(key path, value) of every float field that is inf, -inf or NaN in a config tree of `msgspec.Struct`s
    and lists of them (e.g. `("selector.temperature", inf)`, `("classes[0].queue_timeout_s", -inf)`)."""
    out: list[tuple[str, float]] = []
    if isinstance(node, msgspec.Struct):
        for name in node.__struct_fields__:
            out += non_finite_keys(getattr(node, name), f"{path}.{name}" if path else name)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            out += non_finite_keys(item, f"{path}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        out.append((path, node))
    return out
