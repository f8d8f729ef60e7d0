"""One numba cache key for the kernel package (`kvsched.shm.kernel_cache`): every cached kernel of
`kvsched/shm/` is stamped with the digest of all the package's source files, so editing any of them
(a composed kernel, a layout constant) recompiles every kernel."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
from numba.core import config

from kvsched.shm import kernel_cache
from kvsched.shm.kernels import ref_add


def test_digest_covers_every_source_file(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    before = kernel_cache.sources_digest(tmp_path)
    assert kernel_cache.sources_digest(tmp_path) == before
    (tmp_path / "b.py").write_text("y = 3\n")  # a file no kernel of `a.py` names
    assert kernel_cache.sources_digest(tmp_path) != before
    (tmp_path / "b.py").write_text("y = 2\n")
    (tmp_path / "c.py").write_text("")
    assert kernel_cache.sources_digest(tmp_path) != before


def test_package_locators_come_first_and_install_is_idempotent() -> None:
    kernel_cache.install()
    names = config.CACHE_LOCATOR_CLASSES.split(",")
    assert names[:3] == [
        "kvsched.shm.kernel_cache.PackageCacheLocator",
        "kvsched.shm.kernel_cache.PackageInTreeCacheLocator",
        "kvsched.shm.kernel_cache.PackageUserWideCacheLocator",
    ]
    assert len(names) == len(set(names))


def test_a_cached_kernel_is_stamped_with_the_package_digest() -> None:
    """The index numba writes beside a cached kernel of `kernels.py` holds `KERNEL_DIGEST` as its
    source stamp (numba's own stamp would be a hash of `kernels.py` alone)."""
    keys = np.zeros(8, np.uint64)
    counts = np.zeros(8, np.int32)
    assert ref_add(keys, counts, np.array([5], np.uint64)) == 1  # compiled or loaded from the cache
    assert config.CACHE_DIR, "the test session sets NUMBA_CACHE_DIR"
    indexes = sorted(Path(config.CACHE_DIR).glob("shm_*/kernels.ref_add-*.nbi"))
    assert indexes, "ref_add's cache index"
    stamps = set()
    for path in indexes:
        with path.open("rb") as f:
            pickle.load(f)  # numba's version
            stamps.add(pickle.loads(f.read())[0])
    assert kernel_cache.KERNEL_DIGEST in stamps


def test_every_kernel_module_takes_njit_from_kernel_cache() -> None:
    """A module of the package that decorates a kernel imports `njit` from `kernel_cache` (which
    installs the locators on import), never from numba directly: its kernels key on the digest."""
    import ast

    kernel_modules = []
    for path in sorted(kernel_cache.KERNEL_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {
            (node.module, alias.name)
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        }
        uses_njit = any(
            isinstance(d, (ast.Name, ast.Call)) and "njit" in ast.unparse(d)
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef)
            for d in node.decorator_list
        )
        if uses_njit and path.name != "kernel_cache.py":
            kernel_modules.append(path.name)
            assert ("kernel_cache", "njit") in names, path.name
            assert ("numba", "njit") not in names, path.name
    assert "admit_kernels.py" in kernel_modules and "kernels.py" in kernel_modules


def test_the_routers_side_of_shm_loads_no_numba() -> None:
    """`kvsched.shm` itself installs nothing: the words and segments a router maps load no numba."""
    import subprocess
    import sys

    code = (
        "import sys\nimport kvsched.shm.words, kvsched.shm.segments, kvsched.shm.progress\n"
        "print(sorted(m for m in sys.modules if m.startswith('numba')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
