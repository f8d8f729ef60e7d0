"""The closed sets of values frame fields carry: `WorkerKey` (which worker), reject reasons, update
kinds, release outcomes and the `ErrorCode`s of `Error` / `AdminError` frames (docs/PROTOCOL.md)."""

from __future__ import annotations

import enum
from typing import Literal, NamedTuple, get_args


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
REJECT_REASONS: tuple[str, ...] = get_args(RejectReason)

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


def error_code_name(code: int) -> str:
    """The lower-case name of an `ErrorCode` (`9` -> "not_found"), or "code N" for an unknown one:
    what messages for people show instead of the bare number."""
    try:
        return ErrorCode(code).name.lower()
    except ValueError:
        return f"code {code}"
