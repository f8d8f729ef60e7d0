"""`kvsched replay` options: the selectors it lists and accepts are the installed ones (the
`kvsched.selectors` entry points the config validates against), every one of them."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from kvsched.cli import app
from kvsched.config import SelectorConfig
from kvsched.config.selectors import installed_selectors
from kvsched.core.selector import create_selector

SELECTORS = tuple(installed_selectors())
runner = CliRunner()


def test_every_installed_selector_type_is_accepted_and_built():
    for name in SELECTORS:
        assert create_selector(SelectorConfig(type=name, seed=0)) is not None, name


def test_replay_help_lists_every_selector():
    result = runner.invoke(app, ["replay", "--help"], env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert result.exit_code == 0
    text = re.sub(r"[\s│]+", " ", result.output)
    for name in SELECTORS:
        assert re.search(rf"\b{name}\b", text), name
    assert {"dynamo_cost", "lmetric", "llmd", "llmd_sticky"} <= set(SELECTORS)


def test_unknown_selector_is_a_usage_error_naming_the_valid_ones(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1}\n')
    result = runner.invoke(
        app, ["replay", str(trace), "--virtual", "--selector", "nosuch"], env={"COLUMNS": "400", "NO_COLOR": "1"}
    )
    assert result.exit_code == 2
    text = re.sub(r"[\s│]+", " ", result.output)
    assert "unknown selector 'nosuch'" in text
    for name in SELECTORS:
        assert re.search(rf"\b{name}\b", text), name
