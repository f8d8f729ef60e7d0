"""`--class-rule` parsing and per-row class assignment; the replay's profile merge and its TOML."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsched.config import load_config
from kvsched.sim.classes import ClassRuleError, assign_classes, check_class_names, parse_class_rule, read_class_column
from kvsched.sim.fleet_spec import FleetSpec
from kvsched.sim.replay import ReplayOptions, config_dict_toml, replay_config, replay_config_dict, resolve_classes
from kvsched.sim.trace import load_trace

PROFILE = Path(__file__).resolve().parents[2] / "examples" / "profile-multiclass.toml"
CLASSES = ("latency", "agents", "batch")


def make_isl(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


# ------------------------------------------------------------------------------------ parsing


def test_none_rule_puts_every_request_in_the_default_class():
    rule = parse_class_rule("none")
    a = assign_classes(rule, make_isl(1, 50_000, 7), "latency")
    assert rule.kind == "none"
    assert [a.name_of(i) for i in range(3)] == ["latency"] * 3


def test_isl_bands_take_the_first_bound_the_isl_is_below():
    rule = parse_class_rule("isl:latency<4096,agents<16384,batch")
    assert rule.names == CLASSES and rule.bounds == (4096, 16384, None)
    a = assign_classes(rule, make_isl(1, 4095, 4096, 16383, 16384, 10**6), "latency")
    assert [a.name_of(i) for i in range(6)] == ["latency", "latency", "agents", "agents", "batch", "batch"]


def test_isl_rest_goes_to_default_class_when_every_band_has_a_bound():
    a = assign_classes(parse_class_rule("isl:agents<100,batch<200"), make_isl(50, 150, 250), "latency")
    assert [a.name_of(i) for i in range(3)] == ["agents", "batch", "latency"]


def test_bare_isl_rule_uses_profile_classes_with_default_bounds():
    rule = parse_class_rule("isl", CLASSES)
    assert rule.names == CLASSES and rule.bounds == (4096, 16384, None)


def test_hash_rule_parses_weights():
    rule = parse_class_rule("hash:latency=60, agents=30,batch=10")
    assert rule.kind == "hash" and rule.names == CLASSES and rule.weights == (60.0, 30.0, 10.0)


def test_column_rule_keeps_the_column_name():
    rule = parse_class_rule("column:tenant_class")
    assert rule.kind == "column" and rule.column == "tenant_class"


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("fifo", "unknown class rule"),
        ("none:x", "unknown class rule"),
        ("isl:latency,batch<10", "only the last band"),
        ("isl:latency<4096,agents<4096,batch", "increase"),
        ("isl:latency<4k,batch", "not a whole number"),
        ("isl:<10,batch", "no class name"),
        ("isl:latency<10,latency", "listed twice"),
        ("isl", "needs a profile"),
        ("hash:", "name=weight"),
        ("hash:latency=60,batch", "not name=weight"),
        ("hash:latency=-1,batch=2", "not name=weight"),
        ("hash:latency=x", "not name=weight"),
        ("hash:latency=0,batch=0", "sum to 0"),
        ("column:", "needs a column name"),
    ],
)
def test_bad_rule_raises_class_rule_error_when_parsed(text, fragment):
    with pytest.raises(ClassRuleError, match=fragment):
        parse_class_rule(text)


def test_unknown_class_names_are_named_with_the_profile_classes():
    with pytest.raises(ClassRuleError) as err:
        check_class_names(["latency", "bulk", "gold"], CLASSES)
    msg = str(err.value)
    assert "'bulk'" in msg and "'gold'" in msg and "'latency', 'agents', 'batch'" in msg
    check_class_names(["batch"], CLASSES)  # known: no error


# ------------------------------------------------------------------------------------ assignment


def test_hash_assignment_is_deterministic_and_independent_of_the_limit():
    rule = parse_class_rule("hash:latency=60,agents=30,batch=10")
    big = assign_classes(rule, np.ones(20_000, dtype=np.int64), "latency")
    again = assign_classes(rule, np.ones(20_000, dtype=np.int64), "latency")
    small = assign_classes(rule, np.ones(500, dtype=np.int64), "latency")
    assert np.array_equal(big.codes, again.codes)
    assert np.array_equal(big.codes[:500], small.codes)
    counts = big.counts()
    assert abs(counts["latency"] / 20_000 - 0.6) < 0.02
    assert abs(counts["agents"] / 20_000 - 0.3) < 0.02
    assert abs(counts["batch"] / 20_000 - 0.1) < 0.02


def test_hash_assignment_never_picks_a_zero_weight_class():
    a = assign_classes(parse_class_rule("hash:latency=1,agents=0"), np.ones(5000, dtype=np.int64), "latency")
    assert a.counts() == {"latency": 5000, "agents": 0}


def test_column_assignment_uses_default_class_for_empty_values():
    a = assign_classes(parse_class_rule("column:c"), make_isl(1, 1, 1), "latency", ["batch", "", "agents"])
    assert [a.name_of(i) for i in range(3)] == ["batch", "latency", "agents"]
    with pytest.raises(ClassRuleError, match="2 column values for 3 requests"):
        assign_classes(parse_class_rule("column:c"), make_isl(1, 1, 1), "latency", ["a", "b"])


def test_class_column_is_read_in_trace_row_order(tmp_path):
    jl = tmp_path / "t.jsonl"
    jl.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "cls": "batch"}\n\n'
        '{"timestamp": 5, "input_length": 10, "output_length": 1}\n'
        '{"timestamp": 9, "input_length": 10, "output_length": 1, "cls": "agents"}\n'
    )
    assert read_class_column(jl, "cls") == ["batch", "", "agents"]
    assert read_class_column(jl, "cls", limit=2) == ["batch", ""]
    with pytest.raises(ClassRuleError, match="no 'tier' field"):
        read_class_column(jl, "tier")
    csv_path = tmp_path / "t.csv"
    csv_path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens,cls\n"
        "2023-11-16 18:15:50.5,10,1,late\n2023-11-16 18:15:49.0,10,1,early\n"
    )
    assert read_class_column(csv_path, "cls") == ["early", "late"]  # load_azure sorts by time
    with pytest.raises(ClassRuleError, match="not 'tier'"):
        read_class_column(csv_path, "tier")


def test_resolve_rejects_column_values_that_name_unknown_classes(tmp_path):
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "cls": "gold"}\n')
    opts = ReplayOptions(trace=jl, profile=PROFILE, class_rule="column:cls")
    with pytest.raises(ClassRuleError, match="'gold'"):
        resolve_classes(opts, load_trace(jl), load_config(PROFILE))


# ------------------------------------------------------------------------------------ profile merge


def test_replay_fleet_wins_over_profile_daemon_and_workers(tmp_path):
    prof = tmp_path / "p.toml"
    prof.write_text(
        PROFILE.read_text().replace("block_size = 512", "block_size = 16")
        + '\n[selector]\ntype = "random"\noverlap_credit = 0.5\n'
        + "\n[overload]\noverload_prefill_tokens = 99999\n"
        + "\n[[workers]]\nworker_id = 77\n"
    )
    profile = load_config(prof)
    spec = FleetSpec(workers=3, block_size=512)
    opts = ReplayOptions(trace=tmp_path / "x.jsonl", selector="kv", seed=5)
    cfg = replay_config(spec, opts, profile, time_scale=10.0)
    assert cfg.daemon.block_size == 512 and [w.worker_id for w in cfg.workers] == [0, 1, 2]
    assert cfg.selector.type == "kv" and cfg.selector.seed == 5 and cfg.selector.overlap_credit == 0.5
    assert cfg.overload.overload_prefill_tokens == 99999
    assert cfg.default_class == "latency" and [c.name for c in cfg.classes] == list(CLASSES)
    assert cfg.classes[0].queue_timeout_s == pytest.approx(3.0)  # 30 simulated s at speedup 10
    assert cfg.classes[2].admission is not None and cfg.classes[2].admission.type == "kv_pressure"


def test_written_daemon_toml_loads_back_to_the_same_config(tmp_path):
    spec = FleetSpec(workers=2)
    opts = ReplayOptions(trace=tmp_path / "x.jsonl")
    raw = replay_config_dict(spec, opts, load_config(PROFILE), time_scale=100.0)
    path = tmp_path / "replay.toml"
    path.write_text(config_dict_toml(raw))
    assert load_config(path, env={}) == replay_config(spec, opts, load_config(PROFILE), time_scale=100.0)


# ------------------------------------------------------------------------------------ CLI


def test_cli_usage_error_names_unknown_class_and_profile_classes(tmp_path):
    from kvsched.cli import app

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1}\n')
    res = CliRunner().invoke(
        app,
        [
            "replay",
            str(trace),
            "--virtual",
            "--profile",
            str(PROFILE),
            "--class-rule",
            "hash:latency=1,bulk=1",
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert res.exit_code == 2
    text = " ".join(res.output.replace("│", " ").split())  # rich may box and wrap the message
    assert "'bulk'" in text and "'latency', 'agents', 'batch'" in text


@pytest.mark.parametrize("speedup", [1.0, 20.0])
def test_wall_replay_daemon_config_divides_every_simulated_time_span_by_the_speedup(tmp_path, speedup):
    """The TOML a wall replay's daemon starts from (with and without --profile) has the selector's
    approx_ttl_s, recent_half_life_s, home_half_life_s and each class's queue_timeout_s = configured / S;
    the cost model's predicted-seconds keys and the process timers are not scaled."""
    from kvsched.config import Config
    from kvsched.sim.fleet_spec import config_toml

    prof = tmp_path / "p.toml"
    prof.write_text(
        PROFILE.read_text() + "\n[selector]\nrecent_half_life_s = 12.0\nhome_half_life_s = 40.0\n"
        "approx_ttl_s = 60.0\nlead_max_extra_ttft_s = 2.0\nprefill_seconds_ref_us = 50.0\n"
    )
    profile = load_config(prof, env={})
    spec = FleetSpec(workers=2)
    opts = ReplayOptions(trace=tmp_path / "x.jsonl")
    written = tmp_path / "replay.toml"
    written.write_text(config_dict_toml(replay_config_dict(spec, opts, profile, time_scale=speedup)))
    cfg = load_config(written, env={})
    assert cfg.selector.recent_half_life_s == pytest.approx(12.0 / speedup)
    assert cfg.selector.home_half_life_s == pytest.approx(40.0 / speedup)
    assert cfg.selector.approx_ttl_s == pytest.approx(60.0 / speedup)
    assert cfg.selector.lead_max_extra_ttft_s == 2.0 and cfg.selector.prefill_seconds_ref_us == 50.0
    for got, conf in zip(cfg.classes, profile.classes, strict=True):
        assert got.queue_timeout_s == (
            None if conf.queue_timeout_s is None else pytest.approx(conf.queue_timeout_s / speedup)
        )
    assert any(c.queue_timeout_s is not None for c in profile.classes)
    default = Config()
    written.write_text(config_toml(spec, "kv", 0, time_scale=speedup))
    cfg = load_config(written, env={})
    for key in ("approx_ttl_s", "recent_half_life_s", "home_half_life_s"):
        assert getattr(cfg.selector, key) == pytest.approx(getattr(default.selector, key) / speedup), key
    assert cfg.daemon.heartbeat_ms == default.daemon.heartbeat_ms
    assert cfg.daemon.liveness_timeout_ms == default.daemon.liveness_timeout_ms
