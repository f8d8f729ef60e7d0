"""ExplainRing: the last admissions' per-worker figures for `kvsched explain`, in preallocated arrays.

The fused admission kernel (`shm.admit_kernels.admit_kv`) writes a decision's eligible mask, overlap,
projected blocks and prefill and its `kv` terms straight into the ring's row `head`; the Python path
(`Admitter._reserve`) copies the same figures in with one numpy assignment each. Per decision the
ring keeps one small tuple (request id, chosen row, time, the worker-table copies, and the costs or
the terms when they are not the `kv` selector's). Records are decoded only when asked
(`__getitem__`, `find`, `explain`), i.e. by `kvsched explain`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..protocol import ExplainReply, ExplainRow
from ..shm.select_kernels import KV_TERMS
from .selector import TermTable


class ExplainRing:
    """Ring of the last `capacity` admissions over `n_workers` worker rows.

    Arrays (row i = one admission): elig uint8[C, W], depth int32[C, W] (credited overlap blocks),
    blocks / prefill int64[C, W] (projected blocks / prefill tokens), terms float64[C, 5, W] (the
    `kv` terms in `KV_TERMS` order, when the decision's terms are those).
    Attributes:
        head: the row the next admission writes (the oldest record once the ring is full).
    Decoded record (`ring[k]`, k = -1 the newest): (request_id, row, now_us, elig, depth, blocks,
    prefill, costs or None, worker ids, dp ranks, present, terms or None) — the arrays are views of
    the ring (copy them to keep them past `capacity` further admissions).
    """

    def __init__(self, capacity: int, n_workers: int) -> None:
        self.capacity = capacity
        self.elig = np.zeros((capacity, n_workers), np.uint8)
        self.depth = np.zeros((capacity, n_workers), np.int32)
        self.blocks = np.zeros((capacity, n_workers), np.int64)
        self.prefill = np.zeros((capacity, n_workers), np.int64)
        self.terms = np.zeros((capacity, len(KV_TERMS), n_workers), np.float64)
        # (request_id, row, now_us, ids, costs, terms | None)
        self._meta: list[tuple[Any, ...] | None] = [None] * capacity
        self.head = 0
        self._n = 0

    def commit(self, request_id: str, row: int, now_us: int, ids: tuple[Any, ...]) -> None:
        """Record the admission whose arrays the fused kernel wrote in row `head` (kv terms)."""
        i = self.head
        self._meta[i] = (request_id, row, now_us, ids, None, None)
        self.head = (i + 1) % self.capacity
        if self._n < self.capacity:
            self._n += 1

    def add(
        self,
        request_id: str,
        row: int,
        now_us: int,
        elig: np.ndarray,
        depth: np.ndarray,
        blocks: np.ndarray,
        prefill: np.ndarray,
        costs: np.ndarray | None,
        ids: tuple[Any, ...],
        terms: dict[str, np.ndarray] | TermTable | None,
    ) -> None:
        """Record an admission of the Python path: its arrays are copied in; `costs` (float64[W]) are
        copied only without terms; terms are kept as given unless they are a `TermTable` of `KV_TERMS`
        (then copied into the ring's terms array)."""
        i = self.head
        self.elig[i] = elig
        self.depth[i] = depth
        self.blocks[i] = blocks
        self.prefill[i] = prefill
        table = terms if isinstance(terms, TermTable) and terms.names == KV_TERMS else None
        kv = table is not None
        if table is not None:
            self.terms[i] = table.rows
        if kv or terms:
            kept = None
        elif costs is None:
            raise ValueError("an admission recorded without terms needs its costs")
        else:
            kept = costs.copy()
        self._meta[i] = (request_id, row, now_us, ids, kept, None if kv else terms)
        self.head = (i + 1) % self.capacity
        if self._n < self.capacity:
            self._n += 1

    def lose_head(self) -> None:
        """The fused kernel wrote row `head` and then admitted nothing: the oldest record is gone."""
        if self._meta[self.head] is not None:
            self._meta[self.head] = None

    def __len__(self) -> int:
        return sum(1 for k in range(self._n) if self._meta[(self.head - 1 - k) % self.capacity] is not None)

    def _decode(self, i: int) -> tuple[Any, ...]:
        meta = self._meta[i]
        if meta is None:
            raise IndexError("explain ring record lost")
        request_id, row, now_us, ids, costs, terms = meta
        if terms is None and costs is None:
            terms = TermTable(KV_TERMS, self.terms[i])
        return (
            request_id,
            row,
            now_us,
            self.elig[i],
            self.depth[i],
            self.blocks[i],
            self.prefill[i],
            costs,
            *ids,
            terms,
        )

    def __getitem__(self, k: int) -> tuple[Any, ...]:
        """The k-th newest record for k < 0 (-1 = newest); IndexError past the records held."""
        if not -self._n <= k < 0:
            raise IndexError("explain ring index out of range")
        return self._decode((self.head + k) % self.capacity)

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        """Decoded records, oldest first (as a deque iterates)."""
        for k in range(self._n, 0, -1):
            i = (self.head - k) % self.capacity
            if self._meta[i] is not None:
                yield self._decode(i)

    def __reversed__(self) -> Iterator[tuple[Any, ...]]:
        """Decoded records, newest first."""
        for k in range(1, self._n + 1):
            i = (self.head - k) % self.capacity
            if self._meta[i] is not None:
                yield self._decode(i)

    def find(self, request_id: str) -> tuple[Any, ...] | None:
        """The newest record of `request_id`, decoded, or None."""
        for k in range(1, self._n + 1):
            i = (self.head - k) % self.capacity
            meta = self._meta[i]
            if meta is not None and meta[0] == request_id:
                return self._decode(i)
        return None

    def explain(self, request_id: str, decided_by: str = "") -> ExplainReply | None:
        """Per-worker rows of the most recent admission of `request_id` still held, or None;
        `decided_by` = the selector type that chose. Rows carry the selector's cost terms only when it
        picked the lowest cost (`WorkerSelector.terms`); without terms, `cost` is the projection's,
        for reference."""
        rec = self.find(request_id)
        if rec is None:
            return None
        _, row, now_us, elig, depth, blocks, prefill, costs, wid, rank, present, terms = rec
        total = sum(terms.values()) if terms else costs  # costs are kept only without terms
        rows = [
            ExplainRow(
                worker_id=int(wid[r]),
                dp_rank=int(rank[r]),
                eligible=bool(elig[r]),
                overlap_blocks=int(depth[r]),
                potential_blocks=int(blocks[r]),
                potential_prefill_tokens=int(prefill[r]),
                cost=float(total[r]) if elig[r] and np.isfinite(total[r]) else -1.0,
                terms={k: float(v[r]) for k, v in terms.items()} if elig[r] else {},
            )
            for r in np.flatnonzero(present).tolist()
        ]
        return ExplainReply(
            request_id=request_id,
            chosen_worker_id=int(wid[row]),
            chosen_dp_rank=int(rank[row]),
            decided_at_s=now_us / 1e6,
            rows=rows,
            decided_by=decided_by,
        )
