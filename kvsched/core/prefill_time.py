"""Predicted time to first token per worker row, in µs: the outstanding prefill queued on the row plus
the request's own uncached prefill there, from an engine cost model (docs/ROUTING.md, "predicted
seconds").

Cost model: prefilling `u` tokens after `c` cached ones takes u x (a + b x (c + u/2) / 1000) µs, with
a = `us_per_token` (dense FLOPs per token) and b = `attn_us_per_token_ktoken` (causal attention, per
token per 1,000 tokens of context). It is the per-token part of the step-time model of
`kvsched/sim/profile.py` (Llama-3-8B on one H100; derivation there); the per-step floor and the decode
work sharing a step are left out. A chunked-prefill engine runs its queue first come, first served,
so a row's queue time is the sum of the predicted times of its outstanding bookings.

Which bookings are outstanding: every admission on a row is appended to that row's FIFO with its
tokens and predicted µs (`admitted`); the ledger's active prefill of the row (tokens of bookings whose
prefill is not done) is the truth, and since the oldest bookings finish first, `queue_us` drops FIFO
heads while the rest still cover the active prefill. Tokens the FIFO does not know (admissions made
before the model saw the row) are charged at `us_per_token`. No hook beyond the selector's
`admitted` and the view's `active_prefill` is needed.
"""

from __future__ import annotations

from collections import deque
from typing import Any, overload

import numpy as np

from .selector import SelectionView


class PrefillTimeModel:
    """Per-row FIFO of admitted prefill (tokens, µs) and the predicted TTFT of a decision.

    Args:
        us_per_token: a, µs per prefilled token (>= 0).
        attn_us_per_token_ktoken: b, µs per prefilled token per 1,000 tokens of context (>= 0).
    """

    def __init__(self, us_per_token: float = 30.0, attn_us_per_token_ktoken: float = 1.33) -> None:
        self.a = float(us_per_token)
        self.b = float(attn_us_per_token_ktoken)
        self.fifo: list[deque[tuple[float, float]]] = []  # per row: (tokens, µs) of admitted bookings, oldest first
        self.q_tokens: list[float] = []  # per row: tokens in its FIFO
        self.q_us: list[float] = []  # per row: µs in its FIFO

    @overload
    def own_us(self, tokens: float, context: float) -> float: ...
    @overload
    def own_us(self, tokens: np.ndarray, context: np.ndarray) -> np.ndarray: ...
    def own_us(self, tokens: Any, context: Any) -> Any:
        """µs to prefill `tokens` after `context` cached tokens (scalars or float64 arrays, same shape)."""
        return tokens * (self.a + self.b * (context + tokens / 2.0) / 1000.0)

    def admitted(self, row: int, uncached_tokens: int, isl_tokens: int) -> None:
        """Append a booking of `uncached_tokens` (after isl - uncached cached tokens) to `row`'s FIFO."""
        while len(self.fifo) <= row:
            self.fifo.append(deque())
            self.q_tokens.append(0.0)
            self.q_us.append(0.0)
        u = float(max(0, uncached_tokens))
        us = float(self.own_us(u, float(max(0, isl_tokens - uncached_tokens))))
        self.fifo[row].append((u, us))
        self.q_tokens[row] += u
        self.q_us[row] += us

    def queue_us(self, active_prefill: np.ndarray) -> np.ndarray:
        """float64[W]: predicted µs of each row's outstanding prefill (module docstring), given the
        ledger's active prefill per row (int64[W], tokens). Drops the FIFO heads that finished."""
        n = active_prefill.shape[0]
        out = np.zeros(n)
        for w in range(n):
            act = float(active_prefill[w])
            qt = qu = 0.0
            if w < len(self.fifo):
                q = self.fifo[w]
                if act <= 0.0:
                    q.clear()
                    self.q_tokens[w] = self.q_us[w] = 0.0
                while q and self.q_tokens[w] - q[0][0] >= act:
                    t, us = q.popleft()
                    self.q_tokens[w] -= t
                    self.q_us[w] -= us
                qt, qu = self.q_tokens[w], self.q_us[w]
            if act > qt:  # tokens booked outside the FIFO: charged at the base rate
                qu += (act - qt) * self.a
            elif qt > act:  # a head partly covered (rounding or a requeue): pro rata
                qu *= act / qt
            out[w] = max(qu, 0.0)
        return out

    def predicted_ttft_us(self, view: SelectionView) -> np.ndarray:
        """float64[W]: queue_us + the request's own uncached prefill on each row (µs; ineligible rows
        carry the view's -1 projection and must be ignored by the caller)."""
        own = np.maximum(view.prefill_tokens - view.active_prefill, 0).astype(np.float64)
        ctx = np.maximum(float(view.isl_tokens) - own, 0.0)
        ttft: np.ndarray = self.queue_us(view.active_prefill) + self.own_us(own, ctx)
        return ttft
