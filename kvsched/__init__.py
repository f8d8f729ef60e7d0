"""kvsched: a KV-cache-aware scheduling daemon for LLM serving fleets (see README.md).

`__version__` has one source, the installed distribution's metadata (`[project] version` in
pyproject.toml); a source tree that was never installed reports "0+unknown". It is read on first
access (`importlib.metadata` is slow to import), and this file imports nothing else, so
`import kvsched.client` and the `kvsched` CLI stay cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    __version__: str

__all__ = ["__version__"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvsched")
    except PackageNotFoundError:
        return "0+unknown"


def __getattr__(name: str) -> str:
    if name == "__version__":
        value = _version()
        globals()["__version__"] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
