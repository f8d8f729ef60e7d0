"""A gateway started before its daemon waits for it (one pod, one compose file); without one it fails clearly.

Found from outside: CI started the gateways of a local fleet before the daemon had bound its socket,
and every gateway exited at once ("socket file ... does not exist") although its config allowed
90 s for the daemon to answer.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import pytest

from kvsched.daemon.process import DaemonProcess
from kvsched.gateway.local_fleet import write_tiny_tokenizer

pytestmark = pytest.mark.timeout(120)


def _gateway(tmp_path, endpoint: str, connect_timeout_s: float) -> tuple[subprocess.Popen, object]:
    tok = write_tiny_tokenizer(tmp_path / "tok")
    cfg = tmp_path / "gateway.toml"
    cfg.write_text(
        f'[gateway]\nport = 0\ndaemon_endpoint = "{endpoint}"\nconnect_timeout_s = {connect_timeout_s}\n\n'
        f'[[models]]\nname = "tiny"\ntokenizer_dir = "{tok}"\n'
    )
    ready = tmp_path / "gateway.port"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvsched.gateway",
            "--config",
            str(cfg),
            "--ready-file",
            str(ready),
            "--log-level",
            "INFO",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, ready


def test_gateway_started_before_its_daemon_waits_and_then_serves(tmp_path):
    instance = f"gws-{uuid.uuid4().hex[:8]}"
    run = tmp_path / "run"
    run.mkdir()
    endpoint = f"ipc://{run}/{instance}.sock"
    proc, ready = _gateway(tmp_path, endpoint, 60)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    daemon = None
    try:
        # The daemon starts only once the gateway has found no socket and said it waits (a fixed
        # 3 s sleep was once shorter than the gateway's own start on a loaded machine).
        deadline = time.monotonic() + 60
        while not any("waiting up to 60.0s for the daemon" in line for line in lines):
            assert proc.poll() is None, f"gateway exited without waiting: {''.join(lines)[-2000:]}"
            assert time.monotonic() < deadline, f"the gateway never said it waits: {''.join(lines)[-2000:]}"
            time.sleep(0.05)
        daemon = DaemonProcess.start(None, instance=instance, runtime_dir=run)
        deadline = time.monotonic() + 60
        while not (ready.exists() and ready.read_text().strip()):
            assert proc.poll() is None, "".join(lines)[-2000:]
            assert time.monotonic() < deadline, "gateway did not listen after the daemon came up"
            time.sleep(0.1)
        port = int(ready.read_text())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            assert r.status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        reader.join(timeout=30)
        if daemon is not None:
            daemon.stop()


def test_gateway_without_a_daemon_exits_3_after_its_connect_timeout_naming_the_socket(tmp_path):
    endpoint = f"ipc://{tmp_path}/absent.sock"
    t0 = time.monotonic()
    proc, _ = _gateway(tmp_path, endpoint, 2)
    out = proc.communicate(timeout=60)[0]
    elapsed = time.monotonic() - t0
    assert proc.returncode == 3, out
    assert "absent.sock does not exist" in out
    assert elapsed >= 2.0  # it waited for the daemon first


@pytest.mark.parametrize("configured, env", [("tcp://foo", None), ("", "tcp://foo")])
def test_malformed_daemon_endpoint_exits_2_with_a_message_not_a_traceback(tmp_path, configured, env):
    """`daemon_endpoint = "tcp://foo"` (no port) in the file, or the same in KVSCHED_ENDPOINT with the
    file's endpoint empty: exit 2 (bad config, docs/GATEWAY.md) naming the endpoint, no traceback."""
    import os

    tok = write_tiny_tokenizer(tmp_path / "tok")
    cfg = tmp_path / "gateway.toml"
    cfg.write_text(
        f'[gateway]\nport = 0\ndaemon_endpoint = "{configured}"\n\n[[models]]\nname = "tiny"\ntokenizer_dir = "{tok}"\n'
    )
    environ = {k: v for k, v in os.environ.items() if k != "KVSCHED_ENDPOINT"}
    if env is not None:
        environ["KVSCHED_ENDPOINT"] = env
    proc = subprocess.run(
        [sys.executable, "-m", "kvsched.gateway", "--config", str(cfg)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "'tcp://foo'" in proc.stderr and "HOST:PORT" in proc.stderr, proc.stderr
    if configured:
        assert "daemon_endpoint" in proc.stderr, proc.stderr
