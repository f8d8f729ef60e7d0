"""Per-connection share of a class's queue limits, work-conserving: a lone router may fill a class,
and a second router still gets its share of a class the first one filled.

A class with `request_queue_limit_per_worker` / `isl_token_queue_limit_per_worker` holds
`limit = per_worker x worker ids` waiting requests / ISL tokens (`PolicyClassQueue.check_limits`).
Each connection (owner) has a share of each limit: `share = max(1, floor(max_waiting_share x limit))`.
Per class and per limit kind:

* alone (no other connection has requests waiting in the class), a connection may fill the class
  limit: past it the answer is `queue_full`, never `overloaded`;
* while another connection has requests waiting there, a connection holding its share or more is
  refused `overloaded` (with limit_kind / current / limit = its share) until it is back under it;
* a connection below its share is accepted in a full class while another connection holds more than
  its share; all such acceptances together overrun the limit by at most one share (`room`).

Like the class limits, shares are checked before adding: the request that crosses one is accepted.
A class without limits has no share; `max_waiting_share = 1.0` leaves only the class limits; the
daemon itself (`DAEMON_OWNER`: adopted leases) is not a connection and is never capped.
Documented in docs/DESIGN.md §5.9 and docs/PROTOCOL.md ("Rejection reasons", `overloaded`).

Counts follow waiting requests only (ready or deferred); each counted request remembers the key it
was counted under, so a profile reload that renumbers classes can never make a count go negative.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ..config import ClassConfig
from .class_queue import LimitExceeded
from .live import Live
from .types import DAEMON_OWNER

KINDS = ("requests", "isl_tokens")  # the limit kinds, in the order they are checked (index into a count row)


class WaitingShares:
    """class index -> owner -> [waiting requests, waiting ISL tokens].

    Invariant: a row exists only while its owner has at least one waiting request in that class.
    """

    def __init__(self, share: float) -> None:
        self.share = share  # max_waiting_share, in (0, 1]
        self._counts: dict[int, dict[int, list[int]]] = {}

    def share_sizes(self, cfg: ClassConfig, n_worker_ids: int) -> tuple[int | None, int | None]:
        """One connection's share of each limit of the class (requests, ISL tokens); None where the
        class has no such limit or `max_waiting_share` is 1.0 (the class limit alone applies)."""
        return (
            self._share_of(cfg.request_queue_limit_per_worker, n_worker_ids),
            self._share_of(cfg.isl_token_queue_limit_per_worker, n_worker_ids),
        )

    def _share_of(self, per_worker: int | None, n_worker_ids: int) -> int | None:
        if per_worker is None or self.share >= 1.0:
            return None
        return max(1, math.floor(self.share * per_worker * n_worker_ids))

    def check(self, owner: int, class_idx: int, cfg: ClassConfig, n_worker_ids: int) -> LimitExceeded | None:
        """The share this request is refused `overloaded` for, or None: the owner holds its share or more
        of a limit while another connection has requests waiting in the class (checked before adding)."""
        if owner == DAEMON_OWNER:
            return None
        rows = self._counts.get(class_idx)
        if not rows or not self._others(rows, owner):
            return None  # alone: the class limit is the only bound
        held = rows.get(owner, (0, 0))
        for i, cap in enumerate(self.share_sizes(cfg, n_worker_ids)):
            if cap is not None and held[i] >= cap:
                return LimitExceeded(KINDS[i], held[i], cap)
        return None

    def room(self, owner: int, class_idx: int, cfg: ClassConfig, n_worker_ids: int) -> tuple[int, int]:
        """How far past each class limit (requests, ISL tokens) this owner's request may still be
        accepted: one share of a limit when the owner is below its share of it and another connection
        holds more than its share; else 0."""
        rows = self._counts.get(class_idx)
        if owner == DAEMON_OWNER or not rows or not self._others(rows, owner):
            return 0, 0
        held = rows.get(owner, (0, 0))
        out = [0, 0]
        for i, cap in enumerate(self.share_sizes(cfg, n_worker_ids)):
            if (
                cap is not None
                and held[i] < cap
                and any(row[i] > cap for o, row in rows.items() if o != owner and o != DAEMON_OWNER)
            ):
                out[i] = cap
        return out[0], out[1]

    @staticmethod
    def _others(rows: dict[int, list[int]], owner: int) -> bool:
        """Does a connection other than `owner` (the daemon is none) have requests waiting?"""
        return len(rows) > (owner in rows) + (DAEMON_OWNER in rows)

    def add(self, live: Live) -> None:
        """Count a request that starts waiting (idempotent)."""
        if live.share_key is not None:
            return
        owner, class_idx = live.spec.owner, live.entry.class_idx
        row = self._counts.setdefault(class_idx, {}).setdefault(owner, [0, 0])
        row[0] += 1
        row[1] += live.spec.isl_tokens
        live.share_key = (owner, class_idx)

    def remove(self, live: Live) -> None:
        """Uncount a request that stops waiting (admitted, cancelled, timed out, dropped); no-op
        when it was not counted."""
        key = live.share_key
        if key is None:
            return
        live.share_key = None
        owner, class_idx = key
        rows = self._counts.get(class_idx)
        if rows is None:
            return
        row = rows.get(owner)
        if row is None:
            return
        row[0] -= 1
        row[1] -= live.spec.isl_tokens
        if row[0] <= 0:
            del rows[owner]
            if not rows:
                del self._counts[class_idx]

    def forget_owner(self, owner: int) -> None:
        """Uncount every waiting request of `owner` at once, O(classes): its router is gone and the
        caller drops all of them (their `share_key`s go with them)."""
        for class_idx in [c for c, rows in self._counts.items() if owner in rows]:
            rows = self._counts[class_idx]
            del rows[owner]
            if not rows:
                del self._counts[class_idx]

    def rebuild(self, waiting: Iterable[Live]) -> None:
        """Recount from scratch (after a profile reload renumbered the classes)."""
        self._counts.clear()
        for live in waiting:
            live.share_key = None
            self.add(live)

    def of(self, owner: int, class_idx: int) -> tuple[int, int]:
        """(waiting requests, waiting ISL tokens) of `owner` in class `class_idx`."""
        n, isl = self._counts.get(class_idx, {}).get(owner, (0, 0))
        return n, isl
