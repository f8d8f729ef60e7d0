"""Every frame kvsched puts on the wire (docs/DESIGN.md §2; bytes: docs/PROTOCOL.md), as msgspec structs
encoded with MessagePack.

Router → daemon frames form `RouterFrame`, daemon → router frames `DaemonFrame`, admin requests
`AdminRequest` and admin replies `AdminReply`. Hot-path frames are `array_like` (a MessagePack array,
tag first); admin frames are maps (readable, easy to extend). Bounds live in the types (`Meta`), so a
hostile frame fails at decode and never reaches the actor. Fields are only ever appended, each with
a default; a breaking change bumps `PROTOCOL_VERSION`. `docs/PROTOCOL.md` describes the bytes.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal, NamedTuple, Union

import msgspec
from msgspec import Meta

PROTOCOL_VERSION = 2  # the version this package speaks; 2 added `Batch` / `Replies`
PROTOCOL_MIN = 1
PROTOCOL_MAX = 2
BATCH_MIN_VERSION = 2  # `Batch` and `Replies` need a connection at this version or above
DEFAULT_MAX_FRAME_BYTES = 1 << 20  # assumed when a `Welcome` does not announce its limit (version 1)

MAX_REQUEST_ID_BYTES = 128
MAX_BLOCK_HASHES = 65_536  # per request; 8 bytes each on the wire
MAX_NAME_CHARS = 128
MAX_LIST = 65_536
# Worker capacities (per rank). 2**40 KV blocks is ~10**5 times the largest GPU's (an 80 GB card
# holds ~10**6 blocks of 16 tokens); with it, sums over max_workers (4,096 = 2**12) rows and products
# with the selector's weights stay exact in int64 and float64 (< 2**53). A step budget is an int
# in vLLM (`--max-num-batched-tokens`), as a prompt's token count is here (`Tokens`).
MAX_KV_BLOCKS = 2**40
MAX_BATCHED_TOKENS = 2**31 - 1

U16 = Annotated[int, Meta(ge=0, le=0xFFFF)]
U32 = Annotated[int, Meta(ge=0, le=0xFFFF_FFFF)]
I32 = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]
U63 = Annotated[int, Meta(ge=0, le=2**63 - 1)]
RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID_BYTES)]
Name = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]
Tokens = Annotated[int, Meta(ge=0, le=2**31 - 1)]
HashBytes = Annotated[bytes, Meta(max_length=8 * MAX_BLOCK_HASHES)]
Slot = Annotated[int, Meta(ge=-1, le=2**31 - 1)]
KvBlocks = Annotated[int, Meta(ge=1, le=MAX_KV_BLOCKS)]  # a rank's total KV blocks
BatchedTokens = Annotated[int, Meta(ge=1, le=MAX_BATCHED_TOKENS)]  # a rank's per-step token budget



class WorkerKey(NamedTuple):
    """One worker = (engine instance id, data-parallel rank): `Admitted.worker_id` / `.dp_rank`, the
    `pinned` pair of an `Enqueue`, and the key of every worker row in the daemon."""

    worker_id: int  # u32
    dp_rank: int  # u16

    def __str__(self) -> str:
        return f"{self.worker_id}:{self.dp_rank}"


RejectReason = Literal[
    "queue_full",
    "do_not_queue",
    "duplicate_request",
    "no_endpoints",
    "pinned_not_allowed",
    "all_overloaded",
    "timeout",
    "overloaded",
    "invalid",
    "shutting_down",
    "cancelled",  # an operator cancelled it (`kvsched cancel`); for a lease: revoked
]
REJECT_REASONS: tuple[str, ...] = RejectReason.__args__  # type: ignore[attr-defined]

UpdateKind = Literal["dispatched", "prefill_done", "progress", "requeue"]
ReleaseOutcome = Literal["completed", "aborted", "cancelled"]


class ErrorCode(enum.IntEnum):
    """Wire codes of `Error` frames."""

    MALFORMED = 1  # bytes that do not decode as a frame of this socket
    VERSION = 2  # Hello.protocol_version outside [protocol_min, protocol_max]
    NOT_HELLO = 3  # a frame before Hello on this connection
    OVERSIZED = 4  # frame larger than max_frame_bytes (normally cut by ZMQ_MAXMSGSIZE)
    UNKNOWN_REQUEST = 5  # Update for a request id / slot / generation the daemon does not hold
    ADMIN_ON_DATA_SOCKET = 6  # admin frames are only accepted on the admin socket
    INVALID = 7  # fields contradict each other (admin)
    BUSY = 8  # a conflicting admin operation is running
    NOT_FOUND = 9  # admin: unknown worker / request
    INTERNAL = 10  # a bug: the daemon logged it and carried on


# --------------------------------------------------------------------------------------------
# Router → daemon
# --------------------------------------------------------------------------------------------


class Frame(msgspec.Struct, frozen=True, array_like=True, tag_field="t", omit_defaults=True):
    """Base of the hot-path frames: immutable, encoded as a MessagePack array, tag first."""


class Hello(Frame, tag="hello"):
    """First frame on a connection. Router → daemon; answered by `Welcome` or `Error(VERSION)`."""

    protocol_version: U16
    client_name: Name = ""
    pid: Annotated[int, Meta(ge=0, le=2**31 - 1)] = 0  # 0 = remote / unknown, no pid watch
    host: Name = ""
    # inode of the sender's /proc/self/ns/pid; 0 = unknown (no pid watch). Appended in protocol rev. 2.
    pid_ns: U63 = 0


class Enqueue(Frame, tag="enqueue"):
    """Ask to run one request. Router → daemon; answered by exactly one `Admitted` or `Rejected`.

    Not idempotent: a second Enqueue with a live request_id is rejected `duplicate_request`.
    """

    request_id: RequestId
    isl_tokens: Annotated[int, Meta(ge=1, le=2**31 - 1)]  # prompt tokens
    block_hashes: HashBytes = b""  # little-endian u64 chained hashes (np.frombuffer '<u8')
    policy_class: Name = ""  # "" = default class
    priority: I32 = 0  # jump (fcfs/wspt) or vLLM priority (priority classes)
    strict_priority: I32 = 0  # higher first, outranks the score
    session_id: Name | None = None
    expected_osl: Tokens | None = None  # expected output tokens
    pinned: tuple[U32, U16] | None = None  # (worker_id, dp_rank)
    allowed_workers: Annotated[list[U32], Meta(max_length=4096)] | None = None  # worker ids
    do_not_queue: bool = False
    deadline_ms: Annotated[int, Meta(ge=0, le=86_400_000)] | None = None  # max queue wait
    lora_name: Name | None = None
    # worker ids (all ranks) this request must not use (e.g. a gateway's failing engines); a pin
    # inside it is rejected `pinned_not_allowed`
    excluded_workers: Annotated[list[U32], Meta(max_length=4096)] | None = None


class Update(Frame, tag="update"):
    """Progress of an admitted request. Router → daemon; no reply, except `requeue` which is
    answered by one later `Admitted` or `Rejected` (with a new slot / generation).

    Keyed by (request_id, slot, generation); a stale key is ignored (counted).
    """

    request_id: RequestId
    slot: Annotated[int, Meta(ge=0, le=2**31 - 1)]
    generation: U32
    kind: UpdateKind
    output_tokens: Tokens | None = None  # for kind == "progress": output tokens so far


class Release(Frame, tag="release"):
    """End of a request. Router → daemon; no reply; idempotent.

    `cancelled` with slot -1 removes a queued or deferred request.
    """

    request_id: RequestId
    slot: Slot = -1
    generation: U32 = 0
    outcome: ReleaseOutcome = "completed"
    context_tokens: Tokens = 0  # isl + output tokens, for admission policies


class Heartbeat(Frame, tag="heartbeat"):
    """Liveness ping sent when the connection is otherwise idle. Answered by `HeartbeatAck`."""

    seq: U63


class LeaseRef(msgspec.Struct, frozen=True, array_like=True):
    """(request_id, slot, generation) of a lease the client still holds; used by `Reattach`."""

    request_id: RequestId
    slot: Annotated[int, Meta(ge=0, le=2**31 - 1)]
    generation: U32


class Requeued(msgspec.Struct, frozen=True, array_like=True):
    """A requeue the client sent and has not seen answered: the lease it gave back and the request's
    original `Enqueue` (used by `Reattach.requeues`)."""

    lease: LeaseRef
    enqueue: Enqueue


class Reattach(Frame, tag="reattach"):
    """Sent after reconnecting to a (restarted) daemon. Answered by `Reattached`, then by one
    `Admitted`/`Rejected` per `requeues` entry and per pending Enqueue.

    `requeues` (appended in protocol rev. 2): a daemon that still books the lease releases it first;
    the request then waits again with its original queue position when the daemon still holds it,
    else it is enqueued again (before `pending`).
    """

    leases: Annotated[list[LeaseRef], Meta(max_length=MAX_LIST)] = []
    pending: Annotated[list[Enqueue], Meta(max_length=MAX_LIST)] = []
    requeues: Annotated[list[Requeued], Meta(max_length=MAX_LIST)] = []


class Batch(Frame, tag="batch"):
    """Protocol version 2: any number of router frames (not `Hello`, not `Batch`) in one message,
    handled in order exactly as if they had arrived one by one. Each element is one complete
    encoded frame (decoded on its own); a malformed one gets its own `Error` with `batch_index`."""

    frames: Annotated[list[msgspec.Raw], Meta(max_length=MAX_LIST)] = []


RouterFrame = Union[Hello, Enqueue, Update, Release, Heartbeat, Reattach, Batch]
BatchedRouterFrame = Union[Enqueue, Update, Release, Heartbeat, Reattach]  # what a `Batch` may carry

# --------------------------------------------------------------------------------------------
# Daemon → router
# --------------------------------------------------------------------------------------------


class Welcome(Frame, tag="welcome"):
    """Answer to `Hello`: the daemon's identity, limits and shared-memory segment names."""

    daemon_epoch: U63
    protocol_min: U16
    protocol_max: U16
    block_size: Annotated[int, Meta(ge=1)]
    shm_ledger: str
    shm_progress: str
    heartbeat_ms: Annotated[int, Meta(ge=1)]
    liveness_timeout_ms: Annotated[int, Meta(ge=1)]
    max_frame_bytes: Annotated[int, Meta(ge=0)] = 0  # largest message the daemon accepts; 0 = not announced (v1)


class Admitted(Frame, tag="admitted"):
    """The request may run now on (worker_id, dp_rank). The router holds the lease
    (slot, generation) until it sends `Release`."""

    request_id: str
    worker_id: U32
    dp_rank: U16
    slot: int
    generation: U32
    overlap_blocks: int  # prompt blocks already cached on the chosen worker
    cached_tokens: int  # prompt tokens already cached on the chosen worker
    queued_us: int  # time the request waited in the daemon (µs)
    url: str = ""  # the worker's base URL (`[[workers]].url` / `add-worker --url`); "" = none configured
    dp_size: int = 1  # ranks registered for worker_id (> 1: send vLLM's X-data-parallel-rank header)


class Rejected(Frame, tag="rejected"):
    """The request will not run; `reason` is one of `REJECT_REASONS`."""

    request_id: str
    reason: RejectReason
    detail: str = ""
    policy_class: str = ""
    limit_kind: str | None = None
    current: int | None = None
    limit: int | None = None


class Error(Frame, tag="error"):
    """A frame that could not be decoded or was out of order; sent to its sender only."""

    code: int
    message: str
    request_id: str | None = None
    batch_index: int | None = None  # position of the offending frame inside a `Batch`


class HeartbeatAck(Frame, tag="heartbeat_ack"):
    """Answer to `Heartbeat` with the same seq."""

    seq: int


class Reattached(Frame, tag="reattached"):
    """Answer to `Reattach`: which leases the daemon kept and which it had already released."""

    kept: list[str] = []
    lost: list[str] = []


class Replies(Frame, tag="replies"):
    """Protocol version 2: every frame the daemon owes one connection from one wake, in order, in
    one message. Each element is one complete encoded daemon frame (never a `Replies`)."""

    frames: list[msgspec.Raw] = []


DaemonFrame = Union[Welcome, Admitted, Rejected, Error, HeartbeatAck, Reattached, Replies]
RepliedDaemonFrame = Union[Welcome, Admitted, Rejected, Error, HeartbeatAck, Reattached]  # inside `Replies`

# --------------------------------------------------------------------------------------------
# Admin (admin socket only)
# --------------------------------------------------------------------------------------------


class Admin(msgspec.Struct, frozen=True, kw_only=True, tag_field="t"):
    """Base of admin requests and replies: encoded as MessagePack maps (every field present, so
    `kvsched ... --json` output has a fixed shape for scripts)."""


class Status(Admin, tag="status"):
    """Daemon summary. Reply: `StatusReply`."""


class Queues(Admin, tag="queues"):
    """Per-class queue state. Reply: `QueuesReply`."""

    policy_class: str | None = None


class Workers(Admin, tag="workers"):
    """Per-worker load. Reply: `WorkersReply`."""


class Leases(Admin, tag="leases"):
    """Active leases, optionally filtered. Reply: `LeasesReply`."""

    worker_id: U32 | None = None
    policy_class: str | None = None
    limit: Annotated[int, Meta(ge=1, le=100_000)] = 1000


class Drain(Admin, tag="drain"):
    """Stop new admissions on a worker (all ranks when dp_rank is None). Reply: `OkReply`."""

    worker_id: U32
    dp_rank: U16 | None = None


class Undrain(Admin, tag="undrain"):
    """Resume admissions on a drained worker. Reply: `OkReply`."""

    worker_id: U32
    dp_rank: U16 | None = None


class AddWorker(Admin, tag="add_worker"):
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


class RemoveWorker(Admin, tag="remove_worker"):
    """Remove a worker (all ranks when dp_rank is None); its bookings are released. Reply: `OkReply`."""

    worker_id: U32
    dp_rank: U16 | None = None


class Cancel(Admin, tag="cancel"):
    """Cancel a queued request or abort a lease. Reply: `OkReply`."""

    request_id: RequestId


class Reload(Admin, tag="reload"):
    """Re-read the scheduling profile from the config file (or `path`). Reply: `OkReply`."""

    path: str | None = None


class Explain(Admin, tag="explain"):
    """Per-worker costs of a recent decision. Reply: `ExplainReply`."""

    request_id: RequestId


AdminRequest = Union[Status, Queues, Workers, Leases, Drain, Undrain, AddWorker, RemoveWorker, Cancel, Reload, Explain]


class OkReply(Admin, tag="ok"):
    """An admin operation succeeded; `message` says what was done."""

    message: str = ""


class AdminError(Admin, tag="admin_error"):
    """An admin request failed: `code` is an `ErrorCode`, `message` the reason."""

    code: int
    message: str


class StatusReply(Admin, tag="status_reply"):
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


class ClassRow(Admin, tag="class_row"):
    """One class in `kvsched queues`: depth (requests), deferred, isl_tokens (tokens waiting), oldest_wait_s (s), DRR deficit (tokens), quantum (tokens), blocked_lanes."""

    name: str
    ordering: str
    quantum: int
    depth: int
    deferred: int
    isl_tokens: int
    oldest_wait_s: float
    deficit: int
    blocked_lanes: int


class QueuesReply(Admin, tag="queues_reply"):
    """`kvsched queues`: one `ClassRow` per class."""

    classes: list[ClassRow] = []


class WorkerRow(Admin, tag="worker_row"):
    """One worker rank in `kvsched workers`: capacities and current load (blocks, prefill tokens, requests) and flags."""

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


class WorkersReply(Admin, tag="workers_reply"):
    """`kvsched workers`: one `WorkerRow` per registered rank."""

    workers: list[WorkerRow] = []


class LeaseRow(Admin, tag="lease_row"):
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


class LeasesReply(Admin, tag="leases_reply"):
    """`kvsched leases`: up to `limit` rows; `total` counts the active leases matching the filter."""

    leases: list[LeaseRow] = []
    total: int = 0


class ExplainRow(Admin, tag="explain_row"):
    """One worker's view of a decision: eligibility, overlap blocks, projected blocks and prefill tokens, cost
    (lower wins; -1 if ineligible) and the selector's named cost terms summing to it (docs/ROUTING.md)."""

    worker_id: int
    dp_rank: int
    eligible: bool
    overlap_blocks: int
    potential_blocks: int
    potential_prefill_tokens: int
    cost: float
    terms: dict[str, float] = {}


class ExplainReply(Admin, tag="explain_reply"):
    """`kvsched explain`: the chosen worker and every worker's row; decided_at_s is the daemon's monotonic clock (s)."""

    request_id: str
    chosen_worker_id: int
    chosen_dp_rank: int
    decided_at_s: float
    rows: list[ExplainRow] = []
    decided_by: str = ""  # the selector type that chose; `cost` is what decided only for kv / dynamo_cost


AdminReply = Union[OkReply, AdminError, StatusReply, QueuesReply, WorkersReply, LeasesReply, ExplainReply]

# Data socket: router frames, plus admin requests so they can be refused with a precise code.
DataSocketFrame = Union[Hello, Enqueue, Update, Release, Heartbeat, Reattach, Batch]


def make_encoder() -> msgspec.msgpack.Encoder:
    """One encoder per socket (reuse it: it keeps an internal buffer)."""
    return msgspec.msgpack.Encoder()


def make_router_decoder() -> msgspec.msgpack.Decoder:
    """Daemon side of the data socket: decodes any `RouterFrame`."""
    return msgspec.msgpack.Decoder(RouterFrame)


def make_daemon_decoder() -> msgspec.msgpack.Decoder:
    """Client side of the data socket: decodes any `DaemonFrame`."""
    return msgspec.msgpack.Decoder(DaemonFrame)


def make_batched_router_decoder() -> msgspec.msgpack.Decoder:
    """Daemon side: decodes one frame found inside a `Batch` (any `RouterFrame` but Hello / Batch)."""
    return msgspec.msgpack.Decoder(BatchedRouterFrame)


def make_replied_daemon_decoder() -> msgspec.msgpack.Decoder:
    """Client side: decodes one frame found inside a `Replies`."""
    return msgspec.msgpack.Decoder(RepliedDaemonFrame)


def _array_header(n: int) -> bytes:
    """MessagePack array header for `n` elements (fixarray, array 16 or array 32)."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


_BATCH_HEAD = b"\x92\xa5batch"  # array of 2: tag "batch", then the frames array
_REPLIES_HEAD = b"\x92\xa7replies"


def encode_batch(raws: list[bytes]) -> bytes:
    """The bytes of `Batch(frames=raws)` without re-encoding the frames: equal to
    `make_encoder().encode(Batch([msgspec.Raw(r) for r in raws]))` (a test checks it)."""
    return b"".join((_BATCH_HEAD, _array_header(len(raws)), *raws))


def encode_replies(raws: list[bytes]) -> bytes:
    """The bytes of `Replies(frames=raws)`, built like `encode_batch`."""
    return b"".join((_REPLIES_HEAD, _array_header(len(raws)), *raws))


BATCH_OVERHEAD_BYTES = len(_REPLIES_HEAD) + 5  # the largest head + array-32 header of either message


def make_admin_request_decoder() -> msgspec.msgpack.Decoder:
    """Daemon side of the admin socket."""
    return msgspec.msgpack.Decoder(AdminRequest)


def make_admin_reply_decoder() -> msgspec.msgpack.Decoder:
    """CLI side of the admin socket."""
    return msgspec.msgpack.Decoder(AdminReply)


_ADMIN_TAGS = frozenset(cls.__struct_config__.tag for cls in AdminRequest.__args__)  # type: ignore[attr-defined]
_ID_TAGS = frozenset(("enqueue", "update", "release"))


class _TagPeek(msgspec.Struct):
    """The `t` key of a MessagePack map (other keys skipped): typed, so nesting cannot recurse far."""

    t: Annotated[str, Meta(max_length=64)]


class _IdPeek(msgspec.Struct, array_like=True):
    """The first two elements of a hot-path frame (tag, request_id); later elements are ignored."""

    t: Annotated[str, Meta(max_length=64)]
    request_id: RequestId


_TAG_PEEK = msgspec.msgpack.Decoder(_TagPeek)
_ID_PEEK = msgspec.msgpack.Decoder(_IdPeek)


def peek_admin_tag(raw: bytes) -> bool:
    """True when `raw` is a MessagePack map whose `t` names an admin request (the data socket then
    answers `ADMIN_ON_DATA_SOCKET` rather than a generic decode error). Never raises."""
    try:
        return _TAG_PEEK.decode(raw).t in _ADMIN_TAGS
    except Exception:  # noqa: BLE001 - any failure means "not an admin frame"
        return False


def peek_request_id(raw: bytes) -> str | None:
    """The request id of a frame that failed the full decode, when a bounded typed look-up can read
    it (an array whose tag is enqueue / update / release and whose second element is a valid id);
    else None. Never raises."""
    try:
        peek = _ID_PEEK.decode(raw)
    except Exception:  # noqa: BLE001
        return None
    return peek.request_id if peek.t in _ID_TAGS else None


def hashes_to_bytes(block_hashes) -> bytes:  # noqa: ANN001 - accepts several shapes on purpose
    """Encode block hashes as little-endian u64 bytes (the wire form).

    Args:
        block_hashes: bytes (returned as-is, length must be a multiple of 8), a sequence of ints in
            [0, 2**64), or a numpy integer array (converted to uint64 little-endian).
    Raises:
        ValueError: a length that is not a multiple of 8, or an int out of u64 range.
    """
    import numpy as np

    if isinstance(block_hashes, (bytes, bytearray, memoryview)):
        raw = bytes(block_hashes)
        if len(raw) % 8:
            raise ValueError(f"block_hashes bytes length {len(raw)} is not a multiple of 8")
        return raw
    if isinstance(block_hashes, np.ndarray):
        return np.ascontiguousarray(block_hashes, dtype="<u8").tobytes()
    try:
        return np.fromiter((int(h) for h in block_hashes), dtype="<u8").tobytes()
    except OverflowError as exc:
        raise ValueError("block hash out of u64 range") from exc


def hashes_from_bytes(raw: bytes):  # noqa: ANN201
    """Decode wire block hashes: returns uint64[n] (a read-only view on `raw`)."""
    import numpy as np

    return np.frombuffer(raw, dtype="<u8")


def error_code_name(code: int) -> str:
    """The lower-case name of an `ErrorCode` (`9` -> "not_found"), or "code N" for an unknown one:
    what messages for people show instead of the bare number."""
    try:
        return ErrorCode(code).name.lower()
    except ValueError:
        return f"code {code}"
