"""Live: the record of one live request (waiting, deferred or leased) and its states; `LeaseTable`
(core/leases.py) holds them by id, slot and owner, and the queues, the policy feed and the waiting
shares read them."""

from __future__ import annotations

from typing import Any

import msgspec

from .ordering import QueueEntry
from .types import RequestSpec

READY, DEFERRED, LEASED, GONE = "ready", "deferred", "leased", "gone"


class Live(msgspec.Struct, eq=False):
    """One live request (waiting, deferred or leased); `entry.payload is self` until it is dropped.
    A mutable `msgspec.Struct` (one per request; ~4x cheaper to build than a slots dataclass);
    `eq=False`: compared and hashed by identity.

    Attributes:
        spec: the request as enqueued.
        entry: its queue entry (ordering inputs, cost, placement = effective pin, class index).
        state: "ready" (queued), "deferred" (held by the admission policy), "leased" or "gone".
        slot / generation: the lease while leased, else -1 / 0.
        tracked: the class's admission policy receives this request's events.
        told_dispatched: Dispatched was already sent to the policy (at most once).
        deadline_us: absolute queue-wait deadline (µs), or None.
        wait_token: bumps on every (re)queue so stale timeout heap items are skipped.
        wrote: what its admission added to the overlap indexes while leased (`OverlapView.record`),
            else None.
        share_key: the (owner, class) key of `WaitingShares` while it is counted as waiting.
    """

    spec: RequestSpec
    entry: QueueEntry
    state: str = READY
    slot: int = -1
    generation: int = 0
    tracked: bool = False
    told_dispatched: bool = False
    deadline_us: int | None = None
    wait_token: int = 0
    wrote: tuple[Any, ...] | None = None
    share_key: tuple[int, int] | None = None
