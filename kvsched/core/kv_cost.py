"""The default `kv` selector: Dynamo's load terms re-weighted for prefix locality, plus a capped
exclusive-lead bonus, decayed recently admitted work and LMetric's prefill x batch product
(docs/ROUTING.md has each term's source and measured effect).

Cost per eligible row w, in blocks (B tokens per block; lower wins):

    prefill_weight       x (active prefill_w + isl - cached_w) / B        "prefill"
  + active_blocks_weight x projected active blocks_w                      "active_blocks"
  - min(lead_bonus x min(lead_w, lead_cap_blocks),                        "lead"
        prefill_weight x max(lead_max_wait_steps x max_num_batched_tokens_w / B,
                             lead_max_wait_per_lead x lead_w))
      (released while w's active prefill > lead_release_steps x max_num_batched_tokens_w, or its
       recent work > lead_release_recent_ratio x the other eligible rows' mean, or its active
       requests > lead_release_requests_ratio x the other eligible rows' mean, at least 1)
  + recent_weight        x recent_w / B                                   "recent"
  + interference_weight  x (isl - cached_w) / B x active_requests_w       "interference"
      (with interference_cap_prompts = c > 0: measured from the eligible row with the least, and at
       most c x prefill_weight x isl / B, c of the request's own full-prompt prefill costs)

cached_w = min(isl, overlap_w x B), so a deeper overlap always costs less (no clamp: a shallow and a
deep overlap never tie, unlike raising Dynamo's `overlap_credit`). lead_w = overlap_w minus the deepest
overlap on any other eligible row (> 0 only on the unique deepest row). The bonus is worth at most
max(lead_max_wait_steps steps of prefill, lead_max_wait_per_lead x the lead's own tokens) of extra
queued prefill: affinity may make a request wait that much longer than on the best other row, never
more (llm-d's "sticky until saturated" with τ = prefill throughput x the largest TTFT penalty accepted,
applied to the extra wait); like that filter it is also released once the row's queued prefill passes
a threshold, so a popular prefix cached on one row cannot pile work onto it without bound.
recent_w = uncached prompt tokens admitted to w, each decayed by 2^(-age / recent_half_life_s): an idle
fleet (no leases, every load term 0) still spreads new sessions, while a later turn's overlap keeps its
affinity. The interference term (docs/ROUTING.md) is LMetric's score (new prefill
tokens x batch size): a chunked prefill slows every request decoding on the same engine, so new prefill
goes where it slows the fewest. Its cap bounds what the term may spend: it can only choose among rows
whose other terms are within c prompt prefills of the best, so it cannot pull a request whose prompt
is cached on one busy row onto that row against the queue (the Azure failure of the uncapped term,
docs/ROUTING.md).

Opt-in, off by default (docs/ROUTING.md, "Predicted seconds"): with `lead_max_extra_ttft_s` > 0 the lead
row wins outright while its predicted TTFT (`prefill_time.PrefillTimeModel`: queued prefill + own
uncached prefill, priced with the attention term) is within that many seconds of the best other row's;
with `prefill_seconds_ref_us` > 0 the prefill term is that predicted TTFT / the reference µs per token.
Either key makes the numpy `terms` decide (the kernel does not compute them).

"home" (`home_weight` > 0; docs/ROUTING.md, "Home"): a request whose own uncached prefill on w is at
least `home_min_prefill_tokens` pays home_weight x prefill_weight x that prefill / B x (h_w - min h) /
mean h, with h_w the decayed count of admissions to w that reused at least `home_min_cached_share` of
their prompt (learnt in `admitted`): long prompts go where few conversations return, instead of
queueing in front of their short turns. Computed by the numpy `terms` only: it is 0 on every row for
a prompt shorter than `home_min_prefill_tokens`, which the fused admission kernel still decides
(`kernel_may_decide`); a longer one takes the numpy path while the term is on.
"""

from __future__ import annotations

import math
from math import exp2

import numpy as np

from ..config import SelectorConfig
from ..shm.select_kernels import KV_TERMS, kv_cost_terms
from .prefill_time import PrefillTimeModel
from .selector import CostSelector, SelectionView, Terms, TermTable


class KvSelector(CostSelector):
    """kvsched's default selector (module docstring). temperature as in `CostSelector`.

    State: `recent` float64[W] (tokens, decayed to `recent_at_us`), changed only by `admitted`.
    Without a `SelectionView` (callers outside the dispatcher) it falls back to the given costs.
    """

    name = "kv"
    learnt = ("recent", "recent_at_us", "home", "home_at_us")  # decayed recent work and home counts

    def __init__(
        self,
        temperature: float = 0.0,
        seed: int | None = None,
        *,
        prefill_weight: float = 16.0,
        active_blocks_weight: float = 0.1,
        lead_bonus: float = 400.0,
        lead_cap_blocks: float = 64.0,
        lead_release_steps: float = 16.0,
        lead_release_recent_ratio: float = 2.0,
        lead_max_wait_steps: float = 10.0,
        lead_max_wait_per_lead: float = 3.0,
        recent_weight: float = 1.0,
        recent_half_life_s: float = 30.0,
        interference_weight: float = 1.0,
        interference_cap_prompts: float = 0.1,
        lead_release_requests_ratio: float = 2.0,
        lead_max_extra_ttft_s: float = 0.0,
        prefill_seconds_ref_us: float = 0.0,
        prefill_us_per_token: float = 30.0,
        prefill_attn_us_per_token_ktoken: float = 1.33,
        home_weight: float = 0.08,
        home_half_life_s: float = 30.0,
        home_min_cached_share: float = 0.5,
        home_min_prefill_tokens: int = 16384,
    ) -> None:
        super().__init__(temperature, seed)
        self.prefill_weight = float(prefill_weight)
        self.active_blocks_weight = float(active_blocks_weight)
        self.lead_bonus = float(lead_bonus)
        self.lead_cap_blocks = float(lead_cap_blocks)
        self.lead_release_steps = float(lead_release_steps)
        self.lead_release_recent_ratio = float(lead_release_recent_ratio)
        self.lead_max_wait_steps = float(lead_max_wait_steps)
        self.lead_max_wait_per_lead = float(lead_max_wait_per_lead)
        self.recent_weight = float(recent_weight)
        self.recent_half_life_us = float(recent_half_life_s) * 1e6
        self.interference_weight = float(interference_weight)
        self.interference_cap_prompts = float(interference_cap_prompts)
        self.lead_release_requests_ratio = float(lead_release_requests_ratio)
        self.lead_max_extra_ttft_s = float(lead_max_extra_ttft_s)
        self.prefill_seconds_ref_us = float(prefill_seconds_ref_us)
        # the predicted-seconds model (module prefill_time), only when a key that reads it is on
        self.ttft_model = (
            PrefillTimeModel(prefill_us_per_token, prefill_attn_us_per_token_ktoken)
            if self.lead_max_extra_ttft_s > 0.0 or self.prefill_seconds_ref_us > 0.0
            else None
        )
        self._last_isl = 0  # the last decision's prompt tokens (its `admitted` follows)
        self.home_weight = float(home_weight)
        self.home_half_life_us = float(home_half_life_s) * 1e6
        self.home_min_cached_share = float(home_min_cached_share)
        self.home_min_prefill_tokens = int(home_min_prefill_tokens)
        self.home = np.zeros(0, np.float64)  # decayed count of cache-reusing admissions per row
        self.home_at_us = 0
        self.recent = np.zeros(0, np.float64)
        self.recent_at_us = 0
        self._total = np.zeros(0)  # scratch of select_explained (float64[W])
        self._scratch = np.zeros((2, 0))
        self._pick_out = np.zeros(2, np.int64)

    @classmethod
    def from_config(cls, cfg: SelectorConfig) -> KvSelector:
        """The selector with the `[selector]` table's `kv` keys (docs/ROUTING.md)."""
        return cls(
            cfg.temperature,
            cfg.seed,
            prefill_weight=cfg.prefill_weight,
            active_blocks_weight=cfg.active_blocks_weight,
            lead_bonus=cfg.lead_bonus,
            lead_cap_blocks=cfg.lead_cap_blocks,
            lead_release_steps=cfg.lead_release_steps,
            lead_release_recent_ratio=cfg.lead_release_recent_ratio,
            lead_max_wait_steps=cfg.lead_max_wait_steps,
            lead_max_wait_per_lead=cfg.lead_max_wait_per_lead,
            recent_weight=cfg.recent_weight,
            recent_half_life_s=cfg.recent_half_life_s,
            interference_weight=cfg.interference_weight,
            interference_cap_prompts=cfg.interference_cap_prompts,
            lead_release_requests_ratio=cfg.lead_release_requests_ratio,
            lead_max_extra_ttft_s=cfg.lead_max_extra_ttft_s,
            prefill_seconds_ref_us=cfg.prefill_seconds_ref_us,
            prefill_us_per_token=cfg.prefill_us_per_token,
            prefill_attn_us_per_token_ktoken=cfg.prefill_attn_us_per_token_ktoken,
            home_weight=cfg.home_weight,
            home_half_life_s=cfg.home_half_life_s,
            home_min_cached_share=cfg.home_min_cached_share,
            home_min_prefill_tokens=cfg.home_min_prefill_tokens,
        )

    # ---- terms (pure) ----------------------------------------------------------------------------
    def decay(self, now_us: int) -> float:
        """The factor that brings `recent` (decayed to `recent_at_us`) to `now_us` µs: 2^(-age / half-life),
        1.0 for no age, 0.0 with a zero half-life. The fused admission kernel is given it."""
        dt = now_us - self.recent_at_us  # max(0, dt) written out: this runs once per admission
        hl = self.recent_half_life_us
        return exp2(-(dt if dt > 0 else 0) / hl) if hl > 0 else 0.0

    def terms(
        self,
        costs: np.ndarray,
        eligible: np.ndarray,
        overlap_blocks: np.ndarray | None,
        view: SelectionView,
        active_requests: np.ndarray | None = None,
    ) -> dict[str, np.ndarray]:
        """float64[W] per term (module docstring); ineligible rows: +inf in "prefill", 0 elsewhere. Pure.

        `active_requests` (int64[W], live bookings per row) feeds "interference"; None (the dispatcher's
        explain path for a pinned request) leaves that term 0. With the predicted-seconds keys on, the
        model drops the bookings whose prefill the view shows done (same result on a repeated call).
        """
        n = eligible.shape[0]
        rows = np.flatnonzero(eligible)
        inv_bs = 1.0 / float(view.block_size)
        prefill = np.full(n, np.inf)
        active = np.zeros(n)
        lead = np.zeros(n)
        recent = np.zeros(n)
        interference = np.zeros(n)
        home = np.zeros(n) if self.home_weight > 0.0 else None

        def out() -> dict[str, np.ndarray]:
            t = {
                "prefill": prefill,
                "active_blocks": active,
                "lead": lead,
                "recent": recent,
                "interference": interference,
            }
            if home is not None:
                t["home"] = home
            return t

        if rows.size == 0:
            return out()
        ttft = self.ttft_model.predicted_ttft_us(view) if self.ttft_model is not None else None
        if ttft is not None and self.prefill_seconds_ref_us > 0.0:  # predicted µs as tokens at the reference rate
            prefill[rows] = ttft[rows] / self.prefill_seconds_ref_us * (self.prefill_weight * inv_bs)
        else:
            prefill[rows] = view.prefill_tokens[rows] * (self.prefill_weight * inv_bs)
        if self.active_blocks_weight:
            active[rows] = view.blocks[rows] * self.active_blocks_weight
        if self.interference_weight and active_requests is not None:  # own uncached prefill x requests it slows
            own = np.maximum(view.prefill_tokens[rows] - view.active_prefill[rows], 0)
            interference[rows] = own * active_requests[rows] * (self.interference_weight * inv_bs)
            if self.interference_cap_prompts > 0.0:  # never more than this above the least, in prompt prefills
                cap = self.interference_cap_prompts * self.prefill_weight * float(view.isl_tokens) * inv_bs
                low = interference[rows].min()
                interference[rows] = np.minimum(interference[rows] - low, cap)
        if home is not None:
            home[rows] = self.home_term(rows, view)
        m = min(n, self.recent.size)
        rt = None
        if m:
            decay = self.decay(view.now_us)
            rt = np.zeros(n)
            sel = rows[rows < m]
            rt[sel] = self.recent[sel] * decay
            if self.recent_weight:
                recent[sel] = rt[sel] * (self.recent_weight * inv_bs)
        if self.lead_bonus > 0.0 and overlap_blocks is not None:
            depth = overlap_blocks[rows]
            k = int(depth.argmax())
            first = int(depth[k])
            if first > 0:
                top = int(rows[k])
                second = int(np.partition(depth, -2)[-2]) if rows.size > 1 else 0
                if first > second and not self._saturated(top, rt, rows, view, active_requests):
                    gap = float(first - max(0, second))
                    bonus = self.lead_bonus * min(gap, self.lead_cap_blocks)
                    others = rows[rows != top]
                    if (
                        self.lead_max_extra_ttft_s > 0.0
                        and ttft is not None
                        and others.size
                        and (ttft[top] <= ttft[others].min() + self.lead_max_extra_ttft_s * 1e6)
                    ):
                        base = prefill + active + recent + interference  # the lead row wins by `bonus`
                        if home is not None:
                            base = base + home
                        lead[top] = -(max(0.0, base[top] - base[others].min()) + bonus)
                        return out()
                    if self.lead_max_wait_steps > 0.0:  # at most this much extra queued prefill for affinity
                        wait_blocks = max(
                            self.lead_max_wait_steps * float(view.max_batched_tokens[top]) * inv_bs,
                            self.lead_max_wait_per_lead * gap,
                        )
                        bonus = min(bonus, self.prefill_weight * wait_blocks)
                    lead[top] = -bonus
        return out()

    def home_term(self, rows: np.ndarray, view: SelectionView) -> np.ndarray:
        """float64[len(rows)], the "home" term at eligible `rows` (blocks; docs/ROUTING.md): with h_w the
        decayed count of cache-reusing admissions on w (`admitted`) and u_w the request's own uncached
        prefill there (tokens), home_weight x prefill_weight x u_w / B x (h_w - min h) / mean h over
        `rows`, and 0 where u_w < home_min_prefill_tokens or while no row has any h. Pure."""
        h = np.zeros(rows.size)
        m = min(self.home.size, int(rows.max()) + 1) if rows.size else 0
        if m:
            sel = rows < m
            dt = max(0, view.now_us - self.home_at_us)
            h[sel] = self.home[rows[sel]] * math.exp2(-dt / self.home_half_life_us)
        mean = float(h.mean()) if rows.size else 0.0
        if mean <= 0.0:
            return np.zeros(rows.size)
        own = np.maximum(view.prefill_tokens[rows] - view.active_prefill[rows], 0).astype(np.float64)
        scale = self.home_weight * self.prefill_weight / float(view.block_size) / mean
        return np.where(own >= self.home_min_prefill_tokens, own * (h - h.min()) * scale, 0.0)

    def _saturated(
        self,
        row: int,
        recent_tokens: np.ndarray | None,
        rows: np.ndarray,
        view: SelectionView,
        active_requests: np.ndarray | None = None,
    ) -> bool:
        """The lead bonus is released on `row`: queued prefill > lead_release_steps x its step budget, or
        (with more than one eligible row) its active requests > lead_release_requests_ratio x the other
        eligible rows' mean (at least 1; key > 0 and `active_requests` given), or its recent work >
        lead_release_recent_ratio x the mean recent work of the other eligible rows."""
        if view.active_prefill[row] > self.lead_release_steps * view.max_batched_tokens[row]:
            return True
        if self.lead_release_requests_ratio > 0.0 and active_requests is not None and rows.size > 1:
            mean_others = (float(active_requests[rows].sum()) - float(active_requests[row])) / (rows.size - 1)
            if active_requests[row] > self.lead_release_requests_ratio * max(mean_others, 1.0):
                return True
        if recent_tokens is not None and self.lead_release_recent_ratio > 0.0 and rows.size > 1:
            mine = recent_tokens[row]
            mean_others = (float(recent_tokens[rows].sum()) - mine) / (rows.size - 1)
            saturated: bool = mine > self.lead_release_recent_ratio * mean_others
            return saturated
        return False

    def select_explained(
        self,
        costs: np.ndarray,
        eligible: np.ndarray,
        active_requests: np.ndarray,
        *,
        overlap_blocks: np.ndarray | None = None,
        request_blocks: int = 0,
        view: SelectionView | None = None,
    ) -> tuple[int, Terms | None]:
        """The row of least total cost and the decision's terms (a `TermTable` of `KV_TERMS`).

        One `kv_cost_terms` kernel call computes the terms (extra-wait cap, requests release rule and
        capped interference included), their total and its argmin with the same float operations as
        `terms`; ties, a temperature, a NaN or an ineligible minimum go through
        `CostSelector.select` on the total, as before. Without an overlap, with row arrays of
        other dtypes than the kernel is proven for, or when the release rule must sum more rows than
        the kernel sums in numpy's order, the array code (`terms`) decides."""
        if view is None:
            return super().select(costs, eligible, active_requests), None
        self._last_isl = int(view.isl_tokens)
        if self.ttft_model is not None or not self.kernel_may_decide(int(view.isl_tokens)):  # array code only
            return self._array_select(costs, eligible, active_requests, overlap_blocks, view)
        if overlap_blocks is None or active_requests.dtype != np.int64 or view.prefill_tokens.dtype != np.int64:
            return self._array_select(costs, eligible, active_requests, overlap_blocks, view)
        n = eligible.shape[0]
        if self._total.shape[0] != n:
            self._total, self._scratch = np.zeros(n), np.zeros((2, n))
        recent = self.recent
        decay = self.decay(view.now_us) if recent.size and n else 1.0
        all_terms, total, pick = np.zeros((5, n)), self._total, self._pick_out
        i = kv_cost_terms(
            view.prefill_tokens,
            view.blocks,
            view.active_prefill,
            view.max_batched_tokens,
            eligible,
            overlap_blocks,
            recent,
            decay,
            active_requests,
            int(view.isl_tokens),
            1.0 / float(view.block_size),
            self.prefill_weight,
            self.active_blocks_weight,
            self.recent_weight,
            self.lead_bonus,
            self.lead_cap_blocks,
            self.lead_release_steps,
            self.lead_release_recent_ratio,
            self.lead_release_requests_ratio,
            self.lead_max_wait_steps,
            self.lead_max_wait_per_lead,
            self.interference_weight,
            self.interference_cap_prompts,
            self._scratch,
            all_terms,
            total,
            pick,
        )
        if i == -2:  # more eligible rows than the kernel sums in numpy's order: the array path decides
            return self._array_select(costs, eligible, active_requests, overlap_blocks, view)
        table = TermTable(KV_TERMS, all_terms)
        if self.temperature <= 0.0 and i >= 0 and pick[1] == 1 and eligible[i] and -np.inf < total[i] < np.inf:
            return i, table  # the unique finite minimum on an eligible row: what `select` returns
        return super().select(total, eligible, active_requests), table

    def _array_select(
        self,
        costs: np.ndarray,
        eligible: np.ndarray,
        active_requests: np.ndarray,
        overlap_blocks: np.ndarray | None,
        view: SelectionView,
    ) -> tuple[int, dict[str, np.ndarray]]:
        """`select_explained` by the array code: `terms`, their total, `CostSelector.select`."""
        t = self.terms(costs, eligible, overlap_blocks, view, active_requests)
        total = t["prefill"] + t["active_blocks"] + t["lead"] + t["recent"] + t["interference"]
        if "home" in t:
            total = total + t["home"]
        return super().select(total, eligible, active_requests), t

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
        return self.select_explained(
            costs, eligible, active_requests, overlap_blocks=overlap_blocks, request_blocks=request_blocks, view=view
        )[0]

    # ---- learning (after admission) -------------------------------------------------------------
    def decides_by_kernel(self) -> bool:
        """True when every decision of `select_explained` with a view is the `kv_cost_terms` kernel's
        (its unique minimum; ties go through `CostSelector.select`) and `admitted` only updates
        `recent`: temperature 0 and no key that only the array code computes. The fused admission
        kernel (`shm.admit_kernels.admit_kv`) may then decide in the selector's place. A new key the
        kernel does not compute must make this False."""
        return self.temperature <= 0.0 and self.ttft_model is None

    def kernel_may_decide(self, isl_tokens: int) -> bool:
        """May the fused kernel decide a request of `isl_tokens` prompt tokens (with `decides_by_kernel`)?
        The kernel does not compute the home term, which is 0 on every row for a prompt shorter than
        `home_min_prefill_tokens` (a row's uncached prefill is at most the prompt): such a request is
        decided alike by both paths; a longer one takes the array code while the term is on."""
        return self.home_weight <= 0.0 or isl_tokens < self.home_min_prefill_tokens

    def reserve_rows(self, n: int) -> None:
        """Grow `recent` to at least `n` rows now (zeros), so that `admitted` never grows it and the
        fused admission kernel can update it in place. Decisions are unchanged: a row past the end
        of `recent` and a row holding 0 both have recent work 0 in every term and rule."""
        if self.recent.size < n:
            self.recent = np.concatenate([self.recent, np.zeros(n - self.recent.size)])

    def admitted(self, row: int, uncached_tokens: int, now_us: int, isl_tokens: int | None = None) -> None:
        """Add `uncached_tokens` to `row`'s decayed recent work (decaying every row to `now_us` first),
        the booking to the predicted-seconds model's FIFO when it is on, and a cache-reusing admission
        to the home counts when that term is on. `isl_tokens`: the request's prompt tokens (the
        admitter passes it; None = the last decision's, which a pinned admission did not make)."""
        isl = self._last_isl if isl_tokens is None else int(isl_tokens)
        if self.ttft_model is not None:
            self.ttft_model.admitted(row, uncached_tokens, isl)
        if self.home_weight > 0.0:
            self.note_home(row, isl, uncached_tokens, now_us)
        if self.recent_weight <= 0.0:
            return
        if self.recent.size <= row:
            self.recent = np.concatenate([self.recent, np.zeros(row + 1 - self.recent.size)])
        if now_us > self.recent_at_us:
            self.recent *= self.decay(now_us)
            self.recent_at_us = now_us
        self.recent[row] += max(0, uncached_tokens)

    def note_home(self, row: int, isl: int, uncached_tokens: int, now_us: int) -> None:
        """Count the admission on `row` as cache-reusing (decaying every row's count to `now_us` first)
        when its cached tokens (`isl` prompt tokens minus `uncached_tokens`) are > 0 and at least
        home_min_cached_share of the prompt. Called by `admitted`, and by the fused admission path
        (which does not call `admitted`) for the requests it decides."""
        cached = isl - max(0, uncached_tokens)
        if cached <= 0 or cached < self.home_min_cached_share * isl:
            return
        if self.home.size <= row:
            self.home = np.concatenate([self.home, np.zeros(row + 1 - self.home.size)])
        if now_us > self.home_at_us:
            self.home *= math.exp2(-(now_us - self.home_at_us) / self.home_half_life_us)
            self.home_at_us = now_us
        self.home[row] += 1.0
