"""Selectors are plug-ins of the `kvsched.selectors` entry-point group (docs/ROUTING.md, "Selectors are
plug-ins"): kvsched registers its five, the routing baselines come with the `kvsched-bench` distribution,
and a config naming a selector that is not installed is refused with a message saying what to install.

The refusal is checked for real: a daemon process whose interpreter sees every installed distribution
but kvsched-bench (a site directory of links without that distribution's files).
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from kvsched.config import SelectorConfig, load_config
from kvsched.core.selector import WorkerSelector, create_selector
from kvsched.errors import ConfigError
from tests.conftest import ROOT

PRODUCT = {"kv", "round_robin", "least_loaded", "power_of_two", "random"}


def test_kvsched_registers_its_five_selectors_in_the_entry_point_group():
    """Read from the installed metadata, not from a table in the code: each of the five is kvsched's
    entry point, loads a `WorkerSelector` of that name, and `create_selector` builds it."""
    eps = {ep.name: ep for ep in entry_points(group="kvsched.selectors")}
    assert set(eps) >= PRODUCT, sorted(eps)
    assert {n for n, ep in eps.items() if ep.dist.name == "kvsched"} == PRODUCT
    for name in PRODUCT:
        cls = eps[name].load()
        assert issubclass(cls, WorkerSelector) and cls.name == name
        built = create_selector(SelectorConfig(type=name, seed=0))
        assert type(built) is cls


def test_a_selector_type_that_is_not_installed_is_a_config_error_listing_the_installed_ones(tmp_path):
    path = tmp_path / "cfg.toml"
    path.write_text("[selector]\ntype = 'nosuch'\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    message = str(err.value)
    assert "selector.type: unknown selector 'nosuch'; installed selectors" in message
    for name in PRODUCT:
        assert name in message


def _python_without_bench(tmp_path) -> tuple[list[str], dict[str, str]]:
    """A `python` command line and environment that see every distribution installed here except
    kvsched-bench: `-S` (no site-packages, no .pth files), then each site directory given again as a
    directory of links to its entries, kvsched-bench's dist-info and editable-install files left out;
    kvsched itself from this checkout."""
    dirs = []
    hidden = []
    for i, sp in enumerate(p for p in site.getsitepackages() if os.path.isdir(p)):
        links = tmp_path / f"site{i}"
        links.mkdir()
        for entry in os.listdir(sp):
            if "kvsched_bench" in entry or "kvsched-bench" in entry:
                hidden.append(entry)
                continue
            (links / entry).symlink_to(os.path.join(sp, entry))
        dirs.append(str(links))
    assert any(h.endswith(".dist-info") for h in hidden), "kvsched-bench is not installed here (make test installs it)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *dirs])
    return [sys.executable, "-S"], env


@pytest.mark.timeout(240)
def test_a_daemon_without_kvsched_bench_refuses_a_baseline_naming_that_distribution(tmp_path):
    """Was: the baselines shipped in the package, so nothing said where they come from. Now
    `--check-config` and a start both exit 2 naming kvsched-bench, while kvsched's own `kv` is still
    accepted in that same environment (the product needs nothing from the bench distribution)."""
    python, env = _python_without_bench(tmp_path)
    probe = subprocess.run(
        [*python, "-c", "import importlib.util as u; print(u.find_spec('kvsched_bench'))"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert probe.stdout.strip() == "None", probe.stdout + probe.stderr
    good = tmp_path / "kv.toml"
    good.write_text("[selector]\ntype = 'kv'\n")
    ok = subprocess.run(
        [*python, "-m", "kvsched.daemon.app", "--check-config", str(good)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "lmetric.toml"
    bad.write_text("[selector]\ntype = 'lmetric'\n")
    for args in (["--check-config", str(bad)], ["--config", str(bad), "--instance", "no-bench"]):
        out = subprocess.run(
            [*python, "-m", "kvsched.daemon.app", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            cwd=tmp_path,
        )
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert "selector.type: 'lmetric' is a routing baseline of the kvsched-bench distribution" in out.stderr, (
            out.stderr
        )
        assert "installed selectors: kv, least_loaded, power_of_two, random, round_robin" in out.stderr, out.stderr
