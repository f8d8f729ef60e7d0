"""Every frame kvsched puts on the wire (docs/DESIGN.md §2; bytes: docs/PROTOCOL.md), as msgspec structs
encoded with MessagePack.

Router → daemon frames form `RouterFrame`, daemon → router frames `DaemonFrame`, admin requests
`AdminRequest` and admin replies `AdminReply`. Hot-path frames are `array_like` (a MessagePack array,
tag first); admin frames are maps (readable, easy to extend). Bounds live in the types (`Meta`), so a
hostile frame fails at decode and never reaches the actor. Fields are only ever appended, each with
a default; a breaking change bumps `PROTOCOL_VERSION`. `docs/PROTOCOL.md` describes the bytes.

One module per job; import every name from `kvsched.protocol` itself (the modules are an inside
arrangement):

* `limits`        protocol versions, wire limits (`MAX_REQUEST_ID_BYTES`, ...), the bounded field types
* `vocabulary`    `WorkerKey`, reject reasons, update kinds, release outcomes, `ErrorCode`
* `frames`        the hot-path frames of version 1 (`Hello` ... `Reattached`)
* `batching`      version 2's `Batch` / `Replies` and their byte builders
* `admin_frames`  admin requests and replies
* `codec`         what each socket decodes, encoder / decoder factories, peeks, block-hash bytes

Like the whole ground floor, the package imports the standard library and msgspec only (numpy is
imported by the block-hash helpers when called).
"""

from __future__ import annotations

from .admin_frames import (
    AddWorker,
    Admin,
    AdminError,
    AdminReply,
    AdminRequest,
    Cancel,
    ClassRow,
    Drain,
    Explain,
    ExplainReply,
    ExplainRow,
    LeaseRow,
    Leases,
    LeasesReply,
    OkReply,
    Queues,
    QueuesReply,
    Reload,
    RemoveWorker,
    Status,
    StatusReply,
    Undrain,
    WorkerRow,
    Workers,
    WorkersReply,
)
from .batching import BATCH_OVERHEAD_BYTES, Batch, Replies, encode_batch, encode_replies
from .codec import (
    BatchedRouterFrame,
    DaemonFrame,
    DataSocketFrame,
    RepliedDaemonFrame,
    RouterFrame,
    hashes_to_bytes,
    make_admin_reply_decoder,
    make_admin_request_decoder,
    make_batched_router_decoder,
    make_daemon_decoder,
    make_encoder,
    make_replied_daemon_decoder,
    make_router_decoder,
    peek_admin_tag,
    peek_request_id,
)
from .frames import (
    Admitted,
    Enqueue,
    Error,
    Frame,
    Heartbeat,
    HeartbeatAck,
    Hello,
    LeaseRef,
    Reattach,
    Reattached,
    Rejected,
    Release,
    Requeued,
    Update,
    Welcome,
)
from .limits import (
    BATCH_MIN_VERSION,
    DEFAULT_MAX_FRAME_BYTES,
    I32,
    MAX_BATCHED_TOKENS,
    MAX_BLOCK_HASHES,
    MAX_KV_BLOCKS,
    MAX_LIST,
    MAX_NAME_CHARS,
    MAX_REQUEST_ID_BYTES,
    MAX_TOKENS,
    PROTOCOL_MAX,
    PROTOCOL_MIN,
    PROTOCOL_VERSION,
    U16,
    U32,
    U63,
    BatchedTokens,
    HashBytes,
    KvBlocks,
    Name,
    RequestId,
    Slot,
    Tokens,
)
from .vocabulary import (
    REJECT_REASONS,
    ErrorCode,
    RejectReason,
    ReleaseOutcome,
    UpdateKind,
    WorkerKey,
    error_code_name,
)
from .walk import batch_frames

__all__ = [
    "BATCH_MIN_VERSION",
    "BATCH_OVERHEAD_BYTES",
    "DEFAULT_MAX_FRAME_BYTES",
    "I32",
    "MAX_BATCHED_TOKENS",
    "MAX_BLOCK_HASHES",
    "MAX_KV_BLOCKS",
    "MAX_LIST",
    "MAX_NAME_CHARS",
    "MAX_REQUEST_ID_BYTES",
    "MAX_TOKENS",
    "PROTOCOL_MAX",
    "PROTOCOL_MIN",
    # limits
    "PROTOCOL_VERSION",
    "REJECT_REASONS",
    "U16",
    "U32",
    "U63",
    "AddWorker",
    # admin frames
    "Admin",
    "AdminError",
    "AdminReply",
    "AdminRequest",
    "Admitted",
    # batching (version 2)
    "Batch",
    "BatchedRouterFrame",
    "BatchedTokens",
    "Cancel",
    "ClassRow",
    "DaemonFrame",
    "DataSocketFrame",
    "Drain",
    "Enqueue",
    "Error",
    "ErrorCode",
    "Explain",
    "ExplainReply",
    "ExplainRow",
    # frames (version 1)
    "Frame",
    "HashBytes",
    "Heartbeat",
    "HeartbeatAck",
    "Hello",
    "KvBlocks",
    "LeaseRef",
    "LeaseRow",
    "Leases",
    "LeasesReply",
    "Name",
    "OkReply",
    "Queues",
    "QueuesReply",
    "Reattach",
    "Reattached",
    "RejectReason",
    "Rejected",
    "Release",
    "ReleaseOutcome",
    "Reload",
    "RemoveWorker",
    "RepliedDaemonFrame",
    "Replies",
    "RequestId",
    "Requeued",
    # codec
    "RouterFrame",
    "Slot",
    "Status",
    "StatusReply",
    "Tokens",
    "Undrain",
    "Update",
    "UpdateKind",
    "Welcome",
    # vocabulary
    "WorkerKey",
    "WorkerRow",
    "Workers",
    "WorkersReply",
    "batch_frames",
    "encode_batch",
    "encode_replies",
    "error_code_name",
    "hashes_to_bytes",
    "make_admin_reply_decoder",
    "make_admin_request_decoder",
    "make_batched_router_decoder",
    "make_daemon_decoder",
    "make_encoder",
    "make_replied_daemon_decoder",
    "make_router_decoder",
    "peek_admin_tag",
    "peek_request_id",
]
