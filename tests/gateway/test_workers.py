"""`kvsched-gateway --workers N`: N processes on one port (SO_REUSEPORT), each a router of the daemon."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest

from kvsched import protocol as p
from kvsched.client import AdminClient
from kvsched.gateway.local_fleet import LocalFleet, write_tiny_tokenizer

from .helpers import eventually, ledger, stream_chat, words

pytestmark = pytest.mark.timeout(240)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _connections(fleet: LocalFleet) -> int:
    with AdminClient(fleet.daemon.admin_endpoint) as admin:
        return admin.call(p.Status()).connections


async def _pids_and_chats(url: str, n: int) -> tuple[set[int], list[dict]]:
    """`n` /health calls and `n` chats, each on a new connection (the kernel picks a listener per connection)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        pids = set()
        for _ in range(n):
            async with s.get(url + "/health") as r:
                assert r.status == 200
                pids.add((await r.json())["pid"])
        chats = await asyncio.gather(*(stream_chat(s, url, words(i * 40, 40)) for i in range(n)))
    return pids, chats


def _workers(supervisor_pid: int) -> set[int]:
    """The gateway processes a `--workers` supervisor started (its children running kvsched.gateway).

    Which worker accepts a connection is the kernel's choice on one shared accept queue (like gunicorn's
    workers): a light sequential load may all land on one of them, so tests name the workers by their
    parent instead of sampling /health."""
    got = subprocess.run(["pgrep", "-P", str(supervisor_pid), "-f", "kvsched.gateway"], capture_output=True, text=True)
    return {int(x) for x in got.stdout.split()}


def test_workers_share_the_port_each_with_its_own_daemon_connection_and_stop_together(tmp_path):
    fleet = LocalFleet.start(tmp_path, n_engines=2, n_gateways=1, speedup=20.0, gateway_extra="workers = 2")
    try:
        url = fleet.gateway_urls[0]
        # One SchedulerClient per worker process. Under load a link may say Hello on a second socket
        # before the first is answered; the daemon reaps the silent one within its liveness timeout.
        assert asyncio.run(eventually(lambda: _connections(fleet) == 2, 20, 0.2)), _connections(fleet)
        answered, chats = asyncio.run(_pids_and_chats(url, 40))
        pids = _workers(fleet.gateways[0].pid)
        assert len(pids) == 2 and answered <= pids, (pids, answered)
        assert all(c["status"] == 200 and c["done"] and c["usage"]["completion_tokens"] == 8 for c in chats), chats
        assert asyncio.run(eventually(lambda: ledger(fleet.daemon.admin_endpoint) == (0, 0), 30))
        supervisor = fleet.gateways[0]
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(30) == 0
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in pids), "a worker outlived its supervisor"
    finally:
        fleet.stop()


def test_a_worker_that_dies_takes_the_group_down_with_its_status(tmp_path):
    fleet = LocalFleet.start(tmp_path, n_engines=1, n_gateways=1, speedup=20.0, gateway_extra="workers = 2")
    try:
        asyncio.run(_pids_and_chats(fleet.gateway_urls[0], 30))
        pids = _workers(fleet.gateways[0].pid)
        assert len(pids) == 2
        victim, other = sorted(pids)
        os.kill(victim, signal.SIGKILL)
        supervisor = fleet.gateways[0]
        assert supervisor.wait(30) == 128 + signal.SIGKILL  # the worker's fate, as a shell reports it
        deadline = time.monotonic() + 15
        while _alive(other) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(other), "the surviving worker was not stopped"
    finally:
        fleet.stop()


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_a_second_workers_group_on_the_same_port_is_refused_with_exit_2(tmp_path):
    """Found by a new user: two `--workers 2` gateways on one port both said "listening" and the kernel
    split clients between them (every socket had SO_REUSEPORT). Result: the second exits 2 naming the
    port, and the first keeps all connections."""
    fleet = LocalFleet.start(tmp_path, n_engines=1, n_gateways=1, speedup=20.0, gateway_extra="workers = 2")
    try:
        url = fleet.gateway_urls[0]
        port = int(url.rsplit(":", 1)[1])
        asyncio.run(_pids_and_chats(url, 20))
        pids = _workers(fleet.gateways[0].pid)
        tok = write_tiny_tokenizer(tmp_path / "tok-b")
        cfg = tmp_path / "b.toml"  # another daemon (absent): its workers would wait 5 s, then exit 3
        cfg.write_text(
            f'[gateway]\ndaemon_endpoint = "ipc://{tmp_path}/b.sock"\nconnect_timeout_s = 5\n\n'
            f'[[models]]\nname = "tiny"\ntokenizer_dir = "{tok}"\n'
        )
        proc = subprocess.run(
            [sys.executable, "-m", "kvsched.gateway", "--config", str(cfg), "--port", str(port), "--workers", "2"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        assert f"cannot listen on 127.0.0.1:{port}: the port is already in use" in proc.stderr, proc.stderr
        assert "--port" in proc.stderr, proc.stderr
        again, _ = asyncio.run(_pids_and_chats(url, 20))
        assert again <= pids, f"connections reached processes of another group: {again - pids}"
    finally:
        fleet.stop()


def test_workers_exit_when_their_supervisor_is_killed_leaving_no_listener_or_files(tmp_path, monkeypatch):
    """Found by a new user: after SIGKILL of the supervisor its workers kept serving the port as orphans
    (with the old config) and its /tmp/kvsched-gateway-* folder stayed. Result: the workers exit, the
    port refuses connections, and the supervisor's temporary directory holds nothing."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # inherited by the gateway: its temporary files land here
    fleet = LocalFleet.start(tmp_path / "fleet", n_engines=1, n_gateways=1, speedup=20.0, gateway_extra="workers = 2")
    pids: set[int] = set()
    try:
        url = fleet.gateway_urls[0]
        port = int(url.rsplit(":", 1)[1])
        asyncio.run(_pids_and_chats(url, 20))
        supervisor = fleet.gateways[0]
        pids = _workers(supervisor.pid)
        assert len(pids) == 2
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait(10)
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in pids), "a worker outlived its SIGKILLed supervisor"
        assert _refused(port), "the port still accepts connections"
        assert list(tmp.iterdir()) == [], list(tmp.iterdir())
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        fleet.stop()


def _listen_backlog(port: int) -> int:
    """Send-Q of the listening socket on `port` per `ss -ltn`: its listen(2) backlog."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.strip()]
    assert len(rows) == 1, out
    return int(rows[0][2])  # State Recv-Q Send-Q Local Peer


@pytest.mark.skipif(not shutil.which("ss"), reason="needs ss (iproute2)")
def test_a_workers_group_listens_with_the_single_gateways_backlog(tmp_path):
    """Found by a new user: `ss -ltn` showed Send-Q 128 for a `--workers` group, 1024 for a single
    gateway (the workers' aiohttp SockSite called listen(128) again on the supervisor's socket)."""
    fleet = LocalFleet.start(tmp_path, n_engines=1, n_gateways=1, speedup=20.0, gateway_extra="workers = 2")
    try:
        single = fleet.add_gateway(extra="workers = 1")
        group_port, single_port = (int(u.rsplit(":", 1)[1]) for u in (fleet.gateway_urls[0], single))
        assert _listen_backlog(single_port) == 1024
        assert _listen_backlog(group_port) == 1024
    finally:
        fleet.stop()
