"""`kvsched explain` says which selector decided; for one that does not decide by a cost, Dynamo's cost
is marked as not used.

Was: under `round_robin` / `lmetric` / `llmd` the explain table headed Dynamo's cost "cost", as if it
had decided (docs/ROUTING.md: those selectors read active requests / overlap, not that cost). The
kvsched-bench baselines' cases are in tests/bench/test_baselines.py.
"""

from __future__ import annotations

import pytest
from rich.console import Console

from kvsched.cli.views import explain_table
from kvsched.config import SelectorConfig

from .factories import make_config, make_request, make_scheduler


def _decide(selector: str):
    s = make_scheduler(make_config(selector=SelectorConfig(type=selector, seed=0)), workers=((1, 0), (2, 0)))
    got = s.enqueue(make_request("a", isl_tokens=64, block_hashes=[1, 2, 3, 4]), 0)
    assert got and got[0].request_id == "a"
    return s.explain("a")


def _render(reply) -> str:
    console = Console(width=300, record=True)
    console.print(explain_table(reply))
    return console.export_text()


@pytest.mark.parametrize("selector", ["round_robin", "random", "least_loaded", "power_of_two"])
def test_a_selector_not_deciding_by_cost_is_named_and_its_cost_column_marked_not_used(selector):
    reply = _decide(selector)
    assert reply.decided_by == selector
    assert all(not r.terms for r in reply.rows)  # no cost decided: the rows carry no terms
    text = _render(reply)
    assert f"by selector {selector}" in text
    assert f"dynamo_cost (not used by {selector})" in text


@pytest.mark.parametrize("selector", ["kv"])
def test_a_cost_selector_is_named_and_its_cost_column_is_the_cost(selector):
    reply = _decide(selector)
    assert reply.decided_by == selector
    text = _render(reply)
    assert f"by selector {selector}" in text and "not used" not in text
    chosen = next(r for r in reply.rows if (r.worker_id, r.dp_rank) == (reply.chosen_worker_id, reply.chosen_dp_rank))
    assert chosen.cost == min(r.cost for r in reply.rows if r.eligible)
