"""The shipped systemd units verify (`systemd-analyze verify` on a rendered copy), carry every setting
the operations guide (README, "Running under systemd") requires, and template pools stay independent:
`RuntimeDirectoryPreserve=yes` plus the shipped tmpfiles.d entry that creates /run/kvsched."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNITS = ["kvsched-daemon.service", "kvsched-daemon@.service"]
REQUIRED = [
    "Type=notify",
    "WatchdogSec=",
    "Restart=on-failure",
    "RuntimeDirectory=kvsched",
    "RuntimeDirectoryPreserve=yes",
    "CacheDirectory=kvsched",
    "User=kvsched",
    "Group=kvsched",
    "RemoveIPC=no",
    "NoNewPrivileges=yes",
    "ProtectSystem=strict",
    "ProtectHome=yes",
    "PrivateTmp=yes",
    "EnvironmentFile=",
    "NUMBA_CACHE_DIR=",
]


COLD_COMPILE_BUDGET_S = 300  # a first start compiles the kernels: 92 s of wall measured on a busy box


@pytest.mark.parametrize("unit", UNITS)
def test_start_timeout_covers_a_cold_kernel_compile(unit):
    """Was TimeoutStartSec=120 against 92 s of compile on a busy machine (docs/DEPLOY.md)."""
    text = (ROOT / "systemd" / unit).read_text()
    timeout = int(next(ln for ln in text.splitlines() if ln.startswith("TimeoutStartSec=")).split("=")[1])
    assert timeout >= COLD_COMPILE_BUDGET_S


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
    for unit, name in (
        ("kvsched-daemon.service", "kvsched-daemon.service"),
        ("kvsched-daemon@.service", "kvsched-daemon@pool1.service"),
    ):
        text = (ROOT / "systemd" / unit).read_text().replace("/opt/kvsched/bin/", f"{entry.parent}/")
        path = tmp_path / name
        path.write_text(text)
        rendered.append(str(path))
    result = subprocess.run(["systemd-analyze", "verify", *rendered], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Unknown key" not in result.stderr


TMPFILES = ROOT / "systemd" / "tmpfiles.d" / "kvsched.conf"


@pytest.mark.parametrize("unit", UNITS)
def test_stopping_one_pool_keeps_the_shared_runtime_directory(unit):
    """With `RuntimeDirectoryPreserve=restart` (or no/`no`), systemd removes /run/kvsched when any
    instance stops, taking every other pool's sockets with it; only `yes` keeps it."""
    settings = [
        line.strip()
        for line in (ROOT / "systemd" / unit).read_text().splitlines()
        if line.strip().startswith("RuntimeDirectoryPreserve=")
    ]
    assert settings == ["RuntimeDirectoryPreserve=yes"], settings


def test_tmpfiles_entry_matches_the_units_runtime_directory():
    lines = [line.split() for line in TMPFILES.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert lines == [["d", "/run/kvsched", "0750", "kvsched", "kvsched", "-"]]
    unit = (ROOT / "systemd" / "kvsched-daemon@.service").read_text()
    assert "RuntimeDirectory=kvsched\n" in unit and "RuntimeDirectoryMode=0750" in unit
    assert "User=kvsched" in unit and "Group=kvsched" in unit


@pytest.mark.skipif(shutil.which("systemd-tmpfiles") is None, reason="systemd-tmpfiles not installed")
def test_systemd_tmpfiles_creates_the_runtime_directory(tmp_path):
    """`systemd-tmpfiles --create --root` applies the shipped entry to a scratch root whose passwd and
    group files know the kvsched user: /run/kvsched appears with mode 0750 owned by kvsched:kvsched."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "etc" / "passwd").write_text("kvsched:x:64991:64992::/nonexistent:/usr/sbin/nologin\n")
    (tmp_path / "etc" / "group").write_text("kvsched:x:64992:\n")
    result = subprocess.run(
        ["systemd-tmpfiles", "--create", f"--root={tmp_path}", str(TMPFILES)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    st = (tmp_path / "run" / "kvsched").stat()
    assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (0o750, 64991, 64992)
