"""Fixtures of the gateway tests: a LocalFleet (daemon + HTTP sim engines + gateways), and a real
daemon with scripted engines behind the gateway in process (`scripted_daemon_fixture` + `stack`)."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Three simulated engines (speedup 20), KV-aware daemon with KV events, two gateway processes
    (request bodies limited to 64 KiB, prompts to 4,000 tokens)."""
    from kvsched.gateway.local_fleet import LocalFleet

    f = LocalFleet.start(
        tmp_path_factory.mktemp("fleet"),
        n_engines=3,
        n_gateways=2,
        speedup=20.0,
        gateway_extra="max_body_bytes = 65536\nmax_prompt_tokens = 4000",
    )
    yield f
    f.stop()


def scripted_daemon_fixture(dp_sizes: dict[int, int], scope: str = "function", daemon_extra: str = ""):
    """A pytest fixture `daemon`: a real daemon (block_size 16, plus the `[daemon]` lines of
    `daemon_extra`) with one worker per `dp_sizes` entry (worker_id -> data-parallel ranks), each at a
    free port for a `ScriptedEngine` (`daemon.engine_ports`: worker_id -> port); stopped and purged
    afterwards. Use as `daemon = scripted_daemon_fixture({1: 1})` at module level; the `stack`
    fixture serves it."""

    @pytest.fixture(scope=scope, name="daemon")
    def daemon(tmp_path_factory):
        from tests.conftest import free_port, purge, start_daemon

        ports = {w: free_port() for w in dp_sizes}
        workers = "".join(
            f"\n[[workers]]\nworker_id = {w}\n"
            + (f"dp_size = {dp}\n" if dp != 1 else "")
            + f'url = "http://127.0.0.1:{ports[w]}"\n'
            for w, dp in dp_sizes.items()
        )
        d = start_daemon(tmp_path_factory.mktemp("gw"), "[daemon]\nblock_size = 16\n" + daemon_extra + workers)
        d.engine_ports = ports
        yield d
        d.stop()
        purge(d.instance)

    return daemon


@pytest.fixture
async def stack(daemon, tmp_path):
    """(gateway, its URL, {worker_id: ScriptedEngine}, daemon): `helpers.scripted_stack` in front of
    the module's `daemon` (a `scripted_daemon_fixture`)."""
    from .helpers import scripted_stack

    async for s in scripted_stack(daemon, tmp_path):
        yield s


@pytest.fixture
def taken_port():
    """A port on 127.0.0.1 held by a listening socket for the test's duration."""
    s = socket.create_server(("127.0.0.1", 0))
    yield s.getsockname()[1]
    s.close()
