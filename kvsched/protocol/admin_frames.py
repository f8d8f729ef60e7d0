"""The admin socket's frames (docs/PROTOCOL.md, "Admin socket"): requests (`AdminRequest`) and
replies (`AdminReply`), msgspec structs encoded as MessagePack maps with the tag under `"t"`.

Every field is present on the wire, so `kvsched ... --json` output has a fixed shape for scripts;
fields are only ever appended, each with a default.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from .limits import U16, U32, BatchedTokens, KvBlocks, RequestId


class Admin(msgspec.Struct, frozen=True, kw_only=True, tag_field="t"):
    """Base of admin requests and replies: encoded as MessagePack maps (every field present, so
    `kvsched ... --json` output has a fixed shape for scripts)."""


class Status(Admin, tag="status", frozen=True):
    """Daemon summary. Reply: `StatusReply`."""


class Queues(Admin, tag="queues", frozen=True):
    """Per-class queue state. Reply: `QueuesReply`."""

    policy_class: str | None = None


class Workers(Admin, tag="workers", frozen=True):
    """Per-worker load. Reply: `WorkersReply`."""


class Leases(Admin, tag="leases", frozen=True):
    """Active leases, optionally filtered. Reply: `LeasesReply`."""

    worker_id: U32 | None = None
    policy_class: str | None = None
    limit: Annotated[int, Meta(ge=1, le=100_000)] = 1000


class Drain(Admin, tag="drain", frozen=True):
    """Stop new admissions on a worker (all ranks when dp_rank is None). Reply: `OkReply`."""

    worker_id: U32
    dp_rank: U16 | None = None


class Undrain(Admin, tag="undrain", frozen=True):
    """Resume admissions on a drained worker. Reply: `OkReply`."""

    worker_id: U32
    dp_rank: U16 | None = None


class AddWorker(Admin, tag="add_worker", frozen=True):
    """Register a worker rank at runtime. Reply: `OkReply`.

    With `kv_events_endpoint` the daemon subscribes to the rank's vLLM KV events (endpoints as in
    `[[workers]]`: the rank's own, i.e. already offset by dp_rank, as vLLM binds them).
    """

    worker_id: U32
    dp_rank: U16 = 0
    total_kv_blocks: KvBlocks = 8192  # 1..MAX_KV_BLOCKS (2**40)
    max_num_batched_tokens: BatchedTokens = 8192  # 1..MAX_BATCHED_TOKENS (2**31 - 1)
    kv_events_endpoint: str | None = None  # the engine's KV-event PUB endpoint (we connect)
    kv_replay_endpoint: str | None = None  # its replay ROUTER endpoint, or None (no replay)
    kv_events_topic: str = ""  # SUB topic filter ("" = all)
    kv_events_stale_after_s: Annotated[float, Meta(gt=0)] | None = None  # None = the daemon's default (30 s)
    url: Annotated[str, Meta(max_length=2048)] = ""  # the worker's base URL, sent in `Admitted.url` ("" = keep)


class RemoveWorker(Admin, tag="remove_worker", frozen=True):
    """Remove a worker (all ranks when dp_rank is None); its bookings are released. Reply: `OkReply`."""

    worker_id: U32
    dp_rank: U16 | None = None


class Cancel(Admin, tag="cancel", frozen=True):
    """Cancel a queued request or abort a lease. Reply: `OkReply`."""

    request_id: RequestId


class Reload(Admin, tag="reload", frozen=True):
    """Re-read the scheduling profile from the config file (or `path`). Reply: `OkReply`."""

    path: str | None = None


class Explain(Admin, tag="explain", frozen=True):
    """Per-worker costs of a recent decision. Reply: `ExplainReply`."""

    request_id: RequestId


AdminRequest = (
    Status | Queues | Workers | Leases | Drain | Undrain | AddWorker | RemoveWorker | Cancel | Reload | Explain
)


class OkReply(Admin, tag="ok", frozen=True):
    """An admin operation succeeded; `message` says what was done."""

    message: str = ""


class AdminError(Admin, tag="admin_error", frozen=True):
    """An admin request failed: `code` is an `ErrorCode`, `message` the reason."""

    code: int
    message: str


class StatusReply(Admin, tag="status_reply", frozen=True):
    """`kvsched status`: identity, uptime (s), workers, leases, queued/deferred requests, decisions and decisions/s."""

    instance: str
    daemon_epoch: int
    uptime_s: float
    workers: int
    active_leases: int
    queued: int
    deferred: int
    decisions_total: int
    decisions_per_s: float
    connections: int
    endpoint: str
    block_size: int


class ClassRow(Admin, tag="class_row", frozen=True):
    """One class in `kvsched queues`: depth (requests), deferred, isl_tokens (tokens waiting), oldest_wait_s (s),
    DRR deficit (tokens), quantum (tokens), blocked_lanes."""

    name: str
    ordering: str
    quantum: int
    depth: int
    deferred: int
    isl_tokens: int
    oldest_wait_s: float
    deficit: int
    blocked_lanes: int


class QueuesReply(Admin, tag="queues_reply", frozen=True):
    """`kvsched queues`: one `ClassRow` per class."""

    classes: list[ClassRow] = []


class WorkerRow(Admin, tag="worker_row", frozen=True):
    """One worker rank in `kvsched workers`: capacities and current load (blocks, prefill tokens, requests) and
    flags."""

    worker_id: int
    dp_rank: int
    total_kv_blocks: int
    max_num_batched_tokens: int
    active_blocks: int
    active_prefill_tokens: int
    active_requests: int
    drained: bool = False
    overloaded: bool = False
    stale: bool = False
    hash_mismatch: bool = False  # its KV events hash blocks differently from routers (docs/VLLM.md)


class WorkersReply(Admin, tag="workers_reply", frozen=True):
    """`kvsched workers`: one `WorkerRow` per registered rank."""

    workers: list[WorkerRow] = []


class LeaseRow(Admin, tag="lease_row", frozen=True):
    """One active lease: where it runs, its tokens, age (s) and state (admitted / dispatched / prefill_done)."""

    request_id: str
    worker_id: int
    dp_rank: int
    slot: int
    generation: int
    policy_class: str
    isl_tokens: int
    cached_tokens: int
    output_tokens: int
    age_s: float
    state: str


class LeasesReply(Admin, tag="leases_reply", frozen=True):
    """`kvsched leases`: up to `limit` rows; `total` counts the active leases matching the filter."""

    leases: list[LeaseRow] = []
    total: int = 0


class ExplainRow(Admin, tag="explain_row", frozen=True):
    """One worker's view of a decision: eligibility, overlap blocks, projected blocks and prefill tokens, cost
    (lower wins; -1 if ineligible) and, when the selector picked the lowest cost, its named cost terms summing
    to it (docs/ROUTING.md); with no terms, `cost` is the projection's (Dynamo's kv-router cost), not used."""

    worker_id: int
    dp_rank: int
    eligible: bool
    overlap_blocks: int
    potential_blocks: int
    potential_prefill_tokens: int
    cost: float
    terms: dict[str, float] = {}


class ExplainReply(Admin, tag="explain_reply", frozen=True):
    """`kvsched explain`: the chosen worker and every worker's row; decided_at_s is the daemon's monotonic clock (s)."""

    request_id: str
    chosen_worker_id: int
    chosen_dp_rank: int
    decided_at_s: float
    rows: list[ExplainRow] = []
    decided_by: str = ""  # the selector type that chose; `cost` is what decided only when the rows carry terms


AdminReply = OkReply | AdminError | StatusReply | QueuesReply | WorkersReply | LeasesReply | ExplainReply
