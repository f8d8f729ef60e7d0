"""A router started before its daemon (systemd units or a compose file that bring the routers up first)
waits up to `connect_timeout_s` for the daemon's ipc socket file to appear, as it does over TCP."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvsched.client import SchedulerClient
from kvsched.daemon.process import DaemonProcess
from kvsched.errors import DaemonUnavailable
from tests.conftest import purge, unique_instance, write_config

pytestmark = pytest.mark.timeout(180)

CONFIG = """
[daemon]
block_size = 16

[[workers]]
worker_id = 1
total_kv_blocks = 1000
"""


async def test_a_router_started_before_the_daemon_connects_once_its_socket_appears(tmp_path):
    """Before: `DaemonUnavailable: ... socket file ... does not exist` at once, whatever the timeout."""
    instance = unique_instance("early")
    endpoint = f"ipc://{tmp_path}/{instance}.sock"  # where DaemonProcess.start binds it
    cfg = write_config(tmp_path / f"{instance}.toml", CONFIG)
    client = SchedulerClient(endpoint, client_name="early", connect_timeout_s=90)
    connecting = asyncio.create_task(client.connect())
    await asyncio.sleep(1.0)
    assert not connecting.done(), "the router gave up before the daemon started"
    d = await asyncio.to_thread(DaemonProcess.start, cfg, instance=instance, runtime_dir=tmp_path)
    try:
        await asyncio.wait_for(connecting, 60)
        lease = await asyncio.wait_for(client.schedule("r1", isl_tokens=10), 30)
        lease.release()
    finally:
        await client.close()
        d.stop()
        purge(d.instance)


async def test_without_a_daemon_the_router_fails_after_its_timeout_naming_the_socket_file(tmp_path):
    endpoint = f"ipc://{tmp_path}/absent.sock"
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable, match=r"absent.sock does not exist"):
        await SchedulerClient(endpoint, client_name="early", connect_timeout_s=1.5).connect()
    assert time.monotonic() - t0 >= 1.5
