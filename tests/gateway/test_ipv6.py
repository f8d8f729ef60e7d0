"""The gateway listens on IPv6 addresses (`--host ::1`, `--host ::`), with and without `--workers`.

Found by a new user: `kvsched-gateway --host ::1 --port P` exited 2 with "cannot listen on ::1:P:
Address family for hostname not supported" (the start-up port check bound an AF_INET socket); the
same for `--host ::` and with `--workers 2`.
"""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from kvsched.gateway.local_fleet import LocalFleet

from .helpers import stream_chat, words

pytestmark = pytest.mark.timeout(180)


def _free_ipv6_port() -> int:
    """A free TCP port on ::1; skips the test when this machine has no IPv6 loopback."""
    if not socket.has_ipv6:
        pytest.skip("Python built without IPv6")
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6) as s:
            return s.getsockname()[1]
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")


async def _health_and_chat(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/health") as r:
            status = r.status
        return status, await stream_chat(s, url, words(0, 20))


@pytest.mark.parametrize("host, workers", [("::1", 1), ("::1", 2), ("::", 1)])
def test_the_gateway_serves_on_an_ipv6_address(tmp_path, host, workers):
    port = _free_ipv6_port()
    fleet = LocalFleet.start(
        tmp_path,
        n_engines=1,
        n_gateways=1,
        speedup=20.0,
        gateway_port=port,
        gateway_extra=f'host = "{host}"\nworkers = {workers}',
    )
    try:
        status, chat = asyncio.run(_health_and_chat(f"http://[::1]:{port}"))
        assert status == 200
        assert chat["status"] == 200 and chat["done"] and chat["usage"]["completion_tokens"] == 8, chat
    finally:
        fleet.stop()
