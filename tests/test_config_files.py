"""What the config loader reads: regular files of a sane size only, never blocking on the path.

Found from outside: `kvsched reload /path/to/a.fifo` froze the daemon's actor loop until someone
wrote into the FIFO (16.7 s in the report: data socket, admin socket and /readyz dead, routers
reconnecting), and `kvsched reload /dev/urandom` made it read forever at ~130 MB/s of RSS until it was
killed. The daemon's reload, its start and `--check-config` all read through `load_config`.
"""

from __future__ import annotations

import os
import time

import pytest

from kvsched.config import load_config
from kvsched.config.loader import MAX_CONFIG_BYTES
from kvsched.errors import ConfigError


@pytest.mark.timeout(20)
def test_a_fifo_is_refused_at_once_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "profile.fifo"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(fifo, env={})
    assert time.monotonic() - started < 5


@pytest.mark.timeout(20)
def test_an_endless_device_is_refused_without_reading_it():
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config("/dev/urandom", env={})


def test_a_file_larger_than_the_cap_is_refused_naming_the_cap(tmp_path):
    big = tmp_path / "big.toml"
    big.write_bytes(b"# " + b"x" * MAX_CONFIG_BYTES + b"\n")
    with pytest.raises(ConfigError, match=f"{MAX_CONFIG_BYTES:,}"):
        load_config(big, env={})


@pytest.mark.timeout(20)
def test_an_include_that_is_a_fifo_is_refused_too(tmp_path):
    os.mkfifo(tmp_path / "profile.fifo")
    main = tmp_path / "main.toml"
    main.write_text('include = "profile.fifo"\n')
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(main, env={})


@pytest.mark.parametrize("text", ["daemon = 5\n", "daemon = []\n", "selector = 'kv'\n"])
def test_a_section_that_is_not_a_table_is_refused_even_under_flag_overrides(tmp_path, text):
    """Found from outside: `daemon = 5` passed `kvsched-daemon --check-config` (the CLI's own
    `[daemon]` overrides replaced the bad value before validation). Result: a ConfigError naming the key."""
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    key = text.split(" ")[0]
    with pytest.raises(ConfigError, match=f"{key} = .*expected a table"):
        load_config(cfg, env={}, overrides={key: {"seed": 1} if key == "selector" else {"instance": "x"}})
    with pytest.raises(ConfigError, match=key):
        load_config(cfg, env={})
