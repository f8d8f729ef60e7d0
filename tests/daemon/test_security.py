"""Security (docs/DESIGN.md §1.2, §7.1): CURVE on non-loopback TCP, socket and segment file modes."""

from __future__ import annotations

import os
import stat

import pytest
import zmq

from kvsched.client import SchedulerClient
from kvsched.daemon.process import DaemonProcess
from kvsched.errors import DaemonUnavailable
from tests.conftest import free_port, purge, unique_instance

pytestmark = pytest.mark.timeout(60)


def test_non_loopback_tcp_without_curve_key_refuses_to_start(tmp_path):
    with pytest.raises(DaemonUnavailable, match="CURVE"):
        DaemonProcess.start(
            None,
            instance=unique_instance(),
            runtime_dir=tmp_path,
            ready_timeout_s=20,
            extra_args=["--workers", "1", "--endpoint", f"tcp://0.0.0.0:{free_port()}"],
        )


async def test_curve_rejects_a_keyless_client_and_admits_one_with_the_server_key(tmp_path):
    public, secret = zmq.curve_keypair()
    key_file = tmp_path / "server.key"
    key_file.write_bytes(secret + b"\n")
    port = free_port()
    cfg = tmp_path / "curve.toml"
    cfg.write_text(f'[daemon]\ncurve_secret_key_file = "{key_file}"\n[[workers]]\nworker_id = 0\n')
    instance = unique_instance()
    d = DaemonProcess.start(
        cfg, instance=instance, runtime_dir=tmp_path, extra_args=["--endpoint", f"tcp://0.0.0.0:{port}"]
    )
    try:
        with pytest.raises(DaemonUnavailable):
            await SchedulerClient(f"tcp://127.0.0.1:{port}", connect_timeout_s=1.0).connect()
        async with SchedulerClient(f"tcp://127.0.0.1:{port}", curve_server_key=public) as client:
            lease = await client.schedule("curve-1", isl_tokens=10)
            lease.release()
    finally:
        d.stop()
        purge(instance)


def test_socket_and_segment_modes(session_daemon):
    data = session_daemon.endpoint[len("ipc://") :]
    admin = session_daemon.admin_endpoint[len("ipc://") :]
    assert stat.S_IMODE(os.stat(data).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(admin).st_mode) == 0o600
    instance = session_daemon.instance
    assert stat.S_IMODE(os.stat(f"/dev/shm/kvsched-{instance}-ledger").st_mode) == 0o640
    assert stat.S_IMODE(os.stat(f"/dev/shm/kvsched-{instance}-progress").st_mode) == 0o660
