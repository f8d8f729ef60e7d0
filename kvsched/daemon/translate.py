"""Frames ↔ core records, as pure functions: an `Enqueue` frame becomes the core's `RequestSpec`,
an `Admit` / `Reject` record becomes an `Admitted` / `Rejected` frame (docs/PROTOCOL.md), and the
frame-level checks an `Enqueue` passes before the Scheduler sees it. No socket, no Scheduler call:
the actor dispatches frames, calls the Scheduler and sends.
"""

from __future__ import annotations

import numpy as np

from .. import protocol as p
from ..core.types import Admit, Reject, RequestSpec
from ..protocol import WorkerKey

_HASH_DTYPE = np.dtype("<u8")  # a dtype object: np.frombuffer parses a dtype string on every call (~0.6 µs)


def enqueue_problem(
    f: p.Enqueue, accepting: bool, inflight: int, inflight_cap: int
) -> tuple[p.RejectReason, str] | None:
    """The (reason, detail) an `Enqueue` is rejected with before it reaches the Scheduler, or None:
    `shutting_down` once the daemon stops accepting, `overloaded` at the connection's in-flight cap,
    `invalid` for a request id longer than `p.MAX_REQUEST_ID_BYTES` UTF-8 bytes or block hashes whose
    length is not a multiple of 8 bytes (docs/PROTOCOL.md `enqueue`)."""
    if not accepting:
        return "shutting_down", "the daemon is stopping"
    if inflight >= inflight_cap:
        return "overloaded", f"in-flight cap {inflight_cap} reached on this connection"
    rid = f.request_id  # at most 4 UTF-8 bytes per character: short ids are not encoded to be measured
    if 4 * len(rid) > p.MAX_REQUEST_ID_BYTES and len(rid.encode()) > p.MAX_REQUEST_ID_BYTES:
        return "invalid", f"request_id longer than {p.MAX_REQUEST_ID_BYTES} UTF-8 bytes"
    if len(f.block_hashes) % 8:
        return "invalid", "block_hashes length is not a multiple of 8 bytes"
    return None


def spec_from_enqueue(f: p.Enqueue, owner: int, t: int) -> RequestSpec:
    """The core's `RequestSpec` of an `Enqueue` frame from connection `owner`, received at `t` (µs).
    `block_hashes` is a read-only uint64 view of the frame's bytes (no copy)."""
    return RequestSpec(
        request_id=f.request_id,
        isl_tokens=f.isl_tokens,
        block_hashes=np.frombuffer(f.block_hashes, _HASH_DTYPE),
        policy_class=f.policy_class,
        priority=f.priority,
        strict_priority=f.strict_priority,
        session_id=f.session_id,
        expected_osl=f.expected_osl,
        pinned=WorkerKey(*f.pinned) if f.pinned else None,
        allowed_workers=frozenset(f.allowed_workers) if f.allowed_workers is not None else None,
        do_not_queue=f.do_not_queue,
        deadline_us=t + f.deadline_ms * 1000 if f.deadline_ms is not None else None,
        lora_name=f.lora_name,
        owner=owner,
        excluded_workers=frozenset(f.excluded_workers) if f.excluded_workers else None,
    )


def admitted_frame(o: Admit, url: str, ranks: int) -> p.Admitted:
    """The `Admitted` frame of an admission; `url` is the worker's base URL ("" = none), `ranks` its
    registered data-parallel ranks (sent as at least 1)."""
    w = o.worker
    return p.Admitted(
        o.request_id,
        w.worker_id,
        w.dp_rank,
        o.slot,
        o.generation,
        o.overlap_blocks,
        o.cached_tokens,
        o.queued_us,
        url,
        ranks or 1,
    )


def rejected_frame(o: Reject) -> p.Rejected:
    """The `Rejected` frame of a rejection record."""
    return p.Rejected(o.request_id, o.reason, o.detail, o.policy_class, o.limit_kind, o.current, o.limit)
