"""A failed start never hangs: the config check catches bad endpoints, and a start that fails later
logs its cause, closes every socket and exits non-zero within seconds, leaving no segment behind."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import unique_instance

pytestmark = pytest.mark.timeout(180)

NO_PORT = """
[[workers]]
worker_id = 1
kv_events_endpoint = "tcp://127.0.0.1"
"""


def _check(tmp_path: Path, text: str) -> subprocess.CompletedProcess:
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "kvsched.daemon.app", "--check-config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "text, needle",
    [
        (NO_PORT, "kv_events_endpoint"),
        ('[[workers]]\nworker_id = 1\nkv_replay_endpoint = "tcp://127.0.0.1:99999"\n', "kv_replay_endpoint"),
        ('[daemon]\nendpoint = "tcp://0.0.0.0:5555"\n', "curve_secret_key_file"),
        ('[daemon]\nadmin_endpoint = "udp://x"\n', "admin_endpoint"),
    ],
)
def test_check_config_rejects_bad_endpoints_and_the_curve_rule(tmp_path, text, needle):
    """`--check-config` exits 2 naming the key for an endpoint without port, a port out of range, a
    non-loopback TCP endpoint without CURVE keys, an unknown transport."""
    got = _check(tmp_path, text)
    assert got.returncode == 2, got
    assert needle in got.stderr


@pytest.mark.parametrize(
    "text, needle",
    [
        ('[daemon]\nendpoint = "ipc:///tmp/kvs-same.sock"\nadmin_endpoint = "ipc:///tmp/kvs-same.sock"\n', "the same"),
        ('[daemon]\nendpoint = "tcp://127.0.0.1:5555"\nadmin_endpoint = "tcp://127.0.0.1:5555"\n', "the same"),
        ('[daemon]\nendpoint = "tcp://127.0.0.1:9464"\nmetrics_port = 9464\n', "metrics_port"),
        (f'[daemon]\nendpoint = "ipc:///tmp/{"x" * 120}.sock"\n', "at most 107"),
    ],
)
def test_check_config_rejects_endpoints_a_start_cannot_bind(tmp_path, text, needle):
    """Found from outside: `--check-config` said ok, then the start failed: data and admin on one
    address, an endpoint on the metrics port, an ipc path longer than a Unix socket address holds."""
    got = _check(tmp_path, text)
    assert got.returncode == 2, got
    assert needle in got.stderr, got.stderr


def test_check_config_accepts_good_endpoints(tmp_path):
    got = _check(
        tmp_path,
        '[daemon]\nendpoint = "tcp://127.0.0.1:5555"\n[[workers]]\nworker_id = 1\n'
        'kv_events_endpoint = "tcp://10.0.0.5:5557"\nkv_replay_endpoint = "tcp://[::1]:5558"\n',
    )
    assert got.returncode == 0, got.stderr


@pytest.mark.parametrize("host", ["999.1.1.1", "::1"])
def test_check_config_rejects_a_metrics_host_the_daemon_cannot_listen_on(tmp_path, host):
    """Found from outside: `KVSCHED_DAEMON_METRICS_HOST=999.1.1.1 kvsched-daemon --check-config` said
    ok and the start then failed "cannot listen: Name or service not known" (an IPv6 address fails
    the same way: the metrics server listens on IPv4). Result: exit 2 naming daemon.metrics_host."""
    got = _check(tmp_path, f'[daemon]\nmetrics_port = 9464\nmetrics_host = "{host}"\n')
    assert got.returncode == 2, got
    assert "daemon.metrics_host" in got.stderr and host in got.stderr


def test_check_config_accepts_resolvable_metrics_hosts_and_ignores_the_host_without_a_port(tmp_path):
    for text in (
        '[daemon]\nmetrics_port = 9464\nmetrics_host = "localhost"\n',
        '[daemon]\nmetrics_port = 9464\nmetrics_host = "0.0.0.0"\n',
        '[daemon]\nmetrics_host = "999.1.1.1"\n',
    ):  # metrics_port 0: no metrics server
        got = _check(tmp_path, text)
        assert got.returncode == 0, (text, got.stderr)


def _start(tmp_path: Path, text: str, instance: str) -> tuple[subprocess.Popen, Path]:
    cfg = tmp_path / "d.toml"
    cfg.write_text(text)
    log = tmp_path / "d.log"
    argv = [
        sys.executable,
        "-m",
        "kvsched.daemon.app",
        "--config",
        str(cfg),
        "--instance",
        instance,
        "--endpoint",
        f"ipc://{tmp_path}/d.sock",
        "--admin-endpoint",
        f"ipc://{tmp_path}/a.sock",
    ]
    with open(log, "wb") as fh:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=fh), log


def _segments(instance: str) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob(f"kvsched-{instance}-*") if not p.name.endswith(".lock")]


@pytest.mark.parametrize("case", ["kv_events_no_port", "metrics_port_in_use"])
def test_failed_start_exits_non_zero_with_its_cause_and_leaves_nothing(tmp_path, case):
    """1. start a daemon whose start fails (a KV-event endpoint without port / a metrics port in use).
    Result: it exits non-zero within 90 s (kernel warm-up included), the log names the cause, no
    segment is left in /dev/shm and the socket files are gone."""
    instance = unique_instance("bad")
    holder = None
    if case == "kv_events_no_port":
        text, needle = NO_PORT, "kv_events_endpoint"
    else:
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        text, needle = f"[daemon]\nmetrics_port = {holder.getsockname()[1]}\n", "Address already in use"
    proc, log = _start(tmp_path, text, instance)
    try:
        code = proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the daemon hung after a failed start; log:\n{log.read_text()[-2000:]}")
    finally:
        if holder is not None:
            holder.close()
    assert code != 0
    assert needle in log.read_text()
    assert _segments(instance) == []
    assert not (tmp_path / "d.sock").exists() and not (tmp_path / "a.sock").exists()


def test_sigterm_during_start_stops_cleanly(tmp_path):
    """1. start a daemon, 2. SIGTERM it right away (while it warms its kernels).
    Result: it exits (signal handled, not killed by the default action) and leaves no segment."""
    instance = unique_instance("term")
    proc, log = _start(tmp_path, "", instance)
    deadline = time.monotonic() + 60
    while "starting instance" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.terminate()
    try:
        code = proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("the daemon did not stop after SIGTERM during start")
    assert code == 0, log.read_text()[-2000:]
    assert _segments(instance) == []


def test_configured_endpoints_win_over_the_discovery_variables_and_the_log_says_where_each_came_from(tmp_path):
    """1. a config naming its data and admin endpoints, started with KVSCHED_ENDPOINT and
    KVSCHED_ADMIN_ENDPOINT exported to other paths (the README exports the admin one for the CLI).
    Result: the daemon binds the configured paths, not the variables' (was: the variables won,
    silently), and logs `data_from=config file admin_from=config file`; without configured endpoints
    it binds the variables' paths and logs their names."""
    import os

    instance = unique_instance("env")
    cfg = tmp_path / "d.toml"
    env = {
        **os.environ,
        "KVSCHED_ENDPOINT": f"ipc://{tmp_path}/env-d.sock",
        "KVSCHED_ADMIN_ENDPOINT": f"ipc://{tmp_path}/env-a.sock",
    }
    for configured in (True, False):
        text = (
            f'[daemon]\nendpoint = "ipc://{tmp_path}/cfg-d.sock"\nadmin_endpoint = "ipc://{tmp_path}/cfg-a.sock"\n'
            if configured
            else ""
        )
        cfg.write_text(text + "[[workers]]\nworker_id = 0\n")
        log = tmp_path / f"d-{configured}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvsched.daemon.app", "--config", str(cfg), "--instance", instance],
                stdout=subprocess.DEVNULL,
                stderr=fh,
                env=env,
            )
        try:
            deadline = time.monotonic() + 120
            while "ready endpoint" not in log.read_text():
                assert proc.poll() is None, log.read_text()[-2000:]
                assert time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.1)
            text = log.read_text()
            want, other = ("cfg", "env") if configured else ("env", "cfg")
            assert (tmp_path / f"{want}-d.sock").exists() and (tmp_path / f"{want}-a.sock").exists(), text
            assert not (tmp_path / f"{other}-d.sock").exists() and not (tmp_path / f"{other}-a.sock").exists(), text
            if configured:
                assert "data_from=config file" in text and "admin_from=config file" in text, text
            else:
                assert "data_from=KVSCHED_ENDPOINT" in text and "admin_from=KVSCHED_ADMIN_ENDPOINT" in text, text
        finally:
            proc.terminate()
            proc.wait(60)
