"""`examples/kvsched.toml` lists every configuration key with its default, and stays so.

The daemon's view (the file loads to exactly `Config()`) is checked in tests/test_config.py; here
the file is read line by line with comment marks removed, to see the keys shown commented out (unset keys and the
optional tables `[[workers]]` and `[classes.admission]`). Every field of every config struct must appear
once in its table; a key shown with a value must show the default unless the default is "unset".
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvsched.config import (
    AdmissionConfig,
    ClassConfig,
    Config,
    DaemonConfig,
    OverloadConfig,
    SelectorConfig,
    WorkerConfig,
)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "kvsched.toml"

# table header in the example -> (struct, the default instance whose values the example shows)
TABLES: dict[str, tuple[type[msgspec.Struct], Any]] = {
    "": (Config, Config()),
    "daemon": (DaemonConfig, DaemonConfig()),
    "selector": (SelectorConfig, SelectorConfig()),
    "overload": (OverloadConfig, OverloadConfig()),
    "workers": (WorkerConfig, None),
    "classes": (ClassConfig, Config().classes[0]),
    "classes.admission": (AdmissionConfig, None),
}
# fields shown as tables of their own: Config's sections, a class's [classes.admission]
NESTED = {Config: {"daemon", "selector", "overload", "workers", "classes"}, ClassConfig: {"admission"}}

_HEADER = re.compile(r"^#?\s*\[\[?([a-z_.]+)\]\]?\s*(#.*)?$")
_KEY = re.compile(r"^(#\s*)?([a-z_][a-z0-9_]*)\s*=\s*(.+)$")


def listed_keys(text: str) -> dict[str, dict[str, tuple[Any, bool]]]:
    """{table: {key: (value, commented_out)}} for every `key = value` line, commented or not."""
    tables: dict[str, dict[str, tuple[Any, bool]]] = {"": {}}
    table = ""
    for raw in text.splitlines():
        line = raw.strip()
        header = _HEADER.match(line)
        if header:
            table = header.group(1)
            tables.setdefault(table, {})
            continue
        m = _KEY.match(line)
        if not m:
            continue
        try:
            value = tomllib.loads(f"v = {m.group(3)}")["v"]
        except tomllib.TOMLDecodeError:
            continue  # prose in a comment that happens to contain " = "
        key = m.group(2)
        assert key not in tables[table], f"[{table}] {key} listed twice"
        tables[table][key] = (value, m.group(1) is not None)
    return tables


def field_defaults(cls: type[msgspec.Struct]) -> dict[str, Any]:
    """{field: default} of a struct; msgspec.NODEFAULT for a required field."""
    out = {}
    for f in msgspec.structs.fields(cls):
        out[f.name] = f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default
    return out


LISTED = listed_keys(EXAMPLE.read_text())


@pytest.mark.parametrize("table", sorted(TABLES))
def test_every_key_of_the_table_is_listed_and_nothing_else(table):
    cls, _ = TABLES[table]
    expected = set(cls.__struct_fields__) - NESTED.get(cls, set())
    assert table in LISTED, f"examples/kvsched.toml has no [{table}] table"
    listed = set(LISTED[table])
    assert not expected - listed, f"[{table}] keys missing from examples/kvsched.toml: {sorted(expected - listed)}"
    assert not listed - expected, (
        f"[{table}] keys in examples/kvsched.toml the config does not have: {sorted(listed - expected)}"
    )


@pytest.mark.parametrize("table", sorted(TABLES))
def test_each_listed_value_is_the_default_unless_the_default_is_unset(table):
    cls, instance = TABLES[table]
    defaults = field_defaults(cls)
    for key, (value, commented) in LISTED.get(table, {}).items():
        default = getattr(instance, key) if instance is not None else defaults[key]
        if default is msgspec.NODEFAULT:
            continue  # a required key (worker_id, admission type): the line shows an example
        if default is None:
            assert commented, f"[{table}] {key} has no default: show it commented out"
            continue
        if instance is not None:
            assert not commented, f"[{table}] {key} = {default!r} is a default: show it uncommented"
        assert value == default, f"[{table}] {key}: the example shows {value!r}, the default is {default!r}"


@pytest.mark.parametrize("table", ["workers", "classes", "classes.admission", "daemon", "selector", "overload"])
def test_the_example_values_of_unset_keys_are_valid(table):
    """Uncommented, every table of the example validates (the example values are usable as shown)."""
    cls, _ = TABLES[table]
    raw = {key: value for key, (value, _) in LISTED[table].items()}
    if cls is ClassConfig:
        admission = {key: value for key, (value, _) in LISTED["classes.admission"].items()}
        raw["admission"] = admission
    msgspec.convert(raw, cls, strict=True)


def test_the_check_fails_for_a_missing_key(tmp_path):
    """The reader above notices a key that is dropped from the file."""
    text = EXAMPLE.read_text().replace("# queue_timeout_s = 30.0", "")
    assert "queue_timeout_s" not in listed_keys(text)["classes"]
    assert "queue_timeout_s" in LISTED["classes"]


def test_keys_where_a_written_class_differs_from_the_built_in_one_are_called_out():
    """The [[classes]] table shows the built-in class; a key whose default differs for a class the user
    writes (prefill_busy_threshold_frac: unset, i.e. a class that never queues) must be said in the
    comment above the table, or users copy a class and lose its queueing without a word."""
    text = EXAMPLE.read_text()
    before = text[: text.index("\n[[classes]]\n")]
    comment = before[before.rstrip().rfind("\n\n") + 1 :]  # the comment block right above the table
    built_in, written = Config().classes[0], ClassConfig(name=Config().classes[0].name)
    differ = [f for f in ClassConfig.__struct_fields__ if getattr(built_in, f) != getattr(written, f)]
    assert differ, "the built-in class equals a written one: drop this test and the comment"
    for key in differ:
        assert key in comment, f"the comment above [[classes]] does not call out {key}"
