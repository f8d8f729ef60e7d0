"""A gateway (or `make gateway-demo`) whose HTTP port is taken says so, naming the port and how to pick another.

Found by a new user: with port 8080 held by another program, `make gateway-demo` started a daemon and
three engines, then printed two nested tracebacks, "Unclosed client session" and a shared-memory
`BufferError`, with the cause (`address already in use`) buried in the middle.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid

import pytest

from kvsched.daemon.process import DaemonProcess
from kvsched.gateway.local_fleet import write_tiny_tokenizer

pytestmark = pytest.mark.timeout(180)


def _gateway_cmd(tmp_path, endpoint: str, port: int, connect_timeout_s: float) -> list[str]:
    tok = write_tiny_tokenizer(tmp_path / "tok")
    cfg = tmp_path / "gateway.toml"
    cfg.write_text(
        f'[gateway]\nport = {port}\ndaemon_endpoint = "{endpoint}"\n'
        f'connect_timeout_s = {connect_timeout_s}\n\n[[models]]\nname = "tiny"\ntokenizer_dir = "{tok}"\n'
    )
    return [sys.executable, "-m", "kvsched.gateway", "--config", str(cfg), "--log-level", "INFO"]


def _assert_clear_port_message(out: str, port: int) -> None:
    assert "Traceback" not in out, out
    assert f"127.0.0.1:{port}" in out and "already in use" in out and "--port" in out, out
    assert "Unclosed" not in out and "BufferError" not in out, out


def test_gateway_demo_with_its_port_taken_names_the_port_and_how_to_choose_another(tmp_path, taken_port):
    workdir = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "kvsched.gateway.demo", "--port", str(taken_port), "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"port {taken_port} is already in use" in proc.stderr
    assert "--port 18080" in proc.stderr and "GATEWAY_DEMO_PORT=" in proc.stderr
    assert not (workdir / "daemon.toml").exists()  # nothing was started


def test_gateway_with_its_port_taken_exits_2_before_waiting_for_the_daemon(tmp_path, taken_port):
    t0 = time.monotonic()
    proc = subprocess.run(
        _gateway_cmd(tmp_path, f"ipc://{tmp_path}/absent.sock", taken_port, 60),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    _assert_clear_port_message(proc.stderr, taken_port)
    assert time.monotonic() - t0 < 50  # did not wait the 60 s connect timeout for an absent daemon


def test_gateway_whose_port_is_taken_while_it_waits_for_the_daemon_exits_cleanly(tmp_path):
    instance = f"gwp-{uuid.uuid4().hex[:8]}"
    run = tmp_path / "run"
    run.mkdir()
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        _gateway_cmd(tmp_path, f"ipc://{run}/{instance}.sock", port, 90),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    daemon = None
    try:
        deadline = time.monotonic() + 60
        out_so_far = ""
        while "waiting up to" not in out_so_far:  # the gateway checked its port and now waits for the daemon
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            out_so_far += proc.stdout.readline()
        with socket.create_server(("127.0.0.1", port)):  # someone else takes the port meanwhile
            daemon = DaemonProcess.start(None, instance=instance, runtime_dir=run)
            out = out_so_far + proc.communicate(timeout=90)[0]
        assert proc.returncode == 2, out
        _assert_clear_port_message(out, port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if daemon is not None:
            daemon.stop()


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--port", "99999"], "99999 is not a TCP port"),
        (["--port", "-1"], "-1 is not a TCP port"),
        (["--host", "nosuchhost.invalid"], "cannot listen on nosuchhost.invalid:"),
    ],
)
def test_a_bad_listen_address_exits_2_with_a_message_not_a_traceback(tmp_path, extra, needle):
    """Found from outside: `--port 99999` (OverflowError), `--port -1` and an unresolvable `--host`
    (gaierror) ended in a Python traceback with exit 1 (docs/GATEWAY.md promises exit 2 and a message
    for start errors). Result: exit 2, the message names the value, no traceback."""
    port = socket.create_server(("127.0.0.1", 0))
    free = port.getsockname()[1]
    port.close()
    proc = subprocess.run(
        _gateway_cmd(tmp_path, f"ipc://{tmp_path}/absent.sock", free, 5) + extra,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and needle in proc.stderr, proc.stderr
