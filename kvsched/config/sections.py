"""The configuration tree: every TOML table as a `Section` (msgspec struct; an unknown key is an error
naming its path), with its defaults, bounds and cross-field rules (`__post_init__`). `examples/kvsched.toml`
is kept equal to these defaults (a test checks it). Loading is `kvsched.config.loader`'s job.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ..endpoints import INSTANCE_PATTERN, endpoint_problem
from ..protocol import MAX_NAME_CHARS, BatchedTokens, KvBlocks
from .checks import curve_problem, url_problem
from .selectors import selector_problem

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
            raise ValueError(
                f"admission low_water_frac ({self.low_water_frac}) must not exceed "
                f"high_water_frac ({self.high_water_frac})"
            )


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
    # publisher disconnected, or a seq gap unfilled by replay, longer than this (s) -> worker marked stale
    # (approximate index); silence never counts (docs/KV_EVENTS.md "Staleness")
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

    # an installed selector (the `kvsched.selectors` entry points, `kvsched.config.selectors`): kvsched's kv,
    # round_robin, least_loaded, power_of_two, random; the kvsched-bench baselines when that is installed
    type: Annotated[str, Meta(min_length=1, max_length=MAX_NAME_CHARS)] = "kv"
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
    # home (docs/ROUTING.md; 0 = off, and the fused admission kernel decides): a worker's share of recent
    # cache-reusing admissions (decayed count of admissions with at least home_min_cached_share of their prompt
    # cached, relative to the eligible mean, measured from the least) x the request's own uncached prefill blocks
    # x prefill_weight x this weight, for requests whose own uncached prefill there is at least
    # home_min_prefill_tokens
    home_weight: Annotated[float, Meta(ge=0)] = 0.08
    home_half_life_s: Annotated[float, Meta(gt=0)] = 30.0
    home_min_cached_share: Annotated[float, Meta(ge=0, le=1)] = 0.5
    home_min_prefill_tokens: TokenCount = 16384
    # the projection's reference cost, NVIDIA Dynamo's kv-router cost with its defaults: what the kvsched-bench
    # `dynamo_cost` baseline decides by; `kvsched explain` shows it under a selector that decides by other figures
    prefill_load_scale: Annotated[float, Meta(ge=0)] = 1.0  # weight of the prefill term
    overlap_credit: Annotated[float, Meta(ge=0)] = 1.0  # blocks of credit per overlapping block
    temperature: Annotated[float, Meta(ge=0)] = 0.0  # kv (and dynamo_cost): 0 = argmin with random tie-break
    approx_ttl_s: Annotated[float, Meta(gt=0)] = 120.0  # approximate index entry lifetime (s)
    # credit of a block held only in an offload tier (CPU/disk KV events), as a fraction of a device block's
    offload_overlap_credit: Annotated[float, Meta(ge=0, le=1)] = 0.5
    seed: Seed | None = None  # RNG seed (0..2**63-1) for tie-breaks / softmax (None = random)

    def __post_init__(self) -> None:
        problem = selector_problem(self.type)
        if problem is not None:
            raise ValueError(f"selector.type: {problem}")


class OverloadConfig(Section):
    """Per-worker overload thresholds (docs/DESIGN.md §4.2): an overloaded worker is not eligible."""

    overload_active_blocks_frac: Annotated[float, Meta(gt=0)] | None = None  # of total_kv_blocks
    overload_prefill_tokens: TokenCount | None = None  # active prefill tokens


class DaemonConfig(Section):
    """Process, sockets and capacities of `kvsched-daemon`."""

    instance: Annotated[str, Meta(pattern=INSTANCE_PATTERN)] = "default"
    endpoint: str = ""  # data socket; "" = discovery (docs/DESIGN.md §1.2); set, it wins over KVSCHED_ENDPOINT
    admin_endpoint: str = ""  # admin socket; "" = discovery; set, it wins over KVSCHED_ADMIN_ENDPOINT
    curve_secret_key_file: str | None = None  # z85 server secret key; required for a non-loopback TCP endpoint
    curve_authorized_keys_dir: str | None = (
        None  # client public keys allowed (pyzmq certs); None = any client holding the server key
    )
    block_size: Annotated[int, Meta(ge=1, le=1 << 20)] = 16  # tokens per KV block
    max_workers: Annotated[int, Meta(ge=1, le=4096)] = 64  # worker rows in the ledger
    max_slots: Annotated[int, Meta(ge=1, le=1 << 22)] = 8192  # concurrent leases
    max_blocks_per_request: Annotated[int, Meta(ge=1, le=1 << 20)] = 1024  # hashes kept per lease
    heartbeat_ms: Annotated[int, Meta(ge=10)] = (
        1000  # client heartbeat period (its heartbeat thread; its loop when idle)
    )
    liveness_timeout_ms: Annotated[int, Meta(ge=50)] = 5000  # uncredited this long (no frame, no heartbeat) = dead
    frame_budget_per_wake: Annotated[int, Meta(ge=1)] = 512  # frames read per reader wake
    inflight_cap_per_connection: Annotated[int, Meta(ge=1)] = 4096  # outstanding Enqueues
    max_frame_bytes: Annotated[int, Meta(ge=1024)] = 1 << 20  # ZMQ_MAXMSGSIZE
    progress_fold_ms: Annotated[int, Meta(ge=1, le=1000)] = 10  # fold progress words at least this often
    fold_interval_ms: Annotated[int, Meta(ge=1, le=1000)] = 1  # while requests wait: fold words at least this often
    # SIGTERM: releases / progress of live leases are still served for up to this long (s)
    shutdown_timeout_s: Annotated[float, Meta(ge=0, le=3600)] = 5.0
    # a connection's share of each class queue limit, max(1, floor(share x limit)): alone it may fill the
    # limit; while others wait there it gets `overloaded` at its share (docs/DESIGN.md §5.9); 1.0 = limits only
    max_waiting_share: Annotated[float, Meta(gt=0, le=1)] = 0.5
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] = 0  # Prometheus HTTP; 0 = off
    metrics_host: str = "127.0.0.1"  # also serves /healthz and /readyz (docs/DEPLOY.md)
    health_stall_ms: Annotated[int, Meta(ge=1)] = 5000  # /healthz fails when the actor's tick is older (ms)
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # recompute the hashes of first-of-chain BlockStored events; warn, count and flag engines whose
    # hashes differ from block_hashes(mode="vllm", hash_seed=kv_hash_seed) (docs/VLLM.md)
    kv_hash_check: bool = True
    # the engines' PYTHONHASHSEED: the one hash seed of the pool, sent to every router in `Welcome.hash_seed`
    # (routers hash with `SchedulerClient.block_hashes`); None = vLLM >= 0.29's default. At most MAX_NAME_CHARS
    # characters, the bound of the Welcome field.
    kv_hash_seed: Annotated[str, Meta(max_length=MAX_NAME_CHARS)] | None = None

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
    include: str | None = None  # another TOML file holding only `default_class` + `[[classes]]` (no include)

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
            raise ValueError(
                f"[[workers]] declare {ranks} ranks, more than daemon.max_workers={self.daemon.max_workers}"
            )
