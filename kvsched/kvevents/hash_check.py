"""Do the engines hash blocks the way routers do? A check on first-of-chain `BlockStored` events.

The silent failure of KV-event routing is a hash mismatch: the engine publishes hashes the routers
never send (another `PYTHONHASHSEED`, hash algorithm, block size or extra-key shape; docs/VLLM.md),
so the event-fed index never matches and every request scores zero overlap, with nothing in the
logs. A `BlockStored` event whose `parent_block_hash` is None starts a chain and carries its blocks'
`token_ids` and `block_size`: its first blocks' hashes can be recomputed here with
`block_hashes(mode="vllm", hash_seed=...)` (and the event's own `extra_keys`) and compared with
the event's. Pure (time comes in as `now_us`); the daemon logs, counts and flags the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..hashing import block_hashes
from .format import DecodedBatch, Stored


@dataclass(slots=True)
class Mismatch:
    """The latest failed check of a worker row: the event's first hash and the recomputed one."""

    row: int
    event_hash: int
    expected_hash: int  # -1 when the block sizes differ (nothing to recompute)
    block_size: int  # the event's
    at_us: int


@dataclass(slots=True)
class HashCheck:
    """Recompute up to `max_blocks` leading blocks of first-of-chain events, at most
    `max_checks_per_s` events per row per second (cost: one SHA-256 per block).

    Attributes:
        hash_seed: the daemon's `kv_hash_seed`, which routers hash with (`Welcome.hash_seed`,
            `SchedulerClient.block_hashes`); None = vLLM >= 0.29's default.
        block_size: the daemon's block size (routers hash with it); an event of another size is a
            mismatch without recomputing. None = take the event's.
        checked / mismatches: events checked / found different (monotonic counters).
        bad_rows: row -> its latest `Mismatch`; a later matching event of the row clears it.
    """

    hash_seed: str | None = None
    block_size: int | None = None
    max_blocks: int = 4
    max_checks_per_s: float = 20.0
    checked: int = 0
    mismatches: int = 0
    bad_rows: dict[int, Mismatch] = field(default_factory=dict)
    _next_us: dict[int, int] = field(default_factory=dict)

    def observe(self, row: int, batch: DecodedBatch, now_us: int) -> Mismatch | None:
        """Check the batch's first-of-chain group-0 events (rate-limited). Returns the mismatch
        found in this batch, if any."""
        found = None
        for ev in batch.events:
            if not (
                isinstance(ev, Stored)
                and ev.parent_key is None
                and ev.group_idx == 0
                and ev.token_ids
                and ev.block_size
            ):
                continue
            if now_us < self._next_us.get(row, 0):
                return found
            self._next_us[row] = now_us + int(1e6 / self.max_checks_per_s)
            if self.block_size is not None and ev.block_size != self.block_size:
                self.checked += 1
                self.mismatches += 1
                found = self.bad_rows[row] = Mismatch(
                    row, int(ev.keys[0]) if len(ev.keys) else 0, -1, ev.block_size, now_us
                )
                continue
            got = self.check_event(ev)
            if got is None:
                continue
            self.checked += 1
            if got[0] == got[1]:
                self.bad_rows.pop(row, None)
            else:
                self.mismatches += 1
                found = self.bad_rows[row] = Mismatch(row, got[0], got[1], ev.block_size, now_us)
        return found

    def check_event(self, ev: Stored) -> tuple[int, int] | None:
        """(event's first hash, recomputed first hash) — equal when the engine hashes like routers;
        None when the event cannot be checked (no complete block, malformed tokens or extra keys).
        Compares every checked block, reporting the first that differs."""
        bs, token_ids = ev.block_size, ev.token_ids
        if not bs or not token_ids:  # `observe` passes only events with both
            return None
        n = min(self.max_blocks, len(ev.keys), len(token_ids) // bs)
        if n < 1:
            return None
        extra = ev.extra_keys[:n] if ev.extra_keys is not None and len(ev.extra_keys) >= n else None
        try:
            mine = block_hashes(
                np.asarray(token_ids[: n * bs]), bs, mode="vllm", hash_seed=self.hash_seed, extra_keys=extra
            )
        except (TypeError, ValueError, OverflowError):
            return None
        theirs = ev.keys[:n]
        diff = np.flatnonzero(mine != theirs)
        i = int(diff[0]) if diff.size else 0
        return int(theirs[i]), int(mine[i])
