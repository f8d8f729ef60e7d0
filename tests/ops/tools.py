"""External checkers the ops tests run (promtool, docker-compose, kubernetes-validate, hadolint,
systemd-analyze). `.ci/run` installs them; in CI (env `CI` set) a missing one is a failure, locally
the check is skipped."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest


def find_tool(name: str) -> str | None:
    """The tool's path: on PATH, or next to this interpreter (pip-installed console scripts)."""
    found = shutil.which(name)
    if found:
        return found
    local = Path(sys.executable).with_name(name)
    return str(local) if local.exists() else None


def require_tool(name: str) -> str | None:
    """Path of `name`; None when missing locally; a test failure when missing in CI."""
    path = find_tool(name)
    if path is None and os.environ.get("CI"):
        pytest.fail(f"{name} is not installed; .ci/run installs it")
    return path


def tool_or_skip(name: str) -> str:
    """Path of `name`; skips the test when missing locally (never in CI, see `require_tool`)."""
    path = require_tool(name)
    if path is None:
        pytest.skip(f"{name} not installed (CI installs it: .ci/run)")
    return path
