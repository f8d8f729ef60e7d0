"""Which worker selectors are installed: the `kvsched.selectors` entry-point group (docs/ROUTING.md,
"Selectors are plug-ins").

A distribution registers a selector by naming a `kvsched.core.selector.WorkerSelector` subclass in
that group; the entry point's name is the `[selector] type` that picks it. kvsched registers its own
(`kv`, `round_robin`, `least_loaded`, `power_of_two`, `random`; pyproject.toml); the routing
baselines the benchmarks compare against come with the `kvsched-bench` distribution (bench/pyproject.toml,
installed by `make bench` and `make test`). The config refuses a type that is not installed
(`selector_problem`), with a message naming that distribution for a known baseline.

The group is read from the installed distributions' metadata (`importlib.metadata`) once per process
and read again when a name is not found, so a distribution installed while a daemon runs is seen by
its next reload.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

SELECTOR_GROUP = "kvsched.selectors"
# the distribution holding the routing baselines (bench/pyproject.toml), and their names: only used to
# say where a missing one comes from
BENCH_DISTRIBUTION = "kvsched-bench"
BENCH_SELECTORS = ("dynamo_cost", "cache_aware", "lmetric", "llmd", "llmd_sticky")

_installed: dict[str, EntryPoint] | None = None


def installed_selectors(refresh: bool = False) -> dict[str, EntryPoint]:
    """{selector type: its entry point} of every installed distribution, sorted by name (the first
    registration of a name wins, in `importlib.metadata`'s order). `refresh` reads the metadata
    again (a scan of every installed distribution); otherwise the first read is kept."""
    global _installed
    if _installed is None or refresh:
        found: dict[str, EntryPoint] = {}
        for ep in entry_points(group=SELECTOR_GROUP):
            found.setdefault(ep.name, ep)
        _installed = dict(sorted(found.items()))
    return _installed


def selector_problem(name: str) -> str | None:
    """None when selector type `name` is installed; otherwise why not, naming the distribution to
    install for a known baseline and listing the installed types (the metadata is read again first)."""
    if name in installed_selectors():
        return None
    installed = installed_selectors(refresh=True)
    if name in installed:
        return None
    listed = ", ".join(installed) or "none"
    if name in BENCH_SELECTORS:
        return (
            f"{name!r} is a routing baseline of the {BENCH_DISTRIBUTION} distribution, which is not installed "
            f"here (`make bench`, or `pip install -e bench/` in a kvsched checkout; docs/ROUTING.md); "
            f"installed selectors: {listed}"
        )
    hint = ""
    if "kv" not in installed:  # kvsched's own registrations are missing: metadata of an older install
        hint = (
            "; kvsched's own selectors are not registered either: its installed metadata predates the "
            f"{SELECTOR_GROUP!r} entry points (reinstall it, e.g. `pip install -e .`)"
        )
    return f"unknown selector {name!r}; installed selectors ({SELECTOR_GROUP} entry points): {listed}{hint}"


def selector_entry_point(name: str) -> EntryPoint:
    """The entry point registering selector type `name`.

    Raises:
        ValueError: `name` is not installed (the message is `selector_problem`'s).
    """
    problem = selector_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return installed_selectors()[name]
