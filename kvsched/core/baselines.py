"""Published routing policies re-implemented as baselines over the daemon's per-row view
(docs/ROUTING.md gives each source). Pure `select`; no state beyond the RNG.

* `lmetric` — LMetric (Zhang et al., "Simple is Better – Multiplication May Be All You Need for LLM
  Request Scheduling", 2026): score = new prefill tokens if routed there x current batch size; lowest wins.
* `llmd` — llm-d's inference scheduler default profile: weighted scorers prefix-cache 3, queue 2,
  KV-cache utilisation 2, each in [0, 1], max-score pick with a random tie-break.
* `llmd_sticky` — the same scorers behind llm-d's "sticky until saturated" prefix-affinity filter: keep
  only the rows with the deepest overlap while their uncached in-flight prefill tokens stay <= tau,
  tau = 35 x max_num_batched_tokens (llm-d's documented example: peak prefill throughput x the
  largest TTFT penalty accepted).
"""

from __future__ import annotations

import numpy as np

from .selector import SelectionView, WorkerSelector

LLMD_WEIGHTS = (3.0, 2.0, 2.0)  # prefix-cache, queue, KV-cache utilisation (llm-d default profile)
LLMD_STICKY_TAU_STEPS = 35.0  # tau in units of max_num_batched_tokens (llm-d's documented example)


class LMetricSelector(WorkerSelector):
    """Lowest (isl - cached_w) x active_requests_w; ties: fewer new prefill tokens, then random.

    An idle row has batch size 0 and so score 0 (the paper's "both indicators zero" corner): the
    tie-break on new prefill tokens keeps prefix locality there. Without a view, new prefill tokens
    are taken as equal on every row.
    """

    name = "lmetric"

    def select(self, costs: np.ndarray, eligible: np.ndarray, active_requests: np.ndarray, *,
               overlap_blocks: np.ndarray | None = None, request_blocks: int = 0,
               view: SelectionView | None = None) -> int:
        rows = np.flatnonzero(eligible)
        if rows.size == 0:
            return -1
        if view is not None:
            new = np.maximum(0, view.isl_tokens - np.minimum(view.isl_tokens, overlap_blocks[rows].astype(np.int64) * view.block_size)) \
                if overlap_blocks is not None else np.full(rows.size, view.isl_tokens, np.int64)
        else:
            new = np.ones(rows.size, np.int64)
        score = new * active_requests[rows]
        best = score == score.min()
        rows, new = rows[best], new[best]
        return self._pick(rows[new == new.min()])


def llmd_scores(eligible: np.ndarray, active_requests: np.ndarray, overlap_blocks: np.ndarray | None,
                request_blocks: int, view: SelectionView | None) -> np.ndarray:
    """float64[W] llm-d weighted score (higher wins) at eligible rows, -inf elsewhere.

    prefix = overlap / request blocks; queue = (max - q) / (max - min) over eligible rows (1 when all
    equal), q = active requests (the daemon sees bookings, not the engine's waiting queue); KV
    utilisation score = 1 - active blocks / total blocks (0 without a view).
    """
    ok = eligible != 0
    n = eligible.shape[0]
    prefix = np.zeros(n)
    if overlap_blocks is not None and request_blocks > 0:
        prefix = np.minimum(1.0, overlap_blocks / float(request_blocks))
    q = active_requests.astype(np.float64)
    lo, hi = (q[ok].min(), q[ok].max()) if ok.any() else (0.0, 0.0)
    queue = np.ones(n) if hi <= lo else (hi - q) / (hi - lo)
    kv = np.zeros(n)
    if view is not None:
        kv = 1.0 - np.minimum(1.0, view.active_blocks / np.maximum(1, view.total_kv_blocks))
    wp, wq, wk = LLMD_WEIGHTS
    return np.where(ok, wp * prefix + wq * queue + wk * kv, -np.inf)


class LlmdSelector(WorkerSelector):
    """Max llm-d weighted score (`llmd_scores`), random tie-break."""

    name = "llmd"

    def select(self, costs: np.ndarray, eligible: np.ndarray, active_requests: np.ndarray, *,
               overlap_blocks: np.ndarray | None = None, request_blocks: int = 0,
               view: SelectionView | None = None) -> int:
        rows = np.flatnonzero(eligible)
        if rows.size == 0:
            return -1
        s = llmd_scores(eligible, active_requests, overlap_blocks, request_blocks, view)[rows]
        return self._pick(rows[s == s.max()])


class LlmdStickySelector(LlmdSelector):
    """`llmd` after the sticky-until-saturated filter (module docstring): if some row has overlap > 0,
    keep the deepest-overlap rows whose uncached in-flight prefill tokens (active prefill) are <= tau;
    if none of them is under tau, the filter is released and every eligible row competes."""

    name = "llmd_sticky"

    def select(self, costs: np.ndarray, eligible: np.ndarray, active_requests: np.ndarray, *,
               overlap_blocks: np.ndarray | None = None, request_blocks: int = 0,
               view: SelectionView | None = None) -> int:
        if overlap_blocks is not None and view is not None:
            rows = np.flatnonzero(eligible)
            if rows.size:
                depth = overlap_blocks[rows]
                top = int(depth.max())
                if top > 0:
                    tau = LLMD_STICKY_TAU_STEPS * view.max_batched_tokens[rows]
                    keep = rows[(depth == top) & (view.active_prefill[rows] <= tau)]
                    if keep.size:
                        mask = np.zeros_like(eligible)
                        mask[keep] = 1
                        eligible = mask
        return super().select(costs, eligible, active_requests, overlap_blocks=overlap_blocks,
                              request_blocks=request_blocks, view=view)
