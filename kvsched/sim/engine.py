"""The simulated engine: one LLM engine instance (one worker rank) in virtual time (µs), no I/O.

One model, two drivers: the virtual-time discrete-event driver (`sim/virtual.py`) and the wall-clock
fleet process (`sim/fleet.py`) both drive `SimEngine` through the same four calls:

    engine.submit(request, now_us)     # a request reaches the engine
    engine.next_step_end()             # when the next (macro) step would end, None if idle
    engine.step()                      # commit that step; returns FIRST_TOKEN / DONE events
    engine.advance(until_us)           # step while the next step ends at or before until_us

What is modelled (vLLM v1-like):
- **Prefix cache** of `kv_blocks` blocks keyed by block hash. A request's cached prefix is its leading
  run of hashes present in the cache (stop at the first miss). Blocks of running requests are pinned;
  a finished request's prompt blocks stay cached, unpinned, in LRU order (tail blocks first, as vLLM
  frees them in reverse so shared prefixes outlive their leaves). A newly computed block becomes
  visible to other requests when its request's prefill completes.
- **Continuous batching** with a per-step token budget (`max_num_batched_tokens`): every decoding
  request takes one token, then running prefills and then waiting requests (FCFS, chunked prefill)
  share what is left. At least one prompt token is always computed (a full hit recomputes the last).
- **Step time** (µs) = `step_base_us`
  + Σ over prefill chunks of c·(`prefill_us_per_token` + `prefill_attn_us_per_token_ktoken`·ctx/1000)
  + n_decode·`decode_us_per_seq` + `decode_us_per_ctx_token`·(context tokens of the decoding requests),
  where ctx is the mean causal context of the chunk's tokens.
- **KV memory**: a request reserves ceil((isl + osl) / block_size) blocks when its prefill starts
  (hits pinned, the rest allocated, evicting unpinned cached blocks LRU-first); a request that does not
  fit waits (FCFS, head of line). Simplification: no preemption. A request larger than the whole cache
  still runs when it is alone (the engine over-commits rather than deadlocks).
- **Macro steps**: while only decodes run, the engine commits up to the next completion (or the next
  not-yet-eligible arrival, or `max_macro_us`) in one call, with the exact arithmetic-series duration,
  so cost is per event, not per token.

The blocks (prefix cache, LRU, anonymous blocks) are `sim/prefix_cache.py`'s `PrefixCache`; this
module is the batch scheduler over it (waiting / prefill / decode, step plans, step time, commits).
Cache changes can be observed (`cache_listener`, e.g. a `kvsched.sim.kv_publisher.KvEventPublisher`):
`block_stored(hashes, parent, block_size)` when blocks enter the prefix cache (at prefill end, one
call per contiguous run of newly registered hashes) and `block_removed(hashes)` when blocks are
evicted — the same changes vLLM publishes as BlockStored / BlockRemoved KV events.

Step-time coefficients and capacities live in `sim/profile.py` (with their sources).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .prefix_cache import PrefixCache
from .profile import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PROFILE,
    EngineProfile,
    decode_steps_us,
    decode_us,
)

FIRST_TOKEN = 1  # event kind: prefill finished, first output token produced
DONE = 2  # event kind: last output token produced, request left the engine

_WAITING, _PREFILL, _DECODE = 0, 1, 2


@dataclass(frozen=True, slots=True)
class SimRequest:
    """A request as the engine sees it.

    Attributes:
        request_id: unique among the engine's live requests.
        isl: prompt tokens (>= 1).
        osl: output tokens to generate (>= 1; 0 is treated as 1).
        hashes: chained prefix-block hashes (ints), at most ceil(isl / block_size).
    """

    request_id: str
    isl: int
    osl: int
    hashes: tuple[int, ...] | list[int] = ()


@dataclass(slots=True)
class SeqRecord:
    """Per-request report, filled in as the request runs (all times in engine µs).

    Attributes:
        submit_us: when the request reached the engine.
        start_us: when its prefill started (blocks allocated), -1 before.
        first_token_us: when its prefill finished and the first token came out, -1 before.
        done_us: when its last token came out, -1 before.
        cached_tokens: prompt tokens served from the prefix cache at prefill start.
        output_tokens: output tokens produced so far.
    """

    request: SimRequest
    submit_us: int
    start_us: int = -1
    first_token_us: int = -1
    done_us: int = -1
    cached_tokens: int = 0
    output_tokens: int = 0


@dataclass(slots=True)
class _Seq:
    rec: SeqRecord
    hashes: list[int]
    osl: int
    need_blocks: int  # blocks reserved for prompt + output
    state: int = _WAITING
    computed: int = 0  # prompt tokens computed or cached
    hits: int = 0  # leading hashes pinned from the cache
    anon: int = 0  # blocks held that are not (yet) registered under a hash
    registered: int = 0  # leading hashes this request holds a reference on


@dataclass(slots=True)
class _Plan:
    end_us: int
    steps: int  # > 1 only for a decode-only macro step
    starts: list[tuple[_Seq, int]] = field(default_factory=list)  # (seq, prefix hit blocks)
    chunks: list[tuple[_Seq, int]] = field(default_factory=list)  # (seq, prompt tokens this step)


@dataclass(slots=True)
class EngineStats:
    """Cumulative counters of one engine."""

    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of requests whose prefill started
    cached_tokens: int = 0  # of which served from the prefix cache
    evicted_blocks: int = 0
    finished: int = 0


class SimEngine:
    """One simulated engine (module docstring). Pure and deterministic; time is virtual µs.

    Invariant: the cache's own (`PrefixCache`); only `step()` changes the cache; `clock_us` never
    decreases.
    """

    def __init__(
        self,
        kv_blocks: int,
        block_size: int,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        profile: EngineProfile = DEFAULT_PROFILE,
        max_macro_us: int = 1_000_000,
    ) -> None:
        if kv_blocks < 1 or block_size < 1 or max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("kv_blocks, block_size, max_num_batched_tokens and max_num_seqs must be >= 1")
        self.kv_blocks = kv_blocks
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.profile = profile
        self.max_macro_us = max(1, max_macro_us)
        self.clock_us = 0
        self.stats = EngineStats()
        self.cache = PrefixCache(kv_blocks, block_size)  # the KV blocks: hash refs, LRU, anonymous blocks
        self._waiting: deque[_Seq] = deque()
        self._prefill: list[_Seq] = []
        self._decode: list[_Seq] = []
        self._decode_ctx = 0  # context tokens (isl + output) of the decoding requests
        self._live: dict[str, _Seq] = {}
        self._plan: _Plan | None = None

    @property
    def cache_listener(self) -> Any:
        """Observer of prefix-cache changes (module docstring), or None."""
        return self.cache.listener

    @cache_listener.setter
    def cache_listener(self, listener: Any) -> None:
        self.cache.listener = listener

    # ---------------------------------------------------------------- public API

    def submit(self, request: SimRequest, now_us: int) -> SeqRecord:
        """Queue `request` at `now_us`; it can join the first step that starts at or after now_us."""
        if request.request_id in self._live:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if not self._live:
            self.clock_us = max(self.clock_us, now_us)
        now_us = max(now_us, 0)
        total = request.isl + max(1, request.osl)
        seq = _Seq(
            rec=SeqRecord(request=request, submit_us=now_us),
            hashes=list(request.hashes),
            osl=max(1, request.osl),
            need_blocks=-(-total // self.block_size),
        )
        self._waiting.append(seq)
        self._live[request.request_id] = seq
        self._plan = None
        return seq.rec

    def next_step_end(self) -> int | None:
        """End time (µs) of the step the engine would run next, or None when it has nothing to do."""
        if self._plan is None:
            if not self._live:
                return None
            self._plan = self._make_plan()
        return self._plan.end_us

    def step(self) -> list[tuple[int, SeqRecord]]:
        """Commit the next step; returns its events `(FIRST_TOKEN | DONE, record)` in time order."""
        if self.next_step_end() is None:
            return []
        plan = self._plan
        assert plan is not None
        self._plan = None
        self.stats.steps += plan.steps
        if not plan.chunks:
            return self._commit_decode(plan.steps, plan.end_us)
        return self._commit_step(plan)

    def advance(self, until_us: int) -> list[tuple[int, SeqRecord]]:
        """Run every step that ends at or before `until_us`; idle engines move their clock there."""
        events: list[tuple[int, SeqRecord]] = []
        while True:
            end = self.next_step_end()
            if end is None:
                self.clock_us = max(self.clock_us, until_us)
                return events
            if end > until_us:
                return events
            events.extend(self.step())

    def running(self) -> list[SeqRecord]:
        """Records of the requests currently decoding (for progress reports)."""
        return [s.rec for s in self._decode]

    @property
    def num_live(self) -> int:
        """Requests in the engine (waiting, prefilling or decoding)."""
        return len(self._live)

    @property
    def used_blocks(self) -> int:
        """Blocks in use: cached (pinned or not) plus anonymous."""
        return self.cache.used_blocks

    def cached_prefix_blocks(self, hashes: list[int] | tuple[int, ...]) -> int:
        """Leading blocks of `hashes` present in the cache now (pinned or not)."""
        return self.cache.prefix_blocks(hashes)

    # ---------------------------------------------------------------- planning (pure)

    def _make_plan(self) -> _Plan:
        p = self.profile
        start = self.clock_us
        plan = _Plan(end_us=start, steps=1)
        budget = self.max_num_batched_tokens - len(self._decode)
        for seq in self._prefill:
            if budget <= 0:
                break
            c = min(seq.rec.request.isl - seq.computed, budget)
            plan.chunks.append((seq, c))
            budget -= c
        self._plan_starts(plan, budget, start)
        if not plan.chunks and not self._decode:
            # Nothing can run now: the waiting head is not eligible yet (arrives later).
            nxt = min(s.rec.submit_us for s in self._waiting)
            self.clock_us = max(start, nxt)
            return self._make_plan()
        if not plan.chunks:
            return self._plan_decode(start)
        dur = p.step_base_us + decode_us(p, len(self._decode), self._decode_ctx)
        for seq, c in plan.chunks:
            ctx = seq.computed + (c - 1) / 2.0
            dur += c * (p.prefill_us_per_token + p.prefill_attn_us_per_token_ktoken * ctx / 1000.0)
        plan.end_us = start + max(1, round(dur))
        return plan

    def _plan_starts(self, plan: _Plan, budget: int, start: int) -> None:
        """Admit waiting requests (FCFS, head of line) into this step while budget and blocks last."""
        running = len(self._prefill) + len(self._decode)
        cache = self.cache
        lru = cache.lru
        free = self.kv_blocks - cache.used_blocks
        evictable = len(lru)
        for seq in self._waiting:
            if budget <= 0 or running >= self.max_num_seqs or seq.rec.submit_us > start:
                return
            hits = cache.prefix_blocks(seq.hashes)
            pinned_from_lru = sum(1 for h in seq.hashes[:hits] if h in lru)
            need = seq.need_blocks - hits
            avail = free + evictable - pinned_from_lru
            alone = running == 0 and not plan.starts
            if need > avail and not alone:
                return
            plan.starts.append((seq, hits))
            cached = min(hits * self.block_size, seq.rec.request.isl - 1)
            c = min(seq.rec.request.isl - cached, budget)
            plan.chunks.append((seq, c))
            seq.computed = cached  # context for the chunk cost; `_start` sets it again at commit
            budget -= c
            running += 1
            take = min(need, free)
            free -= take
            evictable = max(0, evictable - pinned_from_lru - (need - take))

    def _macro_time(self, k: int) -> float:
        """Duration (µs) of k decode-only steps with the batch unchanged (context grows by n per step)."""
        return decode_steps_us(self.profile, len(self._decode), self._decode_ctx, k)

    def _plan_decode(self, start: int) -> _Plan:
        k = min(s.osl - s.rec.output_tokens for s in self._decode)
        horizon = start + self.max_macro_us
        later = [s.rec.submit_us for s in self._waiting if s.rec.submit_us > start]
        if later:
            horizon = min(horizon, min(later))
        # Smallest k' whose last step starts before the horizon and covers it (or ends at it).
        if self._macro_time(k) > horizon - start:
            lo, hi = 1, k
            while lo < hi:
                mid = (lo + hi) // 2
                if start + self._macro_time(mid) >= horizon:
                    hi = mid
                else:
                    lo = mid + 1
            k = lo
        return _Plan(end_us=start + max(1, round(self._macro_time(k))), steps=k)

    # ---------------------------------------------------------------- commit (mutating)

    def _commit_decode(self, k: int, end_us: int) -> list[tuple[int, SeqRecord]]:
        events: list[tuple[int, SeqRecord]] = []
        n = len(self._decode)
        self._decode_ctx += n * k
        still: list[_Seq] = []
        for seq in self._decode:
            seq.rec.output_tokens += k
            if seq.rec.output_tokens >= seq.osl:
                self._finish(seq, end_us)
                events.append((DONE, seq.rec))
            else:
                still.append(seq)
        self._decode = still
        self.clock_us = end_us
        return events

    def _commit_step(self, plan: _Plan) -> list[tuple[int, SeqRecord]]:
        end = plan.end_us
        for seq, _ in plan.starts:
            self._start(seq, self.clock_us)
        events = self._commit_decode(1, end) if self._decode else []
        self.clock_us = end
        joined: list[_Seq] = []
        for seq, c in plan.chunks:
            seq.computed += c
            if seq.computed >= seq.rec.request.isl:
                joined.append(seq)
        for seq in joined:
            self._prefill.remove(seq)
            self._register(seq)
            seq.rec.first_token_us = end
            seq.rec.output_tokens = 1
            events.append((FIRST_TOKEN, seq.rec))
            if seq.osl <= 1:
                self._finish(seq, end)
                events.append((DONE, seq.rec))
            else:
                seq.state = _DECODE
                self._decode.append(seq)
                self._decode_ctx += seq.rec.request.isl + 1
        return events

    def _start(self, seq: _Seq, now_us: int) -> None:
        """Pin the cached prefix, allocate the rest (evicting LRU-first), enter prefill.

        Hits are counted again here: an earlier start in the same step may have evicted blocks.
        """
        self._waiting.remove(seq)
        hits = self.cache.prefix_blocks(seq.hashes)
        seq.hits = seq.registered = hits
        need = seq.need_blocks - hits
        self.stats.evicted_blocks += self.cache.pin_and_allocate(seq.hashes, hits, need)
        seq.anon = need
        isl = seq.rec.request.isl
        seq.rec.cached_tokens = min(hits * self.block_size, isl - 1)
        seq.rec.start_us = now_us
        seq.computed = seq.rec.cached_tokens
        seq.state = _PREFILL
        self._prefill.append(seq)
        self.stats.prompt_tokens += isl
        self.stats.cached_tokens += seq.rec.cached_tokens

    def _register(self, seq: _Seq) -> None:
        """Prefill done: the request's newly computed prompt blocks become cache entries."""
        self.cache.register(seq.hashes, seq.registered)
        seq.anon -= len(seq.hashes) - seq.registered
        seq.registered = len(seq.hashes)

    def _finish(self, seq: _Seq, now_us: int) -> None:
        """Unpin the prompt blocks (tail first into the LRU), free the anonymous ones."""
        self.cache.release(seq.hashes[: seq.registered], seq.anon)
        seq.anon = 0
        if seq.state == _DECODE:
            self._decode_ctx -= seq.rec.request.isl + seq.rec.output_tokens
        seq.rec.done_us = now_us
        del self._live[seq.rec.request.request_id]
        self.stats.finished += 1
