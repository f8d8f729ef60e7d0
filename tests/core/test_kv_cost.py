"""The default `kv` cost (docs/ROUTING.md): idle-fleet spreading with affinity kept, no shallow/deep tie,
pure `select`, cost terms in `explain`."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from kvsched.config import SelectorConfig
from kvsched.core.kv_cost import KvSelector
from kvsched.core.selector import SelectionView, create_selector
from kvsched.core.types import Admit

from .factories import make_config, make_request, make_scheduler

SYSTEM = [9_000 + k for k in range(4)]  # a system prompt shared by every session (4 blocks)


def _turn(s, rid: str, hashes: list[int], now_us: int) -> Admit:
    outs = s.enqueue(make_request(rid, isl_tokens=16 * len(hashes), block_hashes=hashes, owner=1), now_us)
    admit = next(o for o in outs if isinstance(o, Admit))
    s.release(rid, admit.slot, admit.generation, "completed", 16 * len(hashes) + 10, now_us + 1)
    s.drain_cleanup(now_us + 1)
    return admit


def _paced_sessions(kind: str, seed: int, sessions: int = 40) -> tuple[Counter, int]:
    """Paced agent sessions on 2 idle workers (each turn ends before the next request arrives):
    first-turn split per worker, and how many second turns went back to their session's worker."""
    s = make_scheduler(make_config(selector=SelectorConfig(type=kind, seed=seed)), workers=((1, 0), (2, 0)),
                       total_kv_blocks=100_000, max_num_batched_tokens=8192)
    home, back, now = {}, 0, 0
    for i in range(sessions):  # a new session every 5 s; its second turn 2 s after its first
        now += 5_000_000
        own = [100_000 * (i + 1) + k for k in range(20)]
        home[i] = _turn(s, f"s{i}t1", SYSTEM + own[:12], now).worker
        back += _turn(s, f"s{i}t2", SYSTEM + own, now + 2_000_000).worker == home[i]
    return Counter(home.values()), back


@pytest.mark.parametrize("seed", range(8))
def test_idle_fleet_spreads_sessions_and_later_turns_keep_affinity(seed):
    split, back = _paced_sessions("kv", seed)
    assert len(split) == 2 and min(split.values()) >= 16, split  # 40 sessions on 2 workers: near 20/20, never 30/10
    assert back == 40


def test_dynamo_cost_piles_paced_sessions_on_the_system_prompt_holder():
    """The former default (Dynamo's cost): nothing in flight, so the worker holding the shared prompt wins
    every first turn — the failure the recent-work term fixes."""
    split, _ = _paced_sessions("dynamo_cost", 0)
    assert max(split.values()) >= 35, split


def _view(prefill, blocks, active_prefill=None, isl=320, bs=16, now_us=0, mbt=8192):
    w = len(prefill)
    ap = np.zeros(w, np.int64) if active_prefill is None else np.asarray(active_prefill, np.int64)
    return SelectionView(np.asarray(prefill, np.int64), np.asarray(blocks, np.int64), ap, np.zeros(w, np.int64),
                         np.full(w, 10_000, np.int64), np.full(w, mbt, np.int64), isl, bs, now_us)


def test_deeper_overlap_never_costs_more_and_never_ties_a_shallower_one():
    sel = KvSelector(seed=0, lead_bonus=0.0, recent_weight=0.0)
    elig = np.ones(2, np.uint8)
    for shallow in range(0, 20):
        for deep in range(shallow + 1, 21):
            depth = np.array([shallow, deep], np.int32)
            prefill = [320 - 16 * shallow, 320 - 16 * deep]
            t = sel.terms(np.zeros(2), elig, depth, _view(prefill, [20 - shallow, 20 - deep]))
            total = sum(t.values())
            assert total[1] < total[0]


def test_lead_bonus_goes_to_the_unique_deepest_row_and_is_capped_and_released():
    sel = KvSelector(seed=0, lead_bonus=10.0, lead_cap_blocks=3.0, recent_weight=0.0, lead_release_steps=1.0)
    elig = np.ones(3, np.uint8)
    t = sel.terms(np.zeros(3), elig, np.array([1, 8, 2], np.int32), _view([0, 0, 0], [0, 0, 0]))
    assert t["lead"].tolist() == [0.0, -30.0, 0.0]
    t = sel.terms(np.zeros(3), elig, np.array([8, 8, 2], np.int32), _view([0, 0, 0], [0, 0, 0]))
    assert t["lead"].tolist() == [0.0, 0.0, 0.0]  # a tie for deepest: nobody leads
    busy = _view([0, 0, 0], [0, 0, 0], active_prefill=[0, 9000, 0], mbt=8192)
    t = sel.terms(np.zeros(3), elig, np.array([1, 8, 2], np.int32), busy)
    assert t["lead"].tolist() == [0.0, 0.0, 0.0]  # leader saturated: released


def test_select_is_pure_and_admitted_learns():
    sel = KvSelector(seed=3)
    elig = np.ones(3, np.uint8)
    view = _view([320, 320, 320], [20, 20, 20])
    picks = [sel.select(np.zeros(3), elig, np.zeros(3, np.int64), overlap_blocks=np.zeros(3, np.int32), view=view)
             for _ in range(300)]
    assert set(picks) == {0, 1, 2} and sel.recent.size == 0  # ties: random; no state learnt by select
    sel.admitted(1, 4000, 0)
    assert all(sel.select(np.zeros(3), elig, np.zeros(3, np.int64), overlap_blocks=np.zeros(3, np.int32),
                          view=view) != 1 for _ in range(50))
    later = _view([320, 320, 320], [20, 20, 20], now_us=10 * 30_000_000)  # 10 half-lives later: forgotten
    t = sel.terms(np.zeros(3), elig, np.zeros(3, np.int32), later)
    assert t["recent"][1] < 0.25


def test_explain_shows_the_cost_terms_summing_to_the_cost():
    s = make_scheduler(workers=((1, 0), (2, 0)))
    s.enqueue(make_request("a", isl_tokens=64, block_hashes=[1, 2, 3, 4], owner=1), 0)
    rep = s.explain("a")
    assert rep is not None and len(rep.rows) == 2
    for row in rep.rows:
        assert set(row.terms) == {"prefill", "active_blocks", "lead", "recent"}
        assert sum(row.terms.values()) == pytest.approx(row.cost)


def test_create_selector_passes_the_kv_keys():
    sel = create_selector(SelectorConfig(type="kv", prefill_weight=3.0, lead_bonus=0.5, recent_half_life_s=7.0))
    assert isinstance(sel, KvSelector)
    assert (sel.prefill_weight, sel.lead_bonus, sel.recent_half_life_us) == (3.0, 0.5, 7e6)
