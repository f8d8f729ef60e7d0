"""One numba cache key for the whole kernel package: `KERNEL_DIGEST`, a sha256 of every source file
of `kvsched/shm/`.

Numba's on-disk cache stamps a kernel with a hash of its own source file only (numba
`caching._SourceFileBackedLocatorMixin.get_source_stamp`), so a cached kernel that calls a kernel of
another file (`admit_kv` composes `kernels.py`, `overlap.py`, `select_kernels.py`, ...) or reads
another file's constants (`layout.py`) would keep an old copy of it after that file is edited. The
locators below stamp every kernel defined in this package with `KERNEL_DIGEST` instead: editing any
file of the package recompiles every kernel of it, and nothing else is needed in the kernels.

`install()` puts the locators first in numba's list of cache locators; this module runs it when
imported, and every kernel module of the package takes its `njit` from here (`from .kernel_cache
import njit`), so the locators are in place before any of its decorators runs (numba picks a
kernel's locator then). Functions of other packages keep numba's own locators. `kvsched.shm` itself
imports no numba: the routers' side (`shm.words`, `shm.segments`) stays free of it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from numba import njit
from numba.core import caching, config
from numba.core.caching import _CacheLocator

KERNEL_DIR = Path(__file__).resolve().parent
# numba's `config` sets its options from the environment through `globals()`, so a type checker sees none
# of them: this one is read and written by name
_LOCATORS_OPTION = "CACHE_LOCATOR_CLASSES"
# numba's own locators, in its order (numba `caching.CacheImpl`), named as NUMBA_CACHE_LOCATOR_CLASSES names them
_NUMBA_LOCATORS = [
    "UserProvidedCacheLocator",
    "InTreeCacheLocator",
    "UserWideCacheLocator",
    "IPythonCacheLocator",
    "ZipCacheLocator",
]


def sources_digest(directory: Path = KERNEL_DIR) -> str:
    """sha256 (hex) of the `*.py` files of `directory`, in name order (name and bytes of each)."""
    h = hashlib.sha256()
    for path in sorted(directory.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


KERNEL_DIGEST = sources_digest()


def _in_package(py_file: str) -> bool:
    return Path(py_file).resolve().parent == KERNEL_DIR


class _PackageStamp(_CacheLocator):
    """A numba locator restricted to this package's files, stamping them with `KERNEL_DIGEST` (mixed in
    before one of numba's locators, which `from_function` defers to)."""

    def get_source_stamp(self) -> str:
        return KERNEL_DIGEST

    @classmethod
    def from_function(cls, py_func, py_file):
        return super().from_function(py_func, py_file) if _in_package(py_file) else None


class PackageCacheLocator(_PackageStamp, caching.UserProvidedCacheLocator):
    """numba's NUMBA_CACHE_DIR locator for this package's kernels, stamped with `KERNEL_DIGEST`."""


class PackageInTreeCacheLocator(_PackageStamp, caching.InTreeCacheLocator):
    """numba's `__pycache__` locator for this package's kernels, stamped with `KERNEL_DIGEST`."""


class PackageUserWideCacheLocator(_PackageStamp, caching.UserWideCacheLocator):
    """numba's per-user cache directory (a read-only install) for this package's kernels, stamped with
    `KERNEL_DIGEST`."""


def install() -> None:
    """Put the package's locators first in numba's cache-locator list (`NUMBA_CACHE_LOCATOR_CLASSES`,
    numba's `config.CACHE_LOCATOR_CLASSES`; a list the user set is kept after them). Idempotent."""
    ours = [
        f"{__name__}.{cls.__name__}"
        for cls in (PackageCacheLocator, PackageInTreeCacheLocator, PackageUserWideCacheLocator)
    ]
    current: str = getattr(config, _LOCATORS_OPTION, "")
    rest = [c.strip() for c in current.split(",") if c.strip()] or _NUMBA_LOCATORS
    setattr(config, _LOCATORS_OPTION, ",".join(ours + [c for c in rest if c not in ours]))


install()  # on import: before any kernel module that takes `njit` from here decorates a kernel
__all__ = ["KERNEL_DIGEST", "install", "njit", "sources_digest"]
