"""The hot-path frames of protocol version 1, router → daemon and daemon → router (docs/PROTOCOL.md,
"Router → daemon" and "Daemon → router"): msgspec structs encoded as MessagePack arrays, tag first.

Fields are only ever appended, each with a default (`Hello.pid_ns`, `Reattach.requeues` and
`Welcome.max_frame_bytes` were appended in protocol revision 2); the bounds are in the field types
(`kvsched.protocol.limits`). The version-2 messages that carry several of these frames are in
`kvsched.protocol.batching`.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from .limits import I32, MAX_LIST, U16, U32, U63, HashBytes, Name, RequestId, Slot, Tokens
from .vocabulary import RejectReason, ReleaseOutcome, UpdateKind

# --------------------------------------------------------------------------------------------
# Router → daemon
# --------------------------------------------------------------------------------------------


class Frame(msgspec.Struct, frozen=True, array_like=True, tag_field="t", omit_defaults=True):
    """Base of the hot-path frames: immutable, encoded as a MessagePack array, tag first."""


class Hello(Frame, tag="hello", frozen=True):
    """First frame on a connection. Router → daemon; answered by `Welcome` or `Error(VERSION)`."""

    protocol_version: U16
    client_name: Name = ""
    pid: Annotated[int, Meta(ge=0, le=2**31 - 1)] = 0  # 0 = remote / unknown, no pid watch
    host: Name = ""
    # inode of the sender's /proc/self/ns/pid; 0 = unknown (no pid watch). Appended in protocol rev. 2.
    pid_ns: U63 = 0


class Enqueue(Frame, tag="enqueue", frozen=True):
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


class Update(Frame, tag="update", frozen=True):
    """Progress of an admitted request. Router → daemon; no reply, except `requeue` which is
    answered by one later `Admitted` or `Rejected` (with a new slot / generation).

    Keyed by (request_id, slot, generation); a stale key is ignored (counted).
    """

    request_id: RequestId
    slot: Annotated[int, Meta(ge=0, le=2**31 - 1)]
    generation: U32
    kind: UpdateKind
    output_tokens: Tokens | None = None  # for kind == "progress": output tokens so far


class Release(Frame, tag="release", frozen=True):
    """End of a request. Router → daemon; no reply; idempotent.

    `cancelled` with slot -1 removes a queued or deferred request.
    """

    request_id: RequestId
    slot: Slot = -1
    generation: U32 = 0
    outcome: ReleaseOutcome = "completed"
    context_tokens: Tokens = 0  # isl + output tokens, for admission policies


class Heartbeat(Frame, tag="heartbeat", frozen=True):
    """Liveness ping. Answered by `HeartbeatAck`.

    Sent by a client's heartbeat thread on its own DEALER with `conn_token` = the data connection's
    `Welcome.conn_token`: the daemon credits that data connection (docs/PROTOCOL.md, "Liveness").
    On the data connection itself (`conn_token` 0, the protocol-1/2 form) it credits the sender.
    """

    seq: U63
    conn_token: U63 = 0  # appended in protocol rev. 3 ("Daemon edges"): 0 = the sender's own connection


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


class Reattach(Frame, tag="reattach", frozen=True):
    """Sent after reconnecting to a (restarted) daemon. Answered by `Reattached`, then by one
    `Admitted`/`Rejected` per `requeues` entry and per pending Enqueue.

    `requeues` (appended in protocol rev. 2): a daemon that still books the lease releases it first;
    the request then waits again with its original queue position when the daemon still holds it,
    else it is enqueued again (before `pending`).
    """

    leases: Annotated[list[LeaseRef], Meta(max_length=MAX_LIST)] = []
    pending: Annotated[list[Enqueue], Meta(max_length=MAX_LIST)] = []
    requeues: Annotated[list[Requeued], Meta(max_length=MAX_LIST)] = []


# --------------------------------------------------------------------------------------------
# Daemon → router
# --------------------------------------------------------------------------------------------


class Welcome(Frame, tag="welcome", frozen=True):
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
    # appended with "Daemon edges" (docs/PROTOCOL.md, "Liveness"): the token a client's heartbeat DEALER
    # carries so that its heartbeats credit this data connection; 0 = not announced (older daemon)
    conn_token: U63 = 0
    # appended with "Daemon edges": the daemon's `kv_hash_seed`, the one seed routers hash block_hashes
    # with (`SchedulerClient.block_hashes`); None = vLLM >= 0.29's default seed
    hash_seed: Name | None = None


class Admitted(Frame, tag="admitted", frozen=True):
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


class Rejected(Frame, tag="rejected", frozen=True):
    """The request will not run; `reason` is one of `REJECT_REASONS`."""

    request_id: str
    reason: RejectReason
    detail: str = ""
    policy_class: str = ""
    limit_kind: str | None = None
    current: int | None = None
    limit: int | None = None


class Error(Frame, tag="error", frozen=True):
    """A frame that could not be decoded or was out of order; sent to its sender only."""

    code: int
    message: str
    request_id: str | None = None
    batch_index: int | None = None  # position of the offending frame inside a `Batch`


class HeartbeatAck(Frame, tag="heartbeat_ack", frozen=True):
    """Answer to `Heartbeat` with the same seq."""

    seq: int


class Reattached(Frame, tag="reattached", frozen=True):
    """Answer to `Reattach`: which leases the daemon kept and which it had already released."""

    kept: list[str] = []
    lost: list[str] = []
