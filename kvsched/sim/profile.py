"""The engine cost model: step-time coefficients and KV capacity of a simulated engine.

Constants (`EngineProfile`) model Llama-3-8B (BF16) on one H100-80GB-SXM. No published per-step
profile was found with the available search tools, so they are derived from well-known figures:
H100 SXM 989 TFLOP/s dense BF16 and 3.35 TB/s HBM3 (NVIDIA datasheet); Llama-3-8B 8.03 B parameters
(16.1 GB of BF16 weights, ~16.1 GFLOP per token), 32 layers, 32 query heads, 8 KV heads × 128 dims
(Meta model card) → 128 KiB of KV per token. Decode is memory-bound: 16.1 GB / (3.35 TB/s × 0.8)
≈ 6.0 ms per step; KV reads 128 KiB / (3.35 TB/s × 0.8) ≈ 0.05 µs per context token; ~27 µs of
compute per decoding sequence. Prefill is compute-bound: 16.1 GFLOP / (989 TFLOP/s × 0.55 MFU)
≈ 30 µs per token, plus causal attention 4·32·4096·ctx FLOP at 40 % ≈ 1.33 µs per token per 1,000
tokens of context. KV capacity: 80 GB × 0.9 − 16.1 GB weights − ~4 GB activations ≈ 52 GiB →
425,984 tokens = 832 blocks of 512 tokens (`DEFAULT_KV_TOKENS`). The efficiency factors (0.8 of
HBM bandwidth, 0.55 / 0.4 of peak FLOP/s) are assumptions, not measurements: treat the figures as
order-of-magnitude and pass a measured `EngineProfile` when one is available.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_KV_TOKENS = 425_984  # tokens of KV cache per engine (see module docstring)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # vLLM v1 default for an OpenAI server on an H100-class GPU
DEFAULT_MAX_NUM_SEQS = 256  # running requests per engine


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """Step-time coefficients (µs); defaults model Llama-3-8B BF16 on one H100-80GB (module docstring)."""

    step_base_us: float = 6000.0  # per step: weight reads (memory-bound floor)
    prefill_us_per_token: float = 30.0  # per prompt token computed (dense FLOPs)
    prefill_attn_us_per_token_ktoken: float = 1.33  # per prompt token per 1,000 tokens of context
    decode_us_per_seq: float = 27.0  # per decoding request per step
    decode_us_per_ctx_token: float = 0.05  # per context token of decoding requests (KV reads)


DEFAULT_PROFILE = EngineProfile()  # the engines' default (immutable, so one shared instance)


def decode_us(profile: EngineProfile, batch: int, ctx_tokens: int) -> float:
    """The decode share (µs) of one engine step: `batch` decoding requests holding `ctx_tokens` tokens
    of context (0.0 without any). `sim/engine.py`'s step time is `step_base_us` + this + its prefill
    chunks' cost."""
    if batch == 0:
        return 0.0
    return batch * profile.decode_us_per_seq + profile.decode_us_per_ctx_token * ctx_tokens


def decode_steps_us(profile: EngineProfile, batch: int, ctx_tokens: int, steps: int) -> float:
    """Duration (µs) of `steps` decode-only steps with the batch unchanged, the context growing by
    `batch` tokens per step (an arithmetic series: `sim/engine.py`'s macro step)."""
    d0 = profile.step_base_us + decode_us(profile, batch, ctx_tokens)
    return steps * d0 + profile.decode_us_per_ctx_token * batch * steps * (steps - 1) / 2.0


def kv_blocks_for(block_size: int, kv_tokens: int = DEFAULT_KV_TOKENS) -> int:
    """Engine KV capacity in blocks of `block_size` tokens."""
    return max(1, math.floor(kv_tokens / block_size))
