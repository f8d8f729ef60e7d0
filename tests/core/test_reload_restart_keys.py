"""`restart_only_changes` with the keys the reloaded sources set (`load_config_keys`): only keys the
reloaded file actually sets to another value are named (docs/DESIGN.md §4.16)."""

from __future__ import annotations

from kvsched.config import load_config, load_config_keys
from kvsched.core.reload import restart_only_changes

FULL = "[daemon]\nblock_size = 16\nmax_slots = 64\n[overload]\n[[workers]]\nworker_id = 1\n"


def test_set_keys_name_table_keys_and_other_top_level_keys(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('default_class = "a"\n' + FULL + '[[classes]]\nname = "a"\n')
    _, keys = load_config_keys(f, env={"KVSCHED_SELECTOR_SEED": "3"}, overrides={"daemon": {"instance": "x"}})
    assert keys == {
        "daemon.block_size",
        "daemon.max_slots",
        "daemon.instance",
        "selector.seed",
        "workers",
        "classes",
        "default_class",
    }


def test_a_profile_file_names_nothing_against_a_full_running_config(tmp_path):
    running = tmp_path / "full.toml"
    running.write_text(FULL)
    profile = tmp_path / "profile.toml"
    profile.write_text('default_class = "b"\n[[classes]]\nname = "b"\n')
    new, given = load_config_keys(profile, env={})
    assert restart_only_changes(load_config(running, env={}), new, given) == []
    assert "workers (removed 1)" in restart_only_changes(load_config(running, env={}), new)  # every key compared


def test_workers_from_the_command_line_are_not_removed_by_a_file_without_workers(tmp_path):
    f = tmp_path / "d.toml"
    f.write_text("[daemon]\nblock_size = 16\n")
    running = load_config(f, env={}, overrides={"workers": [{"worker_id": 0}, {"worker_id": 1}]})  # --workers 2
    new, given = load_config_keys(f, env={})
    assert restart_only_changes(running, new, given) == []


def test_a_key_set_to_another_value_is_named_and_an_equal_one_is_not(tmp_path):
    f = tmp_path / "d.toml"
    f.write_text(FULL)
    running = load_config(f, env={})
    f.write_text(FULL.replace("block_size = 16", "block_size = 32") + "[[workers]]\nworker_id = 2\n")
    new, given = load_config_keys(f, env={})
    assert restart_only_changes(running, new, given) == ["daemon.block_size", "workers (added 2)"]
