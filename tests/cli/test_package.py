"""The package as users install it: one version everywhere, typed (py.typed shipped, mypy --strict on
the router library), every rejection importable from `kvsched.client`, the blocking client's
signatures equal to the asyncio client's."""

from __future__ import annotations

import inspect
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import version

import pytest
from typer.testing import CliRunner

import kvsched
import kvsched.client
from kvsched import errors
from kvsched.cli import app
from kvsched.client.client import SchedulerClient
from kvsched.client.lease import Lease
from kvsched.client.sync import SyncLease, SyncSchedulerClient
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------------------------ version


def test_version_has_one_source_the_distribution_metadata():
    assert kvsched.__version__ == version("kvsched")
    assert kvsched.__version__ != "0+unknown"


def test_kvsched_version_flag_prints_the_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"kvsched {version('kvsched')}"


def test_kvsched_daemon_version_flag_prints_the_version_and_exits():
    out = subprocess.run(
        [sys.executable, "-m", "kvsched.daemon.app", "--version"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"kvsched-daemon {version('kvsched')}"


# ------------------------------------------------------------------------------------ typed


def test_py_typed_is_shipped_with_the_package(tmp_path):
    """setuptools' own build step (what a wheel holds) copies kvsched/py.typed and the bundled data."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvsched", src / "kvsched", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from setuptools import setup; setup()",
            "-q",
            "build_py",
            "--build-lib",
            str(tmp_path / "lib"),
        ],
        capture_output=True,
        text=True,
        cwd=src,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "lib" / "kvsched" / "py.typed").is_file()
    assert (tmp_path / "lib" / "kvsched" / "data" / "mooncake_slice.jsonl").is_file()


ROUTER_LIBRARY = ("kvsched/client", "kvsched/protocol", "kvsched/endpoints.py", "kvsched/errors.py")


def test_the_mypy_config_holds_the_router_library_to_strict():
    """`[tool.mypy]` in pyproject.toml is strict, and no override relaxes what routers import."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert cfg["strict"] is True
    relaxed: set[str] = set()
    for override in cfg.get("overrides", []):
        if any(override.get(flag) is False for flag in ("disallow_untyped_defs", "disallow_any_generics")):
            mods = override["module"]
            relaxed |= {mods} if isinstance(mods, str) else set(mods)

    def matches(pattern: str, module: str) -> bool:  # mypy's override patterns: `a.b` or `a.b.*`
        if pattern.endswith(".*"):
            return module == pattern[:-2] or module.startswith(pattern[:-1])
        return module == pattern

    for path in ROUTER_LIBRARY:
        module = path.removesuffix(".py").replace("/", ".")
        assert not any(matches(pattern, module) for pattern in relaxed), module


@pytest.mark.slow
def test_mypy_strict_passes_on_the_router_library():
    """mypy with that config passes on the router library (modules it imports are read for their types,
    their own findings left to `make typecheck`, which checks the whole package)."""
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=silent", *ROUTER_LIBRARY],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=280,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Success" in out.stdout


# ------------------------------------------------------------------------------------ exports


def test_every_rejection_exception_is_importable_from_kvsched_client():
    for cls in (
        *errors.REJECTION_CLASSES.values(),
        errors.RequestRejected,
        errors.DaemonUnavailable,
        errors.ProtocolError,
        errors.LeaseError,
        errors.KvschedError,
    ):
        assert getattr(kvsched.client, cls.__name__) is cls, cls.__name__
        assert cls.__name__ in kvsched.client.__all__
    assert kvsched.client.REJECTION_CLASSES is errors.REJECTION_CLASSES


def test_every_name_in_all_resolves():
    for name in kvsched.client.__all__:
        assert getattr(kvsched.client, name) is not None
    assert kvsched.client.SchedulerClient is SchedulerClient and kvsched.client.SyncLease is SyncLease


# ------------------------------------------------------------------------------------ sync mirrors async


def _params(fn) -> list[tuple[str, object, object, object]]:
    return [(p.name, p.kind, p.default, p.annotation) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("method", ["__init__", "schedule", "block_hashes"])
def test_sync_client_takes_exactly_the_async_clients_arguments(method):
    """Names, kinds (positional / keyword-only), defaults and annotations: no *args / **kwargs."""
    sync, asyn = _params(getattr(SyncSchedulerClient, method)), _params(getattr(SchedulerClient, method))
    assert sync == asyn
    kinds = {kind for _, kind, _, _ in sync}
    assert inspect.Parameter.VAR_POSITIONAL not in kinds and inspect.Parameter.VAR_KEYWORD not in kinds


def test_sync_lease_exposes_every_public_attribute_of_a_lease():
    public = {name for name in Lease.__slots__ if not name.startswith("_")} | {"closed"}
    missing = {name for name in public if not isinstance(inspect.getattr_static(SyncLease, name, None), property)}
    assert not missing, f"SyncLease lacks properties for {sorted(missing)}"
    methods = {name for name, _ in inspect.getmembers(Lease, inspect.isfunction) if not name.startswith("_")}
    methods -= {"mark_dropped"}  # the client's own call when the daemon drops a lease, not a router's verb
    assert methods <= set(dir(SyncLease)), sorted(methods - set(dir(SyncLease)))
