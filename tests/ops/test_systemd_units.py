"""The shipped systemd units verify (`systemd-analyze verify` on a rendered copy) and carry every
setting SPEC §7 requires."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNITS = ["kvsched-daemon.service", "kvsched-daemon@.service"]
REQUIRED = [
    "Type=notify", "WatchdogSec=", "Restart=on-failure", "RuntimeDirectory=kvsched",
    "RuntimeDirectoryPreserve=restart", "CacheDirectory=kvsched", "User=kvsched", "Group=kvsched",
    "RemoveIPC=no", "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
    "EnvironmentFile=", "NUMBA_CACHE_DIR=",
]


@pytest.mark.parametrize("unit", UNITS)
def test_unit_has_every_required_setting(unit):
    text = (ROOT / "systemd" / unit).read_text()
    for setting in REQUIRED:
        assert setting in text, f"{unit} lacks {setting}"
    assert "DynamicUser" not in text.replace("not `DynamicUser`", "").replace("never DynamicUser", "")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_rendered_units_pass_systemd_analyze_verify(tmp_path):
    entry = Path(sys.executable).with_name("kvsched-daemon")
    assert entry.exists(), "install the package first (make test does)"
    rendered = []
    for unit, name in (("kvsched-daemon.service", "kvsched-daemon.service"),
                       ("kvsched-daemon@.service", "kvsched-daemon@pool1.service")):
        text = (ROOT / "systemd" / unit).read_text().replace("/opt/kvsched/bin/", f"{entry.parent}/")
        path = tmp_path / name
        path.write_text(text)
        rendered.append(str(path))
    result = subprocess.run(["systemd-analyze", "verify", *rendered], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Unknown key" not in result.stderr
