"""Plain value types shared by the core, the daemon and the simulator (no I/O, no policy).

`RequestSpec` is what the actor builds from an `Enqueue`; the core answers with small frozen
records (`Admit`, `Reject`) that the actor turns into frames, log lines and metrics (docs/DESIGN.md §10.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from ..protocol import RejectReason
from ..protocol import WorkerKey as WorkerKey  # re-exported: the core names workers by it

EMPTY_HASHES = np.zeros(0, dtype=np.uint64)

# The owner id of the daemon itself: requests made in process (the simulator, the warm-up) and
# leases re-adopted from the slot table after a restart (orphans, until a client claims them).
# Never a connection's id (connections count from 1); never capped, always alive.
DAEMON_OWNER = 0


class RequestSpec(msgspec.Struct, gc=False):
    """A request as the scheduler sees it (from one `Enqueue` frame).

    A mutable `msgspec.Struct` (not a dataclass): built once per Enqueue, it costs ~4x less to
    construct. Fields are positional or keyword, in this order; never encoded. `gc=False`: a spec
    refers to no object that could refer back to it, so it can never be part of a reference cycle.

    Attributes:
        request_id: unique among live requests of one daemon (<= 128 UTF-8 bytes).
        isl_tokens: prompt tokens (>= 1).
        block_hashes: uint64[n], chained prefix-block hashes, n <= ceil(isl_tokens / block_size).
        policy_class: class name as sent ("" = default class).
        priority: jump in seconds (fcfs/wspt) or vLLM priority (priority classes).
        strict_priority: higher first; outranks every score.
        session_id / lora_name: opaque tags used by admission policies.
        expected_osl: expected output tokens, or None.
        pinned: the one worker the request must run on, or None.
        allowed_workers: worker ids (all ranks) the request may run on, or None for any.
        do_not_queue: reject `do_not_queue` instead of waiting.
        deadline_us: absolute time (µs, scheduler clock) after which a waiting request times out.
        owner: opaque id of the connection that sent it (the actor's peer id); `DAEMON_OWNER` =
            in process.
        excluded_workers: worker ids (all ranks) the request must not run on, or None. The scheduler
            folds it into `allowed_workers` at enqueue (allowed, or every registered id, minus these).
    """

    request_id: str
    isl_tokens: int
    block_hashes: np.ndarray = EMPTY_HASHES  # the shared zero-length default
    policy_class: str = ""
    priority: int = 0
    strict_priority: int = 0
    session_id: str | None = None
    expected_osl: int | None = None
    pinned: WorkerKey | None = None
    allowed_workers: frozenset[int] | None = None
    do_not_queue: bool = False
    deadline_us: int | None = None
    lora_name: str | None = None
    owner: int = DAEMON_OWNER
    excluded_workers: frozenset[int] | None = None


@dataclass(frozen=True, slots=True)
class CostSnapshot:
    """Prefill cost taken at enqueue (docs/DESIGN.md §4.3): drives WSPT and DRR; not recomputed while waiting
    (except when an admission policy pins the request).

    Attributes:
        isl_tokens: raw prompt tokens.
        cached_tokens: prompt tokens cached on the pinned worker, else on the best eligible worker.
        uncached_tokens: isl_tokens - cached_tokens.
        cost: max(1, uncached_tokens), in tokens.
    """

    isl_tokens: int
    cached_tokens: int
    uncached_tokens: int
    cost: int

    @staticmethod
    def of(isl_tokens: int, cached_tokens: int) -> CostSnapshot:
        cached = max(0, min(cached_tokens, isl_tokens))
        uncached = isl_tokens - cached
        return CostSnapshot(isl_tokens, cached, uncached, max(1, uncached))


class Admit(msgspec.Struct, frozen=True, gc=False):
    """Decision: `request_id` runs on `worker` under lease (slot, generation).

    A frozen `msgspec.Struct` (as `Reject`): one is built per admission, ~15x faster than a frozen
    dataclass (whose `__init__` goes through `object.__setattr__` per field). Positional or keyword
    fields in this order; equal when every field is; hashable. `gc=False`: it holds only strings,
    ints and a `WorkerKey`, so it can never be part of a reference cycle.
    """

    request_id: str
    owner: int
    worker: WorkerKey
    slot: int
    generation: int
    overlap_blocks: int  # prompt blocks cached on the chosen worker
    cached_tokens: int  # prompt tokens cached on the chosen worker
    queued_us: int  # time spent waiting in the scheduler (µs)
    policy_class: str = ""


class Reject(msgspec.Struct, frozen=True, gc=False):
    """Decision: `request_id` will not run. `reason` is a rejection reason of docs/DESIGN.md §2.4.
    A frozen `msgspec.Struct` like `Admit`."""

    request_id: str
    owner: int
    reason: RejectReason
    detail: str = ""
    policy_class: str = ""
    limit_kind: str | None = None
    current: int | None = None
    limit: int | None = None
    revoked: bool = False  # a notice to the holder of a lease (not the answer to an Enqueue)
