"""The routing baselines of the kvsched-bench distribution (bench/kvsched_bench/selectors.py,
docs/ROUTING.md): each rule, the cache-aware registry's guardrails, what `kvsched explain` shows for them,
and a real daemon configured with one. They need kvsched-bench installed (`make test` installs it).

Moved here with the baselines: the cache_aware / lmetric / llmd / llmd_sticky rule tests of
tests/core/test_selector.py, the two cache_aware guardrails of tests/core/test_guardrails.py, Dynamo's
cost on paced sessions of tests/core/test_kv_cost.py and the baseline cases of
tests/core/test_explain_selector.py.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from importlib.metadata import entry_points

import numpy as np
import pytest
from kvsched_bench.selectors import (
    CacheAwareSelector,
    DynamoCostSelector,
    LlmdSelector,
    LlmdStickySelector,
    LMetricSelector,
)
from typer.testing import CliRunner

from kvsched import protocol as p
from kvsched.cli import app
from kvsched.client import SchedulerClient
from kvsched.config import SelectorConfig
from kvsched.core.selector import create_selector
from tests.conftest import TWO_WORKERS, admin_call, purge, start_daemon
from tests.core.factories import make_class, make_config, make_request, make_scheduler
from tests.core.test_explain_selector import _decide, _render
from tests.core.test_kv_cost import _paced_sessions

BASELINES = {
    "dynamo_cost": DynamoCostSelector,
    "cache_aware": CacheAwareSelector,
    "lmetric": LMetricSelector,
    "llmd": LlmdSelector,
    "llmd_sticky": LlmdStickySelector,
}
NONE = np.zeros(6, np.int64)


def sel(kind, **kw):
    return create_selector(SelectorConfig(type=kind, seed=kw.pop("seed", 1), **kw))


# ---- registration ---------------------------------------------------------------------------------
def test_kvsched_bench_registers_the_five_baselines_in_the_selectors_group():
    eps = {ep.name: ep for ep in entry_points(group="kvsched.selectors")}
    assert {n for n, ep in eps.items() if ep.dist.name == "kvsched-bench"} == set(BASELINES)
    for name, cls in BASELINES.items():
        assert eps[name].load() is cls and cls.name == name
        assert type(sel(name)) is cls


# ---- the rules ------------------------------------------------------------------------------------
def test_every_baseline_returns_minus_one_when_none_eligible():
    for kind in BASELINES:
        assert sel(kind).select(np.zeros(3), np.zeros(3, np.uint8), np.zeros(3, np.int64)) == -1


def test_dynamo_cost_picks_the_lowest_projection_cost_with_a_uniform_tie_break():
    s = sel("dynamo_cost")
    costs = np.array([5.0, 2.0, 1.0, 3.0])
    assert s.select(costs, np.array([1, 1, 1, 1], np.uint8), NONE) == 2
    assert s.select(costs, np.array([1, 1, 0, 1], np.uint8), NONE) == 1
    counts = Counter(
        s.select(np.array([1.0, 4.0, 1.0, np.inf]), np.array([1, 1, 1, 0], np.uint8), NONE) for _ in range(2000)
    )
    assert set(counts) == {0, 2} and 850 < counts[0] < 1150


def test_dynamo_cost_piles_paced_sessions_on_the_system_prompt_holder():
    """The former default (Dynamo's cost): nothing in flight, so the worker holding the shared prompt wins
    every first turn — the failure the recent-work term of `kv` fixes (tests/core/test_kv_cost.py)."""
    split, _ = _paced_sessions("dynamo_cost", 0)
    assert max(split.values()) >= 35, split


def test_cache_aware_prefers_longest_match_when_above_threshold():
    s = sel("cache_aware")
    elig = np.ones(4, np.uint8)
    active = np.array([3, 0, 5, 1], np.int64)
    depth = np.array([2, 0, 6, 1], np.int32)  # 6 of 10 blocks > 0.3
    assert {s.select(np.zeros(4), elig, active, overlap_blocks=depth, request_blocks=10) for _ in range(20)} == {2}
    # the longest match ties: fewer active requests wins
    depth = np.array([6, 0, 6, 1], np.int32)
    assert s.select(np.zeros(4), elig, active, overlap_blocks=depth, request_blocks=10) == 0


def test_cache_aware_picks_smallest_cache_when_match_below_threshold():
    s = sel("cache_aware")
    elig = np.ones(3, np.uint8)
    active = np.zeros(3, np.int64)
    none = np.zeros(3, np.int32)
    picks = []
    for _ in range(3):
        picks.append(s.select(np.zeros(3), elig, active, overlap_blocks=none, request_blocks=10))
        s.note_admitted(picks[-1], 0, 10)  # each admission grows that row's cache
    assert set(picks) == {0, 1, 2}
    low = np.array([2, 0, 0], np.int32)  # 2 of 10 blocks: not above 0.3, so no cache affinity
    s.note_admitted(0, 2, 10)
    assert s.select(np.zeros(3), elig, active, overlap_blocks=low, request_blocks=10) in (1, 2)


def test_cache_aware_falls_back_to_least_loaded_when_imbalanced():
    s = sel("cache_aware")
    elig = np.array([1, 1, 1, 0], np.uint8)
    depth = np.array([10, 0, 0, 0], np.int32)  # full match on row 0 ...
    active = np.array([100, 20, 30, 0], np.int64)  # ... but 100 - 20 > 64 and 100 > 1.5 * 20
    assert s.select(np.zeros(4), elig, active, overlap_blocks=depth, request_blocks=10) == 1
    balanced = np.array([70, 20, 30, 0], np.int64)  # 70 - 20 <= 64: cache affinity again
    assert s.select(np.zeros(4), elig, balanced, overlap_blocks=depth, request_blocks=10) == 0


def _view(active_prefill, active_blocks=None, isl=160, bs=16, mbt=100):
    from kvsched.core.selector import SelectionView

    w = len(active_prefill)
    ap = np.asarray(active_prefill, np.int64)
    ab = np.zeros(w, np.int64) if active_blocks is None else np.asarray(active_blocks, np.int64)
    return SelectionView(
        ap + isl, ab + isl // bs, ap, ab, np.full(w, 100, np.int64), np.full(w, mbt, np.int64), isl, bs, 0
    )


def test_lmetric_multiplies_new_prefill_tokens_by_batch_size():
    s = sel("lmetric")
    elig = np.ones(3, np.uint8)
    depth = np.array([8, 2, 0], np.int32)  # new tokens 32, 128, 160 (isl 160, B 16)
    active = np.array([4, 1, 1], np.int64)  # scores 128, 128, 160: tie -> fewer new tokens (row 0)
    assert s.select(np.zeros(3), elig, active, overlap_blocks=depth, view=_view([0, 0, 0])) == 0
    active = np.array([5, 1, 1], np.int64)  # 160, 128, 160
    assert s.select(np.zeros(3), elig, active, overlap_blocks=depth, view=_view([0, 0, 0])) == 1


def test_llmd_weights_prefix_3_queue_2_kv_2():
    s = sel("llmd")
    elig = np.ones(2, np.uint8)
    # row 0: full prefix match (3) but the longest queue (0) and half the KV used (1) -> 4
    # row 1: no match (0), shortest queue (2), empty KV (2) -> 4 ... tie broken by adding one KV block on row 1
    view = _view([0, 0], active_blocks=[50, 1])
    assert (
        s.select(
            np.zeros(2),
            elig,
            np.array([3, 0], np.int64),
            overlap_blocks=np.array([10, 0], np.int32),
            request_blocks=10,
            view=view,
        )
        == 0
    )
    view = _view([0, 0], active_blocks=[60, 0])
    assert (
        s.select(
            np.zeros(2),
            elig,
            np.array([3, 0], np.int64),
            overlap_blocks=np.array([10, 0], np.int32),
            request_blocks=10,
            view=view,
        )
        == 1
    )


def test_llmd_sticky_keeps_affinity_until_tau_then_releases_it():
    s = sel("llmd_sticky")
    elig = np.ones(2, np.uint8)
    depth = np.array([2, 0], np.int32)  # a shallow match: plain llmd prefers the idle row 1
    active = np.array([5, 0], np.int64)
    assert (
        sel("llmd").select(np.zeros(2), elig, active, overlap_blocks=depth, request_blocks=10, view=_view([3500, 0]))
        == 1
    )
    tau = 35 * 100
    assert s.select(np.zeros(2), elig, active, overlap_blocks=depth, request_blocks=10, view=_view([tau, 0])) == 0
    assert s.select(np.zeros(2), elig, active, overlap_blocks=depth, request_blocks=10, view=_view([tau + 1, 0])) == 1


# ---- guardrails: selectors are side-effect free (moved from tests/core/test_guardrails.py) ----------
def test_cache_aware_select_records_nothing_until_admitted():
    s = create_selector(SelectorConfig(type="cache_aware", seed=0))
    elig = np.ones(2, np.uint8)
    picks = {
        s.select(np.zeros(2), elig, np.zeros(2, np.int64), overlap_blocks=np.zeros(2, np.int32), request_blocks=10)
        for _ in range(20)
    }
    assert not s.cache_blocks.any()
    assert picks == {0, 1}  # nothing recorded: both rows stay the smallest cache


def test_cache_aware_registry_skips_request_whose_owner_is_gone():
    dead = {5}
    cfg = make_config(
        [make_class("default", prefill_busy_threshold=500)], selector=SelectorConfig(type="cache_aware", seed=0)
    )
    s = make_scheduler(cfg, workers=((1, 0), (2, 0)), owner_alive=lambda o: o not in dead)
    assert s.enqueue(make_request("gone", owner=5, block_hashes=[1, 2, 3, 4, 5, 6]), 0) == []
    assert not s.selector.cache_blocks.any()
    got = s.enqueue(make_request("ok", owner=1, block_hashes=[1, 2, 3, 4, 5, 6]), 1)
    assert len(got) == 1
    assert int(s.selector.cache_blocks.sum()) == 6
    assert int(s.selector.cache_blocks[s.ledger.row_of(got[0].worker)]) == 6


# ---- explain (moved from tests/core/test_explain_selector.py) ---------------------------------------
@pytest.mark.parametrize("selector", ["lmetric", "llmd", "llmd_sticky", "cache_aware"])
def test_a_baseline_selector_is_named_and_its_cost_column_marked_not_used(selector):
    reply = _decide(selector)
    assert reply.decided_by == selector
    assert all(not r.terms for r in reply.rows)  # no cost decided: the rows carry no terms
    text = _render(reply)
    assert f"by selector {selector}" in text
    assert f"dynamo_cost (not used by {selector})" in text


def test_dynamo_cost_is_named_and_its_cost_column_is_the_cost():
    reply = _decide("dynamo_cost")
    assert reply.decided_by == "dynamo_cost"
    text = _render(reply)
    assert "by selector dynamo_cost" in text and "not used" not in text
    chosen = next(r for r in reply.rows if (r.worker_id, r.dp_rank) == (reply.chosen_worker_id, reply.chosen_dp_rank))
    assert chosen.cost == min(r.cost for r in reply.rows if r.eligible)
    assert set(chosen.terms) == {"prefill", "active_blocks"}
    assert chosen.terms["prefill"] + chosen.terms["active_blocks"] == pytest.approx(chosen.cost)


# ---- a real daemon ------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_a_daemon_configured_with_a_baseline_loads_it_from_kvsched_bench(tmp_path):
    """A real `kvsched-daemon` with `[selector] type = "cache_aware"`: the decisions are that
    baseline's (explain names it, and its rule shows: a request with no cached prefix goes to the
    worker with the smaller approximate cache, one matching > 30 % of a cached prefix goes back)."""
    d = start_daemon(tmp_path, TWO_WORKERS + '\n[selector]\ntype = "cache_aware"\nseed = 0\n')
    first, other, again = [11, 12, 13, 14], [21, 22, 23, 24], [11, 12, 13, 99]

    async def route(rid: str, hashes: list[int]) -> tuple[int, int]:
        async with SchedulerClient(d.endpoint) as client:
            lease = await client.schedule(rid, isl_tokens=16 * len(hashes), block_hashes=hashes)
            where = (lease.worker.worker_id, lease.worker.dp_rank)
            lease.release()
        return where

    try:
        a = asyncio.run(route("a", first))
        b = asyncio.run(route("b", other))
        c = asyncio.run(route("c", again))
        assert b != a and c == a, (a, b, c)
        for rid in ("a", "b", "c"):
            assert admin_call(d, p.Explain(request_id=rid)).decided_by == "cache_aware"
        out = CliRunner().invoke(app, ["--admin-endpoint", d.admin_endpoint, "explain", "b", "--json"])
        assert out.exit_code == 0, out.output
        explained = json.loads(out.output)
        assert explained["decided_by"] == "cache_aware"
        assert all(not row["terms"] for row in explained["rows"])  # it did not decide by a cost
    finally:
        d.stop()
        purge(d.instance)
