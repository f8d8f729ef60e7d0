"""Config bounds a fresh user hit: every value `--check-config` accepts must also start the daemon.

Was: `[selector] seed = -1` and `prefill_weight = inf` passed the check; the first raised from
`numpy.random.default_rng` at daemon start, the second made every cost inf/NaN (random picks).
"""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from kvsched.config import Config, load_config, non_finite_keys
from kvsched.core.selector import create_selector
from kvsched.errors import ConfigError


def _load(tmp_path, text: str) -> Config:
    path = tmp_path / "cfg.toml"
    path.write_text(text)
    return load_config(path, env={})


@pytest.mark.parametrize("seed", [-1, 2**64, 2**70])
def test_a_seed_numpy_refuses_or_over_64_bits_is_a_config_error_naming_the_key(tmp_path, seed):
    with pytest.raises(ConfigError, match=r"selector\.seed"):
        _load(tmp_path, f"[selector]\nseed = {seed}\n")


@pytest.mark.parametrize("selector", ["kv", "dynamo_cost", "round_robin", "power_of_two", "lmetric"])
@pytest.mark.parametrize("seed", [0, 2**63 - 1])
def test_every_accepted_seed_creates_the_selector(tmp_path, selector, seed):
    cfg = _load(tmp_path, f"[selector]\ntype = '{selector}'\nseed = {seed}\n")
    assert create_selector(cfg.selector).name == selector


@pytest.mark.parametrize(
    "text, path",
    [
        ("[[classes]]\nname = 'default'\nprefill_busy_threshold = {v}\n", "prefill_busy_threshold"),
        ("[overload]\noverload_prefill_tokens = {v}\n", "overload_prefill_tokens"),
        ("[selector]\nhome_min_prefill_tokens = {v}\n", "home_min_prefill_tokens"),
        ("[[classes]]\nname = 'default'\nquantum = {v}\n", "quantum"),
    ],
)
def test_token_counts_past_float64_exact_range_are_config_errors(tmp_path, text, path):
    """These are compared with int64 ledger arrays and packed into float64 kernel parameters."""
    _load(tmp_path, text.format(v=2**53))
    with pytest.raises(ConfigError, match=path):
        _load(tmp_path, text.format(v=2**53 + 1))


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize(
    "text, path",
    [
        ("[selector]\nprefill_weight = {v}\n", "selector.prefill_weight"),
        ("[selector]\ntemperature = {v}\n", "selector.temperature"),
        ("[selector]\nlead_cap_blocks = {v}\n", "selector.lead_cap_blocks"),
        ("[selector]\nhome_weight = {v}\n", "selector.home_weight"),
        ("[selector]\nprefill_load_scale = {v}\n", "selector.prefill_load_scale"),
        ("[daemon]\nshutdown_timeout_s = {v}\n", "shutdown_timeout_s"),
        ("[overload]\noverload_active_blocks_frac = {v}\n", "overload.overload_active_blocks_frac"),
        ("[[classes]]\nname = 'default'\nqueue_timeout_s = {v}\n", r"classes\[0\]\.queue_timeout_s"),
        (
            "[[classes]]\nname = 'default'\nprefill_busy_threshold_frac = {v}\n",
            r"classes\[0\]\.prefill_busy_threshold_frac",
        ),
        ("[[workers]]\nworker_id = 0\nkv_events_stale_after_s = {v}\n", r"workers\[0\]\.kv_events_stale_after_s"),
    ],
)
def test_non_finite_floats_are_config_errors_naming_the_key_path(tmp_path, text, path, value):
    with pytest.raises(ConfigError, match=path):
        _load(tmp_path, text.format(v=value))


def test_an_infinite_env_override_is_rejected_too():
    with pytest.raises(ConfigError, match=r"selector\.temperature"):
        load_config(None, env={"KVSCHED_SELECTOR_TEMPERATURE": "inf"})


def test_finite_config_with_every_float_key_set_still_loads(tmp_path):
    cfg = _load(
        tmp_path,
        "[selector]\nprefill_weight = 1e6\ntemperature = 0.5\nhome_weight = 0.0\n"
        "[[classes]]\nname = 'default'\nqueue_timeout_s = 1e9\n",
    )
    assert cfg.selector.prefill_weight == 1e6 and non_finite_keys(cfg) == []


def test_non_finite_keys_walks_every_float_field_of_the_tree():
    """Reference model: every float field reachable from `Config` (nested structs, lists) is checked."""
    cfg = Config()
    floats = []

    def walk(node, path):
        for name in node.__struct_fields__:
            v = getattr(node, name)
            p = f"{path}.{name}" if path else name
            if isinstance(v, msgspec.Struct):
                walk(v, p)
            elif isinstance(v, float):
                floats.append((node, name, p))

    walk(cfg, "")
    assert len(floats) > 20
    for node, name, p in floats:
        old = getattr(node, name)
        setattr(node, name, float("inf"))
        assert non_finite_keys(cfg) == [(p, float("inf"))]
        setattr(node, name, old)


def test_check_config_exits_2_on_a_negative_seed(tmp_path):
    """The systemd ExecStartPre check: rc 2 and the key, not rc 0 then a ValueError at start."""
    path = tmp_path / "seed.toml"
    path.write_text("[selector]\nseed = -1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvsched.daemon.app", "--check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "selector.seed" in proc.stderr, proc.stderr
