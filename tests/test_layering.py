"""The package layering, read from the source (docs/ARCHITECTURE.md, "Contracts between packages").

Every `import` statement of every module under `kvsched/` is parsed with `ast` — module-level ones,
those under `if TYPE_CHECKING:` and those inside functions — into a graph of edges, each of one kind:

* ``module``: runs when the importing module is imported (top level, `try`, plain `if`);
* ``type``: under `if TYPE_CHECKING:`, read only by type checkers. It must respect the table like any
  other import, and it counts in the circle check: two modules whose annotations name each other are one
  concept split in two (or the lower one should state what it needs as a `typing.Protocol`);
* ``lazy``: inside a function. Allowed only in the entry points listed in `ENTRY_POINTS` (a command-line
  entry and what it alone pays for); anywhere else it would hide an edge from whoever reads the imports.

The tests assert: every edge between packages is in `ALLOWED` (which itself only points down the
floors of `FLOORS`, so no import runs back up); no import circle, inside a package or across packages,
counting all three kinds; the libraries each package may reach, over the whole static closure; and one
fresh interpreter that runs a real lease loads only modules the static graph predicted.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvsched"

# Left out of the graph: the numpy / Python twins of the kernels, on their way out of the package to
# tests/ and bench/ (they import `core.overlap_view` from `shm/`, and each other in a circle).
LEFT_OUT = ("shm/reference*.py",)

# The floors, lowest first. A unit is a top-level module or subpackage of kvsched ("kvsched" is the
# package's own `__init__`). A unit may import only units on lower floors, as `ALLOWED` lists them.
FLOORS: tuple[frozenset[str], ...] = (
    frozenset({"kvsched", "protocol", "endpoints", "errors", "hashing"}),  # the ground floor
    frozenset({"config", "shm"}),
    frozenset({"core", "kvevents", "client"}),
    frozenset({"daemon"}),
    frozenset({"gateway"}),
    frozenset({"sim"}),
    frozenset({"cli"}),
)
GROUND_FLOOR = FLOORS[0]

# unit -> the units it may import (any unit may import the `kvsched` package itself: `__version__`).
ALLOWED: dict[str, frozenset[str]] = {
    "kvsched": frozenset(),
    "protocol": frozenset(),  # wire frames: the standard library and msgspec alone
    "endpoints": frozenset(),
    "errors": frozenset(),
    "hashing": frozenset(),  # block hashing (Enqueue.block_hashes): the standard library, numpy, xxhash
    "config": frozenset({"protocol", "endpoints", "errors"}),
    "shm": frozenset({"protocol", "errors"}),
    "core": frozenset({"protocol", "errors", "config", "shm"}),
    "kvevents": frozenset({"protocol", "errors", "hashing", "config", "shm"}),
    "client": frozenset({"protocol", "endpoints", "errors", "hashing", "shm"}),  # shm: CLIENT_SHM only
    "daemon": frozenset({"protocol", "endpoints", "errors", "config", "shm", "core", "kvevents"}),
    "gateway": frozenset({"protocol", "endpoints", "errors", "hashing", "client", "daemon"}),
    "sim": frozenset().union(*FLOORS[:5]) - {"kvsched"},  # every package below it (drives them all)
    "cli": frozenset({"protocol", "endpoints", "errors", "client", "sim"}),
}
# The shared-memory modules a router maps its slot's words with: never the kernels (numba).
CLIENT_SHM = frozenset({"kvsched.shm", "kvsched.shm.layout", "kvsched.shm.segments", "kvsched.shm.space"})
CLIENT_SHM |= {"kvsched.shm.progress", "kvsched.shm.words"}

# The only functions that may import inside their body: command-line entry points and what only they
# pay for, each with its reason.
ENTRY_POINTS: dict[str, str] = {
    "kvsched._version": "`kvsched.__version__` / `--version`: importlib.metadata costs ~50 ms, paid when asked",
    "kvsched.cli._print_version": "`kvsched --version`: the version lookup only when asked",
    "kvsched.cli._register_replay": "`kvsched replay` is registered only where the simulator imports",
    "kvsched.cli.keys.keys": "`kvsched keys`: zmq's CURVE key generation only for that command",
    "kvsched.cli.views.top": "`kvsched top`: rich's live display only for that command",
    "kvsched.daemon.app._print_version": "`kvsched-daemon --version`: the version lookup only when asked",
    "kvsched.daemon.app.daemon_main": "`kvsched-daemon`: uvloop, after the config is loaded",
    "kvsched.gateway.app.main": "`kvsched-gateway`: uvloop",
    "kvsched.gateway.demo.main": "`kvsched-gateway --demo`: the local fleet only for the demo",
    "kvsched.sim.http_engine.main": "`kvsched-sim-engine`: uvloop",
    "kvsched.sim.replay_cli.replay": "`kvsched replay`: the replay machinery only when it runs",
    "kvsched.sim.router.router_main": "a replay's router process (multiprocessing spawn target): uvloop",
}

# Libraries (top-level import names) a unit may not reach through its static closure.
SOCKETS_AND_LOOPS = frozenset({"zmq", "asyncio", "uvloop", "aiohttp", "prometheus_client"})
FORBIDDEN_LIBRARIES: dict[str, frozenset[str]] = {
    # no socket or event loop (the kernels' numba is the core's own)
    "core": SOCKETS_AND_LOOPS,
    "kvevents": SOCKETS_AND_LOOPS,
    # a router process never compiles kernels
    "client": frozenset({"numba"}),
    # the ground floor below the hashing stands on the standard library and msgspec
    "protocol": frozenset({"numpy", "numba", "zmq"}),
    "endpoints": frozenset({"numpy", "numba", "zmq"}),
    "errors": frozenset({"numpy", "numba", "zmq"}),
    "hashing": frozenset({"numba", "zmq"}),
}


@dataclass(frozen=True)
class Edge:
    """One import statement's target: `source` imports `target` (a kvsched module or a library)."""

    source: str  # dotted module name
    target: str  # dotted kvsched module name, or a library's top-level name
    kind: str  # "module" | "type" | "lazy"
    function: str  # "" or the enclosing function's dotted name (module.Class.method)
    line: int

    def __str__(self) -> str:
        where = f" in {self.function}" if self.function else ""
        return f"{self.source} -> {self.target} ({self.kind}{where}, line {self.line})"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    left_out = {p for pattern in LEFT_OUT for p in PACKAGE.glob(pattern)}
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if p not in left_out}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, modules: set[str]) -> None:
        self.module, self.modules, self.edges = module, modules, []
        self.package = module if is_package else module.rpartition(".")[0]
        self.scope: list[str] = []  # enclosing classes and functions
        self.functions = 0  # how many of them are functions
        self.type_only = 0

    def _target(self, name: str) -> str:
        if name.split(".")[0] != "kvsched":
            return name.split(".")[0]
        while name not in self.modules:  # `import kvsched.a.b` of a left-out module: its package
            name = name.rpartition(".")[0]
        return name

    def _add(self, target: str, line: int) -> None:
        function = ".".join([self.module, *self.scope]) if self.functions else ""
        kind = "lazy" if function else "type" if self.type_only else "module"
        self.edges.append(Edge(self.module, self._target(target), kind, function, line))

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.functions += 1
        self.generic_visit(node)
        self.functions -= 1
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self.type_only += 1
            for child in node.body:
                self.visit(child)
            self.type_only -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        if module == "__future__":
            return
        for alias in node.names:
            sub = f"{module}.{alias.name}"
            self._add(sub if sub in self.modules else module, node.lineno)


def _graph() -> list[Edge]:
    sources = _sources()
    edges: list[Edge] = []
    for module, path in sources.items():
        collector = _Collector(module, path.name == "__init__.py", set(sources))
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        edges += [e for e in collector.edges if e.target != module]
    return list(dict.fromkeys(edges))  # `from m import a, b`: one edge


EDGES = _graph()
MODULES = set(_sources())


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kvsched"


def _own(edge: Edge) -> bool:
    return edge.target == "kvsched" or edge.target.startswith("kvsched.")


def _closure(start: set[str], skip: frozenset[str] = frozenset()) -> set[str]:
    """Every module and library importing `start` may run: module-level and lazy edges (but those of the
    functions in `skip`), plus the packages (`__init__`) Python runs on the way to a submodule."""
    out: defaultdict[str, set[str]] = defaultdict(set)
    for e in EDGES:
        if e.kind != "type" and e.function not in skip:
            out[e.source].add(e.target)
    seen: set[str] = set()
    todo = list(start)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo += out[m]
        if "." in m:
            todo.append(m.rpartition(".")[0])
    return seen


def test_the_graph_reads_every_kind_of_import():
    """The collector sees module-level, TYPE_CHECKING and function-local imports, relative and absolute."""
    kinds = {e.kind for e in EDGES}
    assert kinds == {"module", "type", "lazy"}, kinds
    assert any(e.source == "kvsched.daemon.app" and e.target == "uvloop" and e.kind == "lazy" for e in EDGES)
    assert any(e.source == "kvsched.core.scheduler" and e.target == "kvsched.core.ledger" for e in EDGES)
    assert "kvsched.core.scheduler" in MODULES and "kvsched.hashing" in MODULES


def test_the_table_only_points_down_the_floors():
    """Each allowed edge goes to a strictly lower floor, and every unit of the package has a floor."""
    floor = {unit: i for i, units in enumerate(FLOORS) for unit in units}
    assert set(floor) == set(ALLOWED) == {_unit(m) for m in MODULES}
    up = [(a, b) for a, targets in ALLOWED.items() for b in targets if floor[b] >= floor[a]]
    assert not up, up


def test_the_architecture_page_states_the_same_table():
    """docs/ARCHITECTURE.md ("Contracts between packages") draws the floors and the allowed imports;
    its table and `FLOORS` / `ALLOWED` say the same."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    rows = [line.split("|")[1:4] for line in text.splitlines() if re.match(r"\s*\| \d+ \| `", line)]
    floors: defaultdict[int, set[str]] = defaultdict(set)
    allowed: dict[str, frozenset[str]] = {}
    for floor, units, targets in rows:
        names = [u for u in re.findall(r"`(\w+)`", units) if u in ALLOWED]
        floors[int(floor)].update(names)
        below = {u for i, f in enumerate(FLOORS) if i < int(floor) for u in f} - {"kvsched"}
        stated = frozenset(re.findall(r"`(\w+)`", targets)) & set(ALLOWED)
        for unit in names:
            allowed[unit] = frozenset(below) if "every package below it" in targets else stated
    assert [floors[i] for i in range(len(FLOORS))] == [set(f) - {"kvsched"} for f in FLOORS]
    assert allowed == {u: t for u, t in ALLOWED.items() if u != "kvsched"}


def test_every_import_between_packages_is_in_the_table():
    """No edge of any kind outside `ALLOWED`; the client reaches shared memory only through `CLIENT_SHM`."""
    bad = []
    for e in filter(_own, EDGES):
        a, b = _unit(e.source), _unit(e.target)
        if a == b or b == "kvsched":
            continue
        if b not in ALLOWED[a] or (a == "client" and b == "shm" and e.target not in CLIENT_SHM):
            bad.append(str(e))
    assert not bad, "\n".join(bad)


def test_no_import_circles():
    """Module-level, TYPE_CHECKING and function-local edges together form no circle (Tarjan's SCC)."""
    graph: defaultdict[str, set[str]] = defaultdict(set)
    for e in filter(_own, EDGES):
        graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    detail = [str(e) for e in EDGES if any(e.source in c and e.target in c for c in circles)]
    assert not circles, "\n".join(detail)


def test_function_local_imports_only_at_entry_points():
    """A function-local import is allowed only in `ENTRY_POINTS`, and each entry there still has one."""
    lazy = [e for e in EDGES if e.kind == "lazy"]
    bad = [str(e) for e in lazy if e.function not in ENTRY_POINTS]
    assert not bad, "\n".join(bad)
    assert set(ENTRY_POINTS) == {e.function for e in lazy}, set(ENTRY_POINTS) - {e.function for e in lazy}


def test_type_checking_imports_name_only_kvsched_or_typing_modules():
    """`if TYPE_CHECKING:` is for annotations: across kvsched modules, the standard library, and libraries
    the importing package may use at run time — never a way to hide from the table a library its package
    must not load (the ground floor names no library at all)."""
    bad = [
        str(e)
        for e in EDGES
        if e.kind == "type"
        and not _own(e)
        and e.target.partition(".")[0] not in sys.stdlib_module_names
        and (
            _unit(e.source) in GROUND_FLOOR  # the ground floor names only the standard library and msgspec
            or e.target.partition(".")[0] in FORBIDDEN_LIBRARIES.get(_unit(e.source), frozenset())
        )
    ]
    assert not bad, "\n".join(bad)


def test_each_package_reaches_only_its_libraries():
    """Over the static closure (module-level and lazy edges, packages run on the way): the core and
    `kvevents` reach no socket, event loop, clock or logging; the client never the kernels' numba nor the
    core, the daemon's config or the kernels; the ground floor stands on the standard library and msgspec
    (the block hashing adds numpy and xxhash)."""
    for unit, forbidden in FORBIDDEN_LIBRARIES.items():
        modules = {m for m in MODULES if _unit(m) == unit}
        reached = _closure(modules)
        assert not reached & forbidden, (unit, sorted(reached & forbidden))
    client = _closure({m for m in MODULES if _unit(m) == "client"})
    own = {m for m in client if m == "kvsched" or m.startswith("kvsched.")}
    assert {_unit(m) for m in own} == {"kvsched", "client", "protocol", "endpoints", "errors", "hashing", "shm"}
    assert {m for m in own if _unit(m) == "shm"} <= CLIENT_SHM
    ground = _closure({m for m in MODULES if _unit(m) in GROUND_FLOOR - {"hashing"}})
    libraries = {m for m in ground if not m.startswith("kvsched")} - set(sys.stdlib_module_names)
    assert libraries == {"msgspec"}, libraries
    hashing = _closure({"kvsched.hashing"})
    assert {m for m in hashing if not m.startswith("kvsched")} - set(sys.stdlib_module_names) == {"numpy", "xxhash"}


def test_the_cli_reaches_no_numpy_until_a_replay_runs():
    """`kvsched` starts and makes admin calls without numpy, numba, the core or shared memory; only the
    body of `kvsched replay` (an entry point) loads the simulator."""
    reached = _closure({m for m in MODULES if _unit(m) == "cli"}, skip=frozenset({"kvsched.sim.replay_cli.replay"}))
    heavy = {m for m in reached if m in {"numpy", "numba"} or _unit(m) in {"core", "shm", "daemon"}}
    assert not heavy, sorted(heavy)
    assert "kvsched.client.admin" in reached and "kvsched.sim.replay_cli" in reached


def test_the_core_itself_does_no_io():
    """The core's and `kvevents`' own modules import no clock, file, socket, logging or terminal library
    (time comes in as `now_us`; the config they read is built elsewhere)."""
    io = {"os", "time", "socket", "logging", "typer", "rich", "subprocess", "threading"} | SOCKETS_AND_LOOPS
    bad = [str(e) for e in EDGES if _unit(e.source) in {"core", "kvevents"} and e.target in io]
    assert not bad, "\n".join(bad)


_PRINT_LOADED = "print('LOADED', *sorted(m for m in sys.modules if '.' not in m or m.startswith('kvsched')))\n"


def test_a_router_process_loads_only_what_the_graph_predicts(session_daemon):
    """A fresh interpreter imports every public client name and the block hashing, then runs a real
    lease through a running daemon with the progress segment mapped (state and progress words written
    by stores): it never loads numba, the core, the config or the kernels, and every kvsched module it
    loads is in the static closure of the client (so nothing reaches it by a path the graph misses)."""
    code = (
        "import sys, asyncio\n"
        "from kvsched.client import AdminClient, Lease, SchedulerClient, SyncLease, SyncSchedulerClient\n"
        "import kvsched.hashing\n"
        "async def main():\n"
        f"    async with SchedulerClient({session_daemon.endpoint!r}) as client:\n"
        "        async with await client.schedule('layering-1', isl_tokens=40, block_hashes=[1, 2]) as lease:\n"
        "            lease.dispatched()\n"
        "            lease.prefill_done()\n"
        "            lease.add_output_tokens(3)\n"
        "            assert client._words.mapped\n"
        "asyncio.run(main())\n" + _PRINT_LOADED
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("LOADED "))
    loaded = set(line.split()[1:])
    assert {"kvsched.client.client", "kvsched.shm.segments"} <= loaded  # the words were mapped, not sent
    assert "numba" not in loaded
    own = {m for m in loaded if m.startswith("kvsched")}
    predicted = _closure({m for m in MODULES if _unit(m) in {"client", "hashing"}})
    assert own <= predicted, sorted(own - predicted)
    assert not {m for m in own if _unit(m) in {"core", "config", "daemon"}}
