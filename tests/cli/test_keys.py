"""`kvsched keys`: CURVE key pairs with safe file modes that the daemon and a remote router accept."""

from __future__ import annotations

import os
import stat

import pytest
import zmq
import zmq.auth
from typer.testing import CliRunner

from kvsched.cli import EXIT_OK, EXIT_USAGE, app
from kvsched.daemon.process import DaemonProcess
from kvsched.daemon.sockets import load_curve_secret
from kvsched.errors import DaemonUnavailable
from tests.conftest import free_port, purge, unique_instance

pytestmark = pytest.mark.timeout(90)
runner = CliRunner()


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_keys_writes_a_public_and_a_private_file_with_safe_modes(tmp_path):
    old = os.umask(0)  # the secret stays 0600 whatever the caller's umask
    try:
        result = runner.invoke(app, ["keys", str(tmp_path / "k"), "--name", "server"])
    finally:
        os.umask(old)
    assert result.exit_code == EXIT_OK, result.output
    public_file, secret_file = tmp_path / "k" / "server.key", tmp_path / "k" / "server.key_secret"
    assert mode(tmp_path / "k") == 0o700
    assert mode(secret_file) == 0o600
    assert mode(public_file) == 0o644
    public, secret = zmq.auth.load_certificate(secret_file)
    assert secret is not None and zmq.curve_public(secret) == public
    assert zmq.auth.load_certificate(public_file) == (public, None)
    assert load_curve_secret(str(secret_file)) == secret
    assert public.decode() in result.output and secret.decode() not in result.output


def test_keys_refuses_to_overwrite_without_force(tmp_path):
    assert runner.invoke(app, ["keys", str(tmp_path), "--name", "r1"]).exit_code == EXIT_OK
    first = (tmp_path / "r1.key_secret").read_text()
    again = runner.invoke(app, ["keys", str(tmp_path), "--name", "r1"])
    assert again.exit_code == EXIT_USAGE and "--force" in again.output
    assert (tmp_path / "r1.key_secret").read_text() == first
    assert runner.invoke(app, ["keys", str(tmp_path), "--name", "r1", "--force"]).exit_code == EXIT_OK
    assert (tmp_path / "r1.key_secret").read_text() != first
    assert mode(tmp_path / "r1.key_secret") == 0o600


def test_keys_rejects_a_name_that_is_a_path(tmp_path):
    assert runner.invoke(app, ["keys", str(tmp_path), "--name", "../x"]).exit_code == EXIT_USAGE


def test_generated_keys_let_an_authorized_router_in_over_tcp_and_keep_others_out(tmp_path):
    """The README's remote-router recipe: server pair for the daemon, router pair authorized by its
    public file in curve_authorized_keys_dir."""
    from kvsched.client import SyncSchedulerClient

    assert runner.invoke(app, ["keys", str(tmp_path / "server"), "--name", "server"]).exit_code == EXIT_OK
    assert runner.invoke(app, ["keys", str(tmp_path / "routers"), "--name", "router-a"]).exit_code == EXIT_OK
    server_public, _ = zmq.auth.load_certificate(tmp_path / "server" / "server.key")
    router_keys = zmq.auth.load_certificate(tmp_path / "routers" / "router-a.key_secret")
    port = free_port()
    cfg = tmp_path / "pool.toml"
    cfg.write_text(
        f'[daemon]\ncurve_secret_key_file = "{tmp_path}/server/server.key_secret"\n'
        f'curve_authorized_keys_dir = "{tmp_path}/routers"\n[[workers]]\nworker_id = 0\n'
    )
    instance = unique_instance()
    d = DaemonProcess.start(
        cfg, instance=instance, runtime_dir=tmp_path, extra_args=["--endpoint", f"tcp://0.0.0.0:{port}"]
    )
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        with (
            SyncSchedulerClient(
                endpoint, curve_server_key=server_public, curve_client_keys=router_keys, attach_progress=False
            ) as client,
            client.schedule("remote-1", isl_tokens=10) as lease,
        ):
            assert lease.worker.worker_id == 0
        stranger = zmq.curve_keypair()
        with pytest.raises(DaemonUnavailable):
            SyncSchedulerClient(
                endpoint,
                curve_server_key=server_public,
                curve_client_keys=stranger,
                connect_timeout_s=1.0,
                attach_progress=False,
            )
    finally:
        d.stop()
        purge(instance)


def test_keys_into_an_unwritable_directory_is_a_one_line_usage_error():
    """Before: a FileNotFoundError traceback. After: one line on stderr naming the directory, exit 2
    (a real process: what the user sees)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "kvsched.cli", "keys", "/proc/nope", "--name", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == EXIT_USAGE
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "/proc/nope" in lines[0], proc.stderr
