"""Engine model: prefix cache (LRU, prefix-only hits), batching, step-time growth."""

from __future__ import annotations

from kvsched.sim.engine import DONE, FIRST_TOKEN, SimEngine, SimRequest
from kvsched.sim.profile import EngineProfile, decode_steps_us

BS = 4


def make_engine(**kw) -> SimEngine:
    kw.setdefault("kv_blocks", 64)
    kw.setdefault("block_size", BS)
    kw.setdefault("max_num_batched_tokens", 64)
    return SimEngine(**kw)


def run_all(engine: SimEngine) -> list[tuple[int, object]]:
    events = []
    while engine.next_step_end() is not None:
        events.extend(engine.step())
    return events


def req(rid: str, hashes, isl=None, osl=2) -> SimRequest:
    hashes = tuple(hashes)
    return SimRequest(rid, isl if isl is not None else len(hashes) * BS, osl, hashes)


def test_finished_prompt_blocks_stay_cached_when_request_completes():
    e = make_engine()
    e.submit(req("a", [1, 2, 3]), 0)
    run_all(e)
    assert e.num_live == 0
    assert e.cached_prefix_blocks((1, 2, 3)) == 3
    rec = e.submit(req("b", [1, 2, 3, 4]), e.clock_us)
    run_all(e)
    assert rec.cached_tokens == 3 * BS


def test_hits_stop_at_first_miss_when_prefix_differs():
    e = make_engine()
    e.submit(req("a", [1, 2, 3]), 0)
    run_all(e)
    rec = e.submit(req("b", [9, 2, 3]), e.clock_us)
    run_all(e)
    assert rec.cached_tokens == 0
    rec = e.submit(req("c", [1, 7, 3]), e.clock_us)
    run_all(e)
    assert rec.cached_tokens == BS


def test_full_hit_recomputes_last_token_when_whole_prompt_cached():
    e = make_engine()
    e.submit(req("a", [1, 2]), 0)
    run_all(e)
    rec = e.submit(req("b", [1, 2]), e.clock_us)
    run_all(e)
    assert rec.cached_tokens == 2 * BS - 1


def test_lru_evicts_oldest_unpinned_blocks_when_cache_full():
    # 8 blocks; each request needs 3 prompt + 1 output block.
    e = make_engine(kv_blocks=8)
    for rid, hs in (("a", [1, 2, 3]), ("b", [11, 12, 13])):
        e.submit(req(rid, hs, osl=1), e.clock_us)
        run_all(e)
    assert e.used_blocks == 6
    e.submit(req("a2", [1, 2, 3], osl=1), e.clock_us)  # touch a's blocks: b's become the oldest
    run_all(e)
    e.submit(req("c", [21, 22, 23], osl=1), e.clock_us)  # needs 4, 2 free: evicts 2 of b's
    run_all(e)
    assert e.cached_prefix_blocks((1, 2, 3)) == 3
    assert e.cached_prefix_blocks((21, 22, 23)) == 3
    # b's tail blocks were evicted first, so its head block survives
    assert e.cached_prefix_blocks((11, 12, 13)) == 1
    assert e.stats.evicted_blocks == 2


def test_running_blocks_are_pinned_when_cache_pressure():
    e = make_engine(kv_blocks=8)
    e.submit(req("long", [1, 2, 3], osl=1000), 0)
    e.step()  # prefill done, decoding; holds 3 + 250 output blocks -> over-commits alone
    assert e.num_live == 1
    rec = e.submit(req("other", [5, 6], osl=1), e.clock_us)
    e.advance(e.clock_us + 1_000)
    assert rec.start_us == -1  # waits: the running request's blocks cannot be evicted
    run_all(e)
    assert rec.done_us > 0


def test_ttft_grows_with_uncached_tokens():
    ttft = []
    for cached in (0, 8, 16):
        e = make_engine(max_num_batched_tokens=4096, kv_blocks=4096)
        warm = list(range(1, 1 + cached))
        if warm:
            e.submit(req("w", warm, osl=1), 0)
            run_all(e)
        t0 = e.clock_us
        rec = e.submit(req("r", warm + list(range(100, 124 - cached))), t0)
        run_all(e)
        assert rec.cached_tokens == min(cached * BS, 24 * BS - 1)
        ttft.append(rec.first_token_us - t0)
    assert ttft[0] > ttft[1] > ttft[2]


def test_decode_step_grows_with_batch_size():
    p = EngineProfile()
    assert decode_steps_us(p, 8, 8000, 1) > decode_steps_us(p, 1, 1000, 1)

    def tpot(n: int) -> float:
        e = make_engine(kv_blocks=4096, max_num_batched_tokens=4096)
        recs = [e.submit(req(f"r{i}", [1000 * i + j for j in range(4)], osl=50), 0) for i in range(n)]
        run_all(e)
        return (recs[0].done_us - recs[0].first_token_us) / 49

    assert tpot(16) > tpot(1)


def test_chunked_prefill_respects_token_budget():
    e = make_engine(max_num_batched_tokens=16, kv_blocks=64)
    rec = e.submit(req("big", list(range(1, 11)), osl=1), 0)  # 40 prompt tokens
    steps = 0
    while rec.first_token_us < 0:
        e.step()
        steps += 1
    assert steps == 3


def test_events_report_first_token_then_done():
    e = make_engine()
    e.submit(req("a", [1, 2], osl=5), 0)
    events = run_all(e)
    kinds = [(k, r.request.request_id) for k, r in events]
    assert kinds == [(FIRST_TOKEN, "a"), (DONE, "a")]
    rec = events[-1][1]
    assert rec.output_tokens == 5 and rec.done_us > rec.first_token_us >= rec.start_us >= 0


def test_arrival_mid_decode_joins_next_step_when_submitted():
    e = make_engine(kv_blocks=4096)
    e.submit(req("a", [1, 2], osl=10_000), 0)
    e.step()  # prefill
    t = e.clock_us + 100_000
    assert e.next_step_end() > t  # a long macro decode step
    rec = e.submit(req("b", [5, 6], osl=1), t)
    e.advance(t + 200_000)
    assert t <= rec.start_us < t + 20_000


def test_advance_moves_idle_clock():
    e = make_engine()
    assert e.advance(5_000) == []
    assert e.clock_us == 5_000
    rec = e.submit(req("a", [1], osl=1), 7_000)
    run_all(e)
    assert rec.start_us == 7_000
