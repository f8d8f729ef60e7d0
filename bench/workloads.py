"""Workloads of the routing bench besides the Mooncake conversation trace: a seeded 90 % draw of a
trace's conversations, a synthetic generator (shared system prompts, multi-turn chat sessions, agent
tool loops) and block hashes synthesised for the Azure conversation trace (which has none).

All three return `kvsched.sim.trace.Trace` objects (arrival order, chained block hashes), so every
policy replays exactly the same requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsched.sim.trace import Trace, splitmix64

_SYS = 1 << 40  # id spaces of synthetic block ids (system prompts, sessions); see `_block_id`


def _from_rows(arrival_us, isl, osl, hash_lists, block_size: int, source: str) -> Trace:
    order = np.argsort(np.asarray(arrival_us, dtype=np.int64), kind="stable")
    lens = np.array([len(hash_lists[i]) for i in order], dtype=np.int64)
    offsets = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    flat = (
        np.concatenate([np.asarray(hash_lists[i], dtype=np.uint64) for i in order])
        if len(order)
        else np.zeros(0, np.uint64)
    )
    t = np.asarray(arrival_us, dtype=np.int64)[order]
    return Trace(
        t - (t[0] if t.size else 0),
        np.asarray(isl, dtype=np.int64)[order],
        np.asarray(osl, dtype=np.int64)[order],
        offsets,
        flat,
        block_size,
        source,
    )


def subsample_conversations(trace: Trace, seed: int, keep: float = 0.9, shared_share: float = 0.01) -> Trace:
    """A random `keep` share of the trace's conversations, whole conversations kept (seeded).

    The Mooncake trace has no session ids, and every request starts with the same block (a global
    system prompt). A conversation is keyed by the first block of a request that fewer than
    `shared_share` of all requests contain (the first block past the widely shared prefixes: turns
    of one chat share it); a request with no such block is its own group. Arrival times are kept
    (so the load drops by about 1 - keep).
    """
    rng = np.random.default_rng(seed)
    ids, counts = np.unique(trace.hashes, return_counts=True)
    popular = set(ids[counts >= max(2, shared_share * len(trace))].tolist())
    groups: dict = {}
    keep_row = np.zeros(len(trace), dtype=bool)
    for i in range(len(trace)):
        key = next((h for h in trace.hashes_of(i).tolist() if h not in popular), ("row", i))
        if key not in groups:
            groups[key] = rng.random() < keep
        keep_row[i] = groups[key]
    rows = np.flatnonzero(keep_row)
    return _from_rows(
        trace.arrival_us[rows],
        trace.isl[rows],
        trace.osl[rows],
        [trace.hashes_of(int(i)) for i in rows],
        trace.block_size,
        f"{trace.source} ({keep:.0%} of conversations, seed {seed})",
    )


@dataclass(frozen=True)
class SyntheticParams:
    """Parameters of `synthetic_trace` (defaults = the bench's synthetic workload).

    Attributes:
        sessions: sessions in the trace; session starts are a Poisson process of `session_rate_s`/s.
        system_prompts: distinct shared system prompts; a session picks one with Zipf(`zipf_s`) popularity.
        system_prompt_tokens: length of every system prompt (tokens).
        agent_share: share of sessions that are agent tool loops (the rest are chat sessions).
        chat_turns_mean: mean turns of a chat session (geometric, >= 1); think time between turns is
            exponential with mean `chat_think_s` after the previous turn's expected end.
        chat_user_tokens: mean new user tokens per chat turn (exponential, >= 16).
        agent_steps_mean: mean steps of an agent loop (geometric, >= 1); each step appends a tool
            result of mean `agent_tool_tokens` tokens after `agent_think_s` mean (exponential).
        output_tokens: mean output tokens per request (exponential, >= 1), appended to the context.
        block_size: tokens per hashed block.
    """

    sessions: int = 1200
    session_rate_s: float = 3.0
    system_prompts: int = 8
    zipf_s: float = 1.2
    system_prompt_tokens: int = 2048
    agent_share: float = 0.4
    chat_turns_mean: float = 4.0
    chat_user_tokens: int = 400
    chat_think_s: float = 20.0
    agent_steps_mean: float = 8.0
    agent_tool_tokens: int = 600
    agent_think_s: float = 2.0
    output_tokens: int = 250
    block_size: int = 64


def _block_id(space: int, k: int) -> int:
    return space + k


def synthetic_trace(p: SyntheticParams = SyntheticParams(), seed: int = 0) -> Trace:
    """Sessions over shared system prompts (`SyntheticParams`), as one arrival-ordered `Trace`.

    Every request's context = its system prompt + the whole history of its session (earlier inputs
    and outputs) + the new input; full blocks of the system prompt hash the same in every session,
    full blocks of the history the same in every later turn of the session (append-only context).
    """
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, p.system_prompts + 1, dtype=np.float64)
    pop = ranks**-p.zipf_s
    pop /= pop.sum()
    arrivals, isl, osl, hashes = [], [], [], []
    t = 0.0
    bs = p.block_size
    sp_blocks = p.system_prompt_tokens // bs
    for s in range(p.sessions):
        t += rng.exponential(1.0 / p.session_rate_s)
        sp = int(rng.choice(p.system_prompts, p=pop))
        agent = rng.random() < p.agent_share
        steps = int(rng.geometric(1.0 / (p.agent_steps_mean if agent else p.chat_turns_mean)))
        ctx = p.system_prompt_tokens
        now = t
        space = (s + 1) << 24
        for _ in range(steps):
            new = max(16, int(rng.exponential(p.agent_tool_tokens if agent else p.chat_user_tokens)))
            ctx += new
            out = max(1, int(rng.exponential(p.output_tokens)))
            full = ctx // bs
            ids = [_block_id(_SYS * (sp + 1), k) for k in range(min(sp_blocks, full))]
            ids += [_block_id(space, k) for k in range(len(ids), full)]
            arrivals.append(int(now * 1e6))
            isl.append(ctx)
            osl.append(out)
            hashes.append(splitmix64(np.asarray(ids, dtype=np.uint64)))
            ctx += out
            # next input after this turn's expected end (~20 ms/token decode) plus think time
            now += out * 0.02 + rng.exponential(p.agent_think_s if agent else p.chat_think_s)
    return _from_rows(arrivals, isl, osl, hashes, bs, f"synthetic(seed={seed})")


def azure_with_prefixes(
    trace: Trace, seed: int = 0, system_prompts: int = 8, zipf_s: float = 1.2, system_prompt_tokens: int = 1024
) -> Trace:
    """The Azure trace's arrivals and lengths with synthesised hashes: each request draws a shared
    system prompt (Zipf popularity) covering min(isl, `system_prompt_tokens`) tokens; the rest of its
    context is its own. Only the load shape is real; the prefix structure is this assumption."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, system_prompts + 1, dtype=np.float64)
    pop = ranks**-zipf_s
    pop /= pop.sum()
    bs = trace.block_size
    sp_blocks = system_prompt_tokens // bs
    hashes = []
    for i in range(len(trace)):
        sp = int(rng.choice(system_prompts, p=pop))
        full = int(trace.isl[i]) // bs
        ids = [_block_id(_SYS * (sp + 1), k) for k in range(min(sp_blocks, full))]
        ids += [_block_id((i + 1) << 24, k) for k in range(len(ids), full)]
        hashes.append(splitmix64(np.asarray(ids, dtype=np.uint64)))
    return _from_rows(trace.arrival_us, trace.isl, trace.osl, hashes, bs, f"{trace.source} (synthetic prefixes)")
