"""The routing baselines kvsched's `kv` selector is measured against (bench/bench_routing.py,
docs/BENCHMARKS.md): published policies re-implemented over the daemon's per-row view, registered in
the `kvsched.selectors` entry-point group by this distribution (bench/pyproject.toml), so a daemon or
a virtual replay with `[selector] type = "<name>"` runs them once `kvsched-bench` is installed
(`make bench`, `make test`). docs/ROUTING.md gives each source. Pure `select`; the only state is the
RNG and, for `cache_aware`, the per-row cache sizes grown by `note_admitted`.

* `dynamo_cost` — NVIDIA Dynamo's kv-router cost with its defaults (kvsched's default before `kv`):
  the projection's cost (`prefill_load_scale`, `overlap_credit` of the `[selector]` table), lowest wins.
* `cache_aware` — SGLang router's cache-aware policy over block prefixes.
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

from kvsched.core.selector import CostSelector, SelectionView, WorkerSelector


class DynamoCostSelector(CostSelector):
    """Lowest Dynamo cost (the kernel's `costs`): `prefill_load_scale x max(0, (active prefill + isl)/B
    - overlap_credit x overlap) + projected active blocks` (NVIDIA Dynamo kv-router's cost and defaults;
    docs/ROUTING.md); `CostSelector` picks (temperature 0: argmin, random tie-break; T > 0: softmax)."""

    name = "dynamo_cost"

    def terms(
        self, costs: np.ndarray, eligible: np.ndarray, overlap_blocks: np.ndarray, view: SelectionView
    ) -> dict[str, np.ndarray]:
        """ "prefill" (scale x clamped prefill blocks) and "active_blocks" (projected), summing to `costs`."""
        active = np.where(eligible != 0, view.blocks, 0).astype(np.float64)
        return {"prefill": costs - active, "active_blocks": active}


class CacheAwareSelector(WorkerSelector):
    """Baseline in the style of SGLang's cache-aware router, over block prefixes instead of text.

    Per request: if the eligible rows' active requests are imbalanced (max − min > `balance_abs`
    and max > `balance_rel` × min), the least-loaded row (random tie-break). Otherwise, if the best
    prefix match covers more than `cache_threshold` of the request's blocks, the row with that
    longest match (ties: fewer active requests); else the row with the smallest approximate cache,
    where a row's cache grows by the blocks of each request routed to it that it did not match yet
    (SGLang's per-worker tree size; its eviction at 2^26 characters is never reached here).
    Defaults are SGLang's published ones (abs 64, rel 1.5, threshold 0.3).
    State: the per-row cache sizes (blocks), grown by `note_admitted` (after a reservation), never
    by `select`.
    """

    name = "cache_aware"
    learnt = ("cache_blocks",)

    def __init__(
        self, seed: int | None = None, cache_threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5
    ) -> None:
        super().__init__(seed)
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.cache_blocks = np.zeros(0, np.int64)  # row -> approximate blocks cached (grows on demand)

    def select(
        self,
        costs: np.ndarray,
        eligible: np.ndarray,
        active_requests: np.ndarray,
        *,
        overlap_blocks: np.ndarray | None = None,
        request_blocks: int = 0,
        view: SelectionView | None = None,
    ) -> int:
        rows = np.flatnonzero(eligible)
        if rows.size == 0:
            return -1
        self._grow(eligible.size)
        load = active_requests[rows]
        lo, hi = int(load.min()), int(load.max())
        depth = overlap_blocks[rows] if overlap_blocks is not None else np.zeros(rows.size, np.int64)
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            row = self._pick(rows[load == lo])
        elif request_blocks > 0 and depth.max() / request_blocks > self.cache_threshold:
            best = rows[depth == depth.max()]
            best_load = active_requests[best]
            row = self._pick(best[best_load == best_load.min()])
        else:
            size = self.cache_blocks[rows]
            row = self._pick(rows[size == size.min()])
        return row

    def note_admitted(self, row: int, overlap_blocks: int, request_blocks: int) -> None:
        """The row's approximate cache grows by the request's blocks it did not match yet."""
        self._grow(row + 1)
        self.cache_blocks[row] += max(0, request_blocks - overlap_blocks)

    def _grow(self, size: int) -> None:
        if self.cache_blocks.size < size:
            self.cache_blocks = np.concatenate([self.cache_blocks, np.zeros(size - self.cache_blocks.size, np.int64)])


LLMD_WEIGHTS = (3.0, 2.0, 2.0)  # prefix-cache, queue, KV-cache utilisation (llm-d default profile)
LLMD_STICKY_TAU_STEPS = 35.0  # tau in units of max_num_batched_tokens (llm-d's documented example)


class LMetricSelector(WorkerSelector):
    """Lowest (isl - cached_w) x active_requests_w; ties: fewer new prefill tokens, then random.

    An idle row has batch size 0 and so score 0 (the paper's "both indicators zero" corner): the
    tie-break on new prefill tokens keeps prefix locality there. Without a view, new prefill tokens
    are taken as equal on every row.
    """

    name = "lmetric"

    def select(
        self,
        costs: np.ndarray,
        eligible: np.ndarray,
        active_requests: np.ndarray,
        *,
        overlap_blocks: np.ndarray | None = None,
        request_blocks: int = 0,
        view: SelectionView | None = None,
    ) -> int:
        rows = np.flatnonzero(eligible)
        if rows.size == 0:
            return -1
        if view is not None and overlap_blocks is not None:
            cached = np.minimum(view.isl_tokens, overlap_blocks[rows].astype(np.int64) * view.block_size)
            new = np.maximum(0, view.isl_tokens - cached)
        elif view is not None:
            new = np.full(rows.size, view.isl_tokens, np.int64)
        else:
            new = np.ones(rows.size, np.int64)
        score = new * active_requests[rows]
        best = score == score.min()
        rows, new = rows[best], new[best]
        return self._pick(rows[new == new.min()])


def llmd_scores(
    eligible: np.ndarray,
    active_requests: np.ndarray,
    overlap_blocks: np.ndarray | None,
    request_blocks: int,
    view: SelectionView | None,
) -> np.ndarray:
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

    def select(
        self,
        costs: np.ndarray,
        eligible: np.ndarray,
        active_requests: np.ndarray,
        *,
        overlap_blocks: np.ndarray | None = None,
        request_blocks: int = 0,
        view: SelectionView | None = None,
    ) -> int:
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

    def select(
        self,
        costs: np.ndarray,
        eligible: np.ndarray,
        active_requests: np.ndarray,
        *,
        overlap_blocks: np.ndarray | None = None,
        request_blocks: int = 0,
        view: SelectionView | None = None,
    ) -> int:
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
        return super().select(
            costs, eligible, active_requests, overlap_blocks=overlap_blocks, request_blocks=request_blocks, view=view
        )
