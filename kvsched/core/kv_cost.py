"""The default `kv` selector: Dynamo's load terms re-weighted for prefix locality, plus a capped
exclusive-lead bonus, decayed recently admitted work, LMetric's prefill x batch product and the opt-in
home and predicted-seconds keys (docs/ROUTING.md has each term's source and measured effect).

The rule itself is stated once, by the compiled `shm.select_kernels.kv_cost_terms` (its docstring
has the formula); the fused admission kernel calls it too. `KvSelector` keeps what the kernel does
not: its keys (packed once into the kernel's `params`), the learnt state (decayed recent work, the
home counts, the predicted-seconds model's bookings) and, through `CostSelector.select`, the
tie-break and softmax draws with its RNG.

Why the terms look as they do: cached_w = min(isl, overlap_w x B), so a deeper overlap always costs
less (no clamp: a shallow and a deep overlap never tie, unlike raising Dynamo's `overlap_credit`). The
lead bonus is worth at most max(lead_max_wait_steps steps of prefill, lead_max_wait_per_lead x the
lead's own tokens) of extra queued prefill: affinity may make a request wait that much longer than on
the best other row, never more (llm-d's "sticky until saturated" with τ = prefill throughput x the
largest TTFT penalty accepted); like that filter it is released once the row's queued prefill passes a
threshold, so a popular prefix cached on one row cannot pile work onto it without bound. Recent work
(uncached prompt tokens admitted to w, each decayed by 2^(-age / recent_half_life_s)) spreads new
sessions over an idle fleet, while a later turn's overlap keeps its affinity. The interference term
is LMetric's score (new prefill tokens x batch size): a chunked prefill slows every request decoding on
the same engine; its cap keeps it from pulling a request whose prompt is cached on one busy row onto
that row against the queue (the Azure failure of the uncapped term, docs/ROUTING.md). "home"
(docs/ROUTING.md, "Home") sends long prompts where few conversations return, h_w being the decayed
count of admissions to w that reused at least `home_min_cached_share` of their prompt (learnt in
`admitted`). "Predicted seconds" (docs/ROUTING.md) prices prefill with `prefill_time.PrefillTimeModel`.
"""

from __future__ import annotations

import math
from math import exp2

import msgspec
import numpy as np

from ..config import SelectorConfig
from ..shm.select_kernels import KV_TERMS, KV_TERMS_HOME, SELECTOR_PARAMS, P, kv_cost_terms, pack_selector_params
from .prefill_time import PrefillTimeModel
from .selector import CostSelector, SelectionView, Terms, TermTable

_BLOCK_SIZE, _INV_BS = P["block_size"], P["inv_bs"]
# the `[selector]` keys of the kv selector with their defaults, stated once by `SelectorConfig`: the
# kernel's (`SELECTOR_PARAMS`) and those of the learnt state and the predicted-seconds model
_OWN_KEYS = (
    "recent_half_life_s",
    "home_half_life_s",
    "home_min_cached_share",
    "prefill_us_per_token",
    "prefill_attn_us_per_token_ktoken",
)
KV_KEYS = {f.name: f.default for f in msgspec.structs.fields(SelectorConfig) if f.name in SELECTOR_PARAMS + _OWN_KEYS}
_U8, _I4, _I8 = np.dtype(np.uint8), np.dtype(np.int32), np.dtype(np.int64)


class KvSelector(CostSelector):
    """kvsched's default selector (module docstring). temperature as in `CostSelector`.

    State: `recent` float64[W] (tokens, decayed to `recent_at_us`) and `home` float64[W] (counts, decayed
    to `home_at_us`), changed only by `admitted` / `note_home` (and the fused kernel's `recent` update).
    Without a `SelectionView` (callers outside the dispatcher) it falls back to the given costs.
    """

    name = "kv"
    learnt = ("recent", "recent_at_us", "home", "home_at_us")  # decayed recent work and home counts

    # the keys Python reads (every key of KV_KEYS is an attribute; these are annotated for readers and mypy)
    recent_weight: float
    home_weight: float
    home_min_prefill_tokens: int
    home_min_cached_share: float
    lead_max_extra_ttft_s: float
    prefill_seconds_ref_us: float

    def __init__(self, temperature: float = 0.0, seed: int | None = None, **keys: float) -> None:
        """`keys`: `[selector]` keys of the kv selector (`KV_KEYS`, docs/ROUTING.md), each defaulting to
        `SelectorConfig`'s value; each is an attribute of the same name. Raises TypeError on another name."""
        super().__init__(temperature, seed)
        unknown = keys.keys() - KV_KEYS.keys()
        if unknown:
            raise TypeError(f"KvSelector: unknown [selector] keys {sorted(unknown)}")
        k = {**KV_KEYS, **keys}
        for name, value in k.items():
            setattr(self, name, float(value))
        self.home_min_prefill_tokens = int(k["home_min_prefill_tokens"])
        self.recent_half_life_us = float(k["recent_half_life_s"]) * 1e6
        self.home_half_life_us = float(k["home_half_life_s"]) * 1e6
        # the predicted-seconds model (module prefill_time), only when a key that reads it is on
        self.ttft_model = (
            PrefillTimeModel(k["prefill_us_per_token"], k["prefill_attn_us_per_token_ktoken"])
            if self.lead_max_extra_ttft_s > 0.0 or self.prefill_seconds_ref_us > 0.0
            else None
        )
        self._last_isl = 0  # the last decision's prompt tokens (its `admitted` follows)
        self.home = np.zeros(0, np.float64)  # decayed count of cache-reusing admissions per row
        self.home_at_us = 0
        self.recent = np.zeros(0, np.float64)
        self.recent_at_us = 0
        self.params = pack_selector_params(self)  # the kernel's params: the keys above, packed once
        self._block_size = 0  # the block size the params' inv_bs / block_size slots hold (0 = not yet)
        self._buffers(0)
        self._pick_out = np.zeros(2, np.int64)

    def _buffers(self, n: int) -> None:
        """The kernel's work arrays for `n` rows (float64 unless named): total [W], scratch [2, W],
        extra [2, W] (home counts, predicted TTFT), zero overlap int32[W] and requests int64[W]."""
        self._total, self._scratch, self._extra = np.zeros(n), np.zeros((2, n)), np.zeros((2, n))
        self._no_overlap, self._no_requests = np.zeros(n, np.int32), np.zeros(n, np.int64)

    @classmethod
    def from_config(cls, cfg: SelectorConfig) -> KvSelector:
        """The selector with the `[selector]` table's `kv` keys (docs/ROUTING.md)."""
        return cls(cfg.temperature, cfg.seed, **{name: getattr(cfg, name) for name in KV_KEYS})

    # ---- terms (pure) ----------------------------------------------------------------------------
    def decay(self, now_us: int) -> float:
        """The factor that brings `recent` (decayed to `recent_at_us`) to `now_us` µs: 2^(-age / half-life),
        1.0 for no age, 0.0 with a zero half-life. The fused admission kernel is given it."""
        dt = now_us - self.recent_at_us  # max(0, dt) written out: this runs once per admission
        hl = self.recent_half_life_us
        return exp2(-(dt if dt > 0 else 0) / hl) if hl > 0 else 0.0

    def _kernel(
        self,
        eligible: np.ndarray,
        overlap_blocks: np.ndarray | None,
        view: SelectionView,
        active_requests: np.ndarray | None,
        home: bool,
    ) -> tuple[int, np.ndarray]:
        """One `kv_cost_terms` call: (its argmin or -1 on a NaN, float64[5 or 6 (`home`), W] terms);
        the total is left in `self._total`, the tie count in `self._pick_out[1]`. None for the overlap
        or the requests reads as zeros (no lead, no interference, no requests release)."""
        n = eligible.shape[0]
        if self._total.shape[0] != n:
            self._buffers(n)
        p = self.params
        if view.block_size != self._block_size:  # the kernel's inv_bs / block_size slots
            self._block_size = bs = view.block_size
            p[_BLOCK_SIZE], p[_INV_BS] = float(bs), 1.0 / float(bs)
        extra = self._extra
        if home:  # the home counts decayed to now (0 past the end of `home`)
            m = min(self.home.size, n)
            extra[0, m:] = 0.0
            if m:
                dt = max(0, view.now_us - self.home_at_us)
                extra[0, :m] = self.home[:m] * math.exp2(-dt / self.home_half_life_us)
        if self.ttft_model is not None and eligible.any():  # the bookings whose prefill the view shows done are dropped
            extra[1] = self.ttft_model.predicted_ttft_us(view)
        recent = self.recent
        terms = np.zeros((6 if home else 5, n))
        if eligible.dtype is not _U8:  # the dtypes the kernel is compiled for (the view's are int64)
            eligible = eligible.astype(np.uint8)
        if overlap_blocks is None:
            overlap_blocks = self._no_overlap
        elif overlap_blocks.dtype is not _I4:
            overlap_blocks = overlap_blocks.astype(np.int32)
        if active_requests is None:
            active_requests = self._no_requests
        elif active_requests.dtype is not _I8:
            active_requests = active_requests.astype(np.int64)
        i = kv_cost_terms(
            view.prefill_tokens,
            view.blocks,
            view.active_prefill,
            view.max_batched_tokens,
            eligible,
            overlap_blocks,
            recent,
            self.decay(view.now_us) if recent.size and n else 1.0,
            active_requests,
            int(view.isl_tokens),
            p,
            extra,
            self._scratch,
            terms,
            self._total,
            self._pick_out,
        )
        return i, terms

    def terms(
        self,
        costs: np.ndarray,
        eligible: np.ndarray,
        overlap_blocks: np.ndarray | None,
        view: SelectionView,
        active_requests: np.ndarray | None = None,
    ) -> dict[str, np.ndarray]:
        """float64[W] per term (`kv_cost_terms`; "home" while `home_weight` > 0); ineligible rows: +inf in
        "prefill", 0 elsewhere. `active_requests` (int64[W], live bookings per row) feeds "interference"
        and the requests release rule; None (the dispatcher's explain path for a pinned request) leaves
        both out. With the predicted-seconds keys on, the model drops the bookings whose prefill the view
        shows done (same result on a repeated call)."""
        home = self.home_weight > 0.0
        _, rows = self._kernel(eligible, overlap_blocks, view, active_requests, home)
        return dict(zip(KV_TERMS_HOME if home else KV_TERMS, rows, strict=True))

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
        """The row of least total cost and the decision's terms (a `TermTable` of `KV_TERMS`, with
        "home" for a prompt the home term may price: `kernel_may_decide` False, or with the
        predicted-seconds model on).

        One `kv_cost_terms` call computes the terms, their total and its argmin; a unique finite
        minimum on an eligible row at temperature 0 is the decision, anything else (ties, a
        temperature, a NaN, an ineligible minimum) goes through `CostSelector.select` on the total.
        Without a view (callers outside the dispatcher) it falls back to the given costs."""
        if view is None:
            return super().select(costs, eligible, active_requests), None
        isl = self._last_isl = int(view.isl_tokens)
        home = self.home_weight > 0.0 and (self.ttft_model is not None or not self.kernel_may_decide(isl))
        i, rows = self._kernel(eligible, overlap_blocks, view, active_requests, home)
        table, total = TermTable(KV_TERMS_HOME if home else KV_TERMS, rows), self._total
        if (
            self.temperature <= 0.0
            and i >= 0
            and self._pick_out[1] == 1
            and eligible[i]
            and -np.inf < total[i] < np.inf
        ):
            return i, table  # the unique finite minimum on an eligible row: what `select` returns
        return super().select(total, eligible, active_requests), table

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
        """True when the fused admission kernel (`shm.admit_kernels.admit_kv`) may decide in the
        selector's place: temperature 0 (no draw but on ties, which it leaves UNDECIDED) and no
        predicted-seconds key (the model's TTFT and its bookings are Python's), so that `admitted`
        only updates `recent`. A new key the fused kernel is not given must make this False."""
        return self.temperature <= 0.0 and self.ttft_model is None

    def kernel_may_decide(self, isl_tokens: int) -> bool:
        """May the fused kernel decide a request of `isl_tokens` prompt tokens (with `decides_by_kernel`)?
        The fused kernel is not given the home counts; the home term is 0 on every row for a prompt
        shorter than `home_min_prefill_tokens` (a row's uncached prefill is at most the prompt): such a
        request is decided alike by both paths; a longer one takes `select_explained` while the term is on."""
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
