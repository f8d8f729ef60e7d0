"""One daemon per instance; purge refuses a running instance; a failed start leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvsched.daemon.process import DaemonProcess
from kvsched.errors import DaemonUnavailable
from tests.conftest import free_port, purge, unique_instance

pytestmark = pytest.mark.timeout(60)


def _daemon_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvsched.daemon.app", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ.copy(),
    )


def test_second_daemon_with_same_instance_is_refused_and_first_keeps_serving(tmp_path):
    instance = unique_instance()
    first = DaemonProcess.start(None, instance=instance, runtime_dir=tmp_path / "a", extra_args=["--workers", "1"])
    try:
        with pytest.raises(DaemonUnavailable, match="already running"):
            DaemonProcess.start(
                None, instance=instance, runtime_dir=tmp_path / "b", extra_args=["--workers", "1"], ready_timeout_s=20
            )
        # same endpoint, another instance: refused, the first daemon's socket file survives
        with pytest.raises(DaemonUnavailable, match="in use"):
            DaemonProcess.start(
                None,
                instance=unique_instance(),
                runtime_dir=tmp_path / "a",
                extra_args=[
                    "--workers",
                    "1",
                    "--endpoint",
                    first.endpoint,
                    "--admin-endpoint",
                    f"ipc://{tmp_path}/other-admin.sock",
                ],
                ready_timeout_s=20,
            )
        assert os.path.exists(first.endpoint[len("ipc://") :])
        refused = _daemon_cli("--purge", "--instance", instance)
        assert refused.returncode == 1 and "already running" in refused.stderr
        assert os.path.exists(f"/dev/shm/kvsched-{instance}-ledger")
        assert first.alive()
    finally:
        first.stop()
        purge(instance)
    assert "nothing to purge" in _daemon_cli("--purge", "--instance", instance).stdout


def test_failed_start_leaves_no_segments_behind(tmp_path):
    instance = unique_instance()
    with pytest.raises(DaemonUnavailable, match="CURVE"):
        DaemonProcess.start(
            None,
            instance=instance,
            runtime_dir=tmp_path,
            ready_timeout_s=20,
            extra_args=["--workers", "1", "--endpoint", f"tcp://0.0.0.0:{free_port()}"],
        )
    assert not os.path.exists(f"/dev/shm/kvsched-{instance}-ledger")
    assert not os.path.exists(f"/dev/shm/kvsched-{instance}-progress")
    assert not os.path.exists(f"/dev/shm/kvsched-{instance}.lock")


def _shm_files(instance: str) -> list[str]:
    return sorted(
        n for n in os.listdir("/dev/shm") if n.startswith(f"kvsched-{instance}-") or n == f"kvsched-{instance}.lock"
    )


def test_purge_after_a_sigkill_removes_the_segments_and_the_lock_file(tmp_path):
    instance = unique_instance()
    d = DaemonProcess.start(None, instance=instance, runtime_dir=tmp_path, extra_args=["--workers", "1"])
    d.kill()
    assert f"kvsched-{instance}.lock" in _shm_files(instance)
    out = _daemon_cli("--purge", "--instance", instance)
    assert out.returncode == 0 and "purged" in out.stdout, out.stderr
    assert _shm_files(instance) == []


def test_purge_after_a_sigkill_removes_the_socket_files_left_in_the_discovery_directory(tmp_path):
    """1. a daemon started with no endpoint given binds ipc sockets in the discovery directory
    ($XDG_RUNTIME_DIR/kvsched here), 2. SIGKILL: its socket files stay, 3. `kvsched-daemon --purge
    --instance X`. Result: the segments, the lock file and both socket files are gone (before: the
    socket files stayed, and a CLI call then waited out its timeout instead of saying at once that
    no daemon runs)."""
    from kvsched.endpoints import SYSTEM_RUNTIME_DIR

    if SYSTEM_RUNTIME_DIR.is_dir():
        pytest.skip(f"{SYSTEM_RUNTIME_DIR} exists: discovery would use it, not a private directory")
    instance = unique_instance()
    env = {k: v for k, v in os.environ.items() if k not in ("KVSCHED_ENDPOINT", "KVSCHED_ADMIN_ENDPOINT")}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)
    sockets = [tmp_path / "kvsched" / f"{instance}.sock", tmp_path / "kvsched" / f"{instance}-admin.sock"]
    argv = [sys.executable, "-m", "kvsched.daemon.app", "--instance", instance, "--workers", "1"]
    log_path = tmp_path / "daemon.log"
    with open(log_path, "ab") as log_fh:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log_fh, stdin=subprocess.DEVNULL, env=env)
    d = DaemonProcess(proc, f"ipc://{sockets[0]}", f"ipc://{sockets[1]}", log_path, argv, env)
    try:
        d.wait_ready(60)
        d.kill()
        assert all(path.exists() for path in sockets)
        out = subprocess.run(
            [sys.executable, "-m", "kvsched.daemon.app", "--purge", "--instance", instance],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert out.returncode == 0 and str(sockets[0]) in out.stdout, out.stdout + out.stderr
        assert [path for path in sockets if path.exists()] == []
        assert _shm_files(instance) == []
    finally:
        d.kill()
        purge(instance)


def test_purge_never_removes_a_live_daemons_socket_files(tmp_path):
    """A daemon runs. `--purge` of its instance (its endpoints named) is refused by the instance lock;
    `--purge` of another instance whose endpoints name the same socket paths finds them listened on,
    and a regular file at an endpoint path is not a socket: all stay, and the daemon keeps answering."""
    from kvsched import protocol as p
    from tests.conftest import admin_call

    instance = unique_instance()
    d = DaemonProcess.start(None, instance=instance, runtime_dir=tmp_path, extra_args=["--workers", "1"])
    files = [d.endpoint[len("ipc://") :], d.admin_endpoint[len("ipc://") :]]
    plain = tmp_path / "not-a-socket.sock"
    plain.write_text("x")
    try:
        refused = _daemon_cli(
            "--purge", "--instance", instance, "--endpoint", d.endpoint, "--admin-endpoint", d.admin_endpoint
        )
        assert refused.returncode == 1 and "already running" in refused.stderr
        other = _daemon_cli(
            "--purge", "--instance", unique_instance(), "--endpoint", d.endpoint, "--admin-endpoint", f"ipc://{plain}"
        )
        assert other.returncode == 0 and "nothing to purge" in other.stdout, other.stdout + other.stderr
        assert all(os.path.exists(f) for f in files) and plain.read_text() == "x"
        assert isinstance(admin_call(d, p.Status()), p.StatusReply)
    finally:
        d.stop()
        purge(instance)


def test_gateway_demo_fleet_stopped_after_its_daemon_was_killed_leaves_nothing_in_dev_shm(tmp_path):
    """`make gateway-demo`, its daemon SIGKILLed, then Ctrl-C (LocalFleet.stop). Was: the lock file
    `kvsched-gw-<random>.lock` stayed, one more per demo run."""
    from kvsched.gateway.local_fleet import LocalFleet

    fleet = LocalFleet.start(tmp_path / "demo", n_engines=0, n_gateways=0)
    instance = fleet.instance
    fleet.daemon.kill()
    assert f"kvsched-{instance}.lock" in _shm_files(instance)
    fleet.stop()
    assert _shm_files(instance) == []


def test_a_lock_file_unlinked_between_open_and_flock_is_not_the_one_kept(monkeypatch):
    """The open / flock / inode-check sequence: when the holder removes the lock file between a new
    locker's open and its flock (fault injected into flock), the locker must end up holding the
    path's new file, not the unlinked one (else a third process could lock the new file too, and
    two daemons would run)."""
    import fcntl

    from kvsched.daemon.instance_lock import InstanceLock, lock_path

    instance = unique_instance()
    path = lock_path(instance)
    real_flock = fcntl.flock
    calls = []

    def flock(fd, op):
        if not calls:
            os.unlink(path)  # the previous holder's release(), right between our open and flock
        calls.append(fd)
        return real_flock(fd, op)

    path.touch()
    monkeypatch.setattr(fcntl, "flock", flock)
    lock = InstanceLock(instance)
    monkeypatch.undo()
    try:
        assert len(calls) == 2
        assert os.fstat(lock._fd).st_ino == os.stat(path).st_ino
    finally:
        lock.release()
    assert not path.exists()


def test_a_daemon_that_exits_during_start_is_reported_with_its_exit_code_not_as_a_timeout(tmp_path):
    """Its stdout closes as it exits: the wait must report the exit (and its code), never 'not ready'."""
    env = dict(os.environ, KVSCHED_DAEMON_MAX_WORKERS="0")  # invalid: the daemon refuses its config, exit 2
    for k in range(3):
        with pytest.raises(DaemonUnavailable, match="exited with code 2") as err:
            DaemonProcess.start(
                None,
                instance=unique_instance(),
                runtime_dir=tmp_path / str(k),
                env=env,
                extra_args=["--workers", "1"],
                ready_timeout_s=60,
            )
        assert "max_workers" in str(err.value)


def test_a_restart_with_other_capacities_says_what_to_do(tmp_path):
    """Found from outside: restarting a crashed instance with another `max_slots` was refused with
    "kvsched-X-ledger: max_slots=256 in the segment, expected 4" and nothing about what to do.
    Result: the refusal also says to start with the segment's values or `--purge` (dropping the
    leases they hold), naming the instance."""
    instance = unique_instance()
    d = DaemonProcess.start(None, instance=instance, runtime_dir=tmp_path, extra_args=["--workers", "1"])
    d.kill()
    cfg = tmp_path / "slots.toml"
    cfg.write_text("[daemon]\nmax_slots = 4\n")
    try:
        out = _daemon_cli(
            "--config",
            str(cfg),
            "--instance",
            instance,
            "--workers",
            "1",
            "--endpoint",
            f"ipc://{tmp_path}/x.sock",
            "--admin-endpoint",
            f"ipc://{tmp_path}/x-admin.sock",
        )
        assert out.returncode == 1, out.stderr
        assert "max_slots" in out.stderr and f"--instance {instance} --purge" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    finally:
        purge(instance)
