"""Per-connection share of a class's queue limits: one connection cannot fill a class.

A class with `request_queue_limit_per_worker` / `isl_token_queue_limit_per_worker` holds at most
`limit = per_worker x worker ids` waiting requests / ISL tokens. Without a per-connection cap, one
router that pipelines thousands of requests fills the class and every other router gets `queue_full`
(even for an idle worker). Each owner (connection) may therefore hold at most
`max(1, floor(max_waiting_share x limit))` of each limit; past it the request is rejected `overloaded`
(with limit_kind / current / limit). A class without limits has no share cap. Documented in
docs/PROTOCOL.md ("Rejection reasons", `overloaded`).

Counts follow waiting requests only (ready or deferred); each counted request remembers the key it
was counted under, so a profile reload that renumbers classes can never make a count go negative.
"""

from __future__ import annotations

import math

from ..config import ClassConfig
from .class_queue import LimitExceeded
from .types import DAEMON_OWNER


class WaitingShares:
    """(owner, class index) -> [waiting requests, waiting ISL tokens]."""

    def __init__(self, share: float) -> None:
        self.share = share
        self._counts: dict[tuple[int, int], list[int]] = {}

    def check(self, owner: int, class_idx: int, isl_tokens: int, cfg: ClassConfig,
              n_worker_ids: int) -> LimitExceeded | None:
        """The per-owner cap this request would cross (checked before adding, like the class
        limits), or None. `DAEMON_OWNER` (the daemon itself) and a share of 1.0 are never capped."""
        if owner == DAEMON_OWNER or self.share >= 1.0:
            return None
        n, isl = self._counts.get((owner, class_idx), (0, 0))
        if cfg.request_queue_limit_per_worker is not None:
            cap = max(1, math.floor(self.share * cfg.request_queue_limit_per_worker * n_worker_ids))
            if n >= cap:
                return LimitExceeded("requests", n, cap)
        if cfg.isl_token_queue_limit_per_worker is not None:
            cap = max(1, math.floor(self.share * cfg.isl_token_queue_limit_per_worker * n_worker_ids))
            if isl >= cap:
                return LimitExceeded("isl_tokens", isl, cap)
        return None

    def add(self, live) -> None:  # noqa: ANN001 - a dispatch.Live
        """Count a request that starts waiting (idempotent)."""
        if live.share_key is not None:
            return
        key = (live.spec.owner, live.entry.class_idx)
        row = self._counts.setdefault(key, [0, 0])
        row[0] += 1
        row[1] += live.spec.isl_tokens
        live.share_key = key

    def remove(self, live) -> None:  # noqa: ANN001
        """Uncount a request that stops waiting (admitted, cancelled, timed out, dropped); no-op
        when it was not counted."""
        key = live.share_key
        if key is None:
            return
        live.share_key = None
        row = self._counts.get(key)
        if row is None:
            return
        row[0] -= 1
        row[1] -= live.spec.isl_tokens
        if row[0] <= 0:
            del self._counts[key]

    def rebuild(self, waiting) -> None:  # noqa: ANN001 - iterable of waiting Live
        """Recount from scratch (after a profile reload renumbered the classes)."""
        self._counts.clear()
        for live in waiting:
            live.share_key = None
            self.add(live)

    def of(self, owner: int, class_idx: int) -> tuple[int, int]:
        """(waiting requests, waiting ISL tokens) of `owner` in class `class_idx`."""
        n, isl = self._counts.get((owner, class_idx), (0, 0))
        return n, isl
