"""The package layering, checked in fresh interpreters (docs/ARCHITECTURE.md, "Contracts between packages").

* the scheduling core and the pure KV-event code load no socket or event-loop library;
* the router-side client loads only the ground floor (`protocol`, `endpoints`, `errors`), its own
  modules and the shared-memory layout / word modules it maps: never the core, the server's config
  tree, the numba kernels or numba itself — also after a real lease went through the mapped words.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The ground floor, module by module (`kvsched.protocol` is a package: one module per job).
PROTOCOL_MODULES = {
    "kvsched.protocol",
    "kvsched.protocol.limits",
    "kvsched.protocol.vocabulary",
    "kvsched.protocol.frames",
    "kvsched.protocol.batching",
    "kvsched.protocol.admin_frames",
    "kvsched.protocol.codec",
    "kvsched.protocol.walk",
}
GROUND_FLOOR = {"kvsched", *PROTOCOL_MODULES, "kvsched.endpoints", "kvsched.errors"}

# What a router process may load from kvsched: the ground floor, the client, the shm layout + words.
CLIENT_ALLOWED = GROUND_FLOOR | {
    "kvsched.hashing",
    "kvsched.shm",
    "kvsched.shm.layout",
    "kvsched.shm.segments",
    "kvsched.shm.space",
    "kvsched.shm.progress",
    "kvsched.shm.words",
}


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _loaded(stdout: str) -> set[str]:
    line = next(l for l in stdout.splitlines() if l.startswith("LOADED "))
    return set(line.split()[1:])


_PRINT_LOADED = "print('LOADED', *sorted(m for m in sys.modules if '.' not in m or m.startswith('kvsched')))\n"


def test_core_and_kvevents_import_no_socket_or_loop_library():
    """Every module of `kvsched.core` plus `kvsched.kvevents`: no zmq, asyncio, uvloop, aiohttp,
    prometheus_client (the kernels' numba is the core's own, so it is allowed)."""
    loaded = _loaded(
        _run(
            "import sys, pkgutil, importlib\n"
            "import kvsched.core, kvsched.kvevents\n"
            "for m in pkgutil.iter_modules(kvsched.core.__path__):\n"
            "    importlib.import_module('kvsched.core.' + m.name)\n"
            "for m in pkgutil.iter_modules(kvsched.kvevents.__path__):\n"
            "    importlib.import_module('kvsched.kvevents.' + m.name)\n" + _PRINT_LOADED
        )
    )
    assert "kvsched.core.scheduler" in loaded  # the walk really imported the core
    assert not loaded & {"zmq", "asyncio", "uvloop", "aiohttp", "prometheus_client"}


def test_client_imports_only_the_ground_floor():
    """`from kvsched.client import ...` of every public class (they load lazily)."""
    loaded = _loaded(
        _run(
            "import sys\n"
            "from kvsched.client import AdminClient, Lease, SchedulerClient, SyncLease, SyncSchedulerClient\n"
            "import kvsched.hashing\n" + _PRINT_LOADED
        )
    )
    assert "kvsched.client.client" in loaded
    assert "numba" not in loaded
    own = {m for m in loaded if m.startswith("kvsched") and not m.startswith("kvsched.client")}
    assert own <= CLIENT_ALLOWED, sorted(own - CLIENT_ALLOWED)


def test_client_with_mapped_words_stays_on_the_ground_floor(session_daemon):
    """A real lease through a running daemon, with the progress segment mapped (state and progress
    words written by stores): the router process still never loads the core, config or kernels."""
    loaded = _loaded(
        _run(
            "import sys, asyncio\n"
            "from kvsched.client import SchedulerClient\n"
            "async def main():\n"
            f"    async with SchedulerClient({session_daemon.endpoint!r}) as client:\n"
            "        async with await client.schedule('layering-1', isl_tokens=40, block_hashes=[1, 2]) as lease:\n"
            "            lease.dispatched()\n"
            "            lease.prefill_done()\n"
            "            lease.add_output_tokens(3)\n"
            "            assert client._words.mapped\n"
            "asyncio.run(main())\n" + _PRINT_LOADED
        )
    )
    assert "kvsched.shm.segments" in loaded  # the words were mapped, not sent as frames
    assert "numba" not in loaded
    own = {m for m in loaded if m.startswith("kvsched") and not m.startswith("kvsched.client")}
    assert own <= CLIENT_ALLOWED, sorted(own - CLIENT_ALLOWED)


def test_ground_floor_imports_nothing_else_of_kvsched():
    """`protocol` (every module of the package), `endpoints` and `errors` stand on the standard library
    and msgspec alone."""
    loaded = _loaded(_run("import sys\nimport kvsched.protocol, kvsched.endpoints, kvsched.errors\n" + _PRINT_LOADED))
    assert {m for m in loaded if m.startswith("kvsched")} == GROUND_FLOOR
    assert not loaded & {"numpy", "zmq", "numba"}
