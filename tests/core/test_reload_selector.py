"""A profile reload applies every `[selector]` key (docs/DESIGN.md, Reload).

Was: `Scheduler.reload` applied prefill_load_scale / overlap_credit but kept the old selector's type,
seed and `kv` weights in silence.
"""

from __future__ import annotations

import msgspec
import numpy as np

from kvsched.config import SelectorConfig
from kvsched.core.kv_cost import KvSelector

from .factories import make_config, make_request, make_scheduler


def _admit(s, rid: str, now: int, **kw):
    got = s.enqueue(make_request(rid, **kw), now)
    assert got and got[0].request_id == rid, got
    return got[0]


def test_changed_kv_weights_rebuild_the_selector_and_keep_its_learnt_state():
    cfg = make_config()
    s = make_scheduler(cfg, workers=((1, 0), (2, 0)))
    _admit(s, "a", 1_000, isl_tokens=600)
    old = s.selector
    recent = old.recent.copy()
    assert recent.sum() > 0  # the admission was learnt
    new = make_config(selector=msgspec.structs.replace(cfg.selector, prefill_weight=4.0, lead_bonus=10.0))
    assert s.reload(new) == ["selector.prefill_weight", "selector.lead_bonus"]
    assert isinstance(s.selector, KvSelector) and s.selector is not old
    assert s.admitter.selector is s.selector
    assert (s.selector.prefill_weight, s.selector.lead_bonus) == (4.0, 10.0)
    assert np.array_equal(s.selector.recent[: recent.size], recent) and s.selector.recent_at_us == old.recent_at_us
    _admit(s, "b", 2_000, isl_tokens=600)  # the fused path re-derived for the new selector still decides
    assert s.explain("b").decided_by == "kv"


def test_a_changed_type_starts_the_new_selector_and_explain_names_it():
    s = make_scheduler(workers=((1, 0), (2, 0), (3, 0)))
    _admit(s, "a", 1_000, isl_tokens=64)
    assert s.reload(make_config(selector=SelectorConfig(type="round_robin", seed=0))) == ["selector.type"]
    rows = [_admit(s, f"r{i}", 2_000 + i, isl_tokens=64).worker for i in range(6)]
    assert rows[:3] == rows[3:] and len(set(rows)) == 3  # round robin's cycle
    assert s.explain("r0").decided_by == "round_robin"


def test_keys_read_per_decision_do_not_rebuild():
    cfg = make_config()
    s = make_scheduler(cfg)
    old = s.selector
    assert (
        s.reload(make_config(selector=msgspec.structs.replace(cfg.selector, prefill_load_scale=2.0, approx_ttl_s=5.0)))
        == []
    )
    assert s.selector is old and s.admitter.selector_cfg.prefill_load_scale == 2.0
