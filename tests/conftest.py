"""Shared fixtures: a NUMBA cache shared by every test process, a running daemon, wait_until."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("NUMBA_CACHE_DIR", str(ROOT / ".numba-cache"))


def pytest_sessionstart(session) -> None:
    """Compile every kernel into the shared NUMBA_CACHE_DIR once, before any test: on a fresh clone
    the first daemon a test starts would otherwise compile them inside its ready timeout (~50 s on a
    2-core machine with a cold cache); with the cache filled it loads them in a few seconds."""
    from kvsched.shm.warm import warm_kernels

    t0 = time.monotonic()
    warm_kernels()
    _warm_core_decisions()
    took = time.monotonic() - t0
    if took > 5:
        print(f"\nkernels compiled into {os.environ['NUMBA_CACHE_DIR']} in {took:.0f} s")


def _warm_core_decisions() -> None:
    """Two decisions through the core tests' own factories, so the fused admission kernel compiles
    for their argument types here rather than inside the first core test: cold, on a loaded 2-core
    machine, that compile outlasted the 120 s per-test timeout, and every following core test timed
    out in turn (each one restarting the interrupted compile). A warm-up only: any error here is
    left for the tests themselves to report."""
    try:
        from tests.core.factories import make_request, make_scheduler

        s = make_scheduler()
        s.enqueue(make_request("warm-plain", isl_tokens=10), 1)
        s.enqueue(make_request("warm-hashed", isl_tokens=64, block_hashes=[1, 2, 3]), 1)
    except Exception:
        pass


def wait_until(pred: Callable[[], bool], timeout_s: float = 30.0, interval_s: float = 0.02) -> bool:
    """Poll `pred` until it is true; returns False at timeout (assert on the result). The default
    deadline is generous on purpose: a loaded 2-core CI machine can be seconds late."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval_s)
    return bool(pred())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unique_instance(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def start_daemon(tmp_path: Path, config_text: str = "", *, instance: str | None = None, extra_args=()):
    """Start a real `kvsched-daemon` child with private ipc sockets under `tmp_path`."""
    from kvsched.daemon.process import DaemonProcess

    instance = instance or unique_instance()
    cfg = None
    if config_text:
        cfg = write_config(tmp_path / f"{instance}.toml", config_text)
    return DaemonProcess.start(cfg, instance=instance, runtime_dir=tmp_path, extra_args=list(extra_args))


# The fixtures that start (or share) a daemon process: a test using one is marked `multiprocess`.
_DAEMON_FIXTURES = {"session_daemon"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `multiprocess` every test that uses a daemon fixture (`make test-fast` leaves them out);
    a test that starts another process itself carries the mark explicitly."""
    for item in items:
        if _DAEMON_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.multiprocess)


def daemon_fixture(config_text: str, name: str = "daemon"):
    """A function-scoped pytest fixture `name`: a daemon from `config_text`, stopped and purged
    afterwards. Use as `daemon = daemon_fixture(CONFIG)` at module level."""
    _DAEMON_FIXTURES.add(name)

    @pytest.fixture(name=name)
    def daemon(tmp_path):
        d = start_daemon(tmp_path, config_text)
        yield d
        d.stop()
        purge(d.instance)

    return daemon


async def kill_and_wait_for_disconnect(d, client, timeout_s: float = 10.0) -> None:
    """SIGKILL the daemon handle `d` and wait until `client` (a SchedulerClient) sees its link down."""
    import asyncio

    await asyncio.to_thread(d.kill)
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while client.connected and loop.time() < end:
        await asyncio.sleep(0.05)
    assert not client.connected


def admin_call(d, request):
    """One admin request to the daemon handle `d` (blocking); returns its reply frame."""
    from kvsched.client import AdminClient

    with AdminClient(d.admin_endpoint) as admin:
        return admin.call(request)


def purge(instance: str) -> None:
    """Remove a stopped test daemon's segments and lock file (segments only if it still runs)."""
    from kvsched.daemon.instance_lock import purge_instance
    from kvsched.errors import ConfigError
    from kvsched.shm.segments import unlink_segments

    try:
        purge_instance(instance)
    except ConfigError:
        unlink_segments(instance)


def running_instance(instance: str) -> bool:
    """True while a process started with `--instance <instance>` runs (a daemon a test started)."""
    import subprocess

    return subprocess.run(["pgrep", "-f", "--", f"--instance {instance}( |$)"], capture_output=True).returncode == 0


def kill_instance(instance: str) -> None:
    """SIGKILL the daemon of `instance` if it still runs and remove what it leaves (after a failed test)."""
    import subprocess
    import time

    from kvsched.daemon.instance_lock import purge_instance
    from kvsched.errors import ConfigError

    subprocess.run(["pkill", "-KILL", "-f", "--", f"--instance {instance}( |$)"], check=False)
    deadline = time.monotonic() + 10
    while True:  # its lock is free once the killed process is gone for good, a moment after pgrep stops seeing it
        try:
            purge_instance(instance)
            return
        except ConfigError:
            if time.monotonic() > deadline:
                purge(instance)
                return
            time.sleep(0.1)


TWO_WORKERS = """
[daemon]
block_size = 16
liveness_timeout_ms = 1500
heartbeat_ms = 200

[[workers]]
worker_id = 1
total_kv_blocks = 1000
max_num_batched_tokens = 1000

[[workers]]
worker_id = 2
total_kv_blocks = 1000
max_num_batched_tokens = 1000

[[classes]]
name = "default"
prefill_busy_threshold = 1000
"""


@pytest.fixture(scope="session")
def session_daemon(tmp_path_factory):
    """One daemon for the read-mostly tests of a session (two workers, busy at 1000 prefill tokens)."""
    tmp = tmp_path_factory.mktemp("daemon")
    d = start_daemon(tmp, TWO_WORKERS)
    yield d
    d.stop()
    purge(d.instance)


class RawPeer:
    """A bare DEALER on a daemon socket for protocol-level tests: `send(frame_or_obj)`, `recv()`
    (decoded daemon frame, or None after `timeout_s`, 30 s unless given; the frames of a version-2 `Replies` message
    come one per call, `messages` counts the messages), `hello(...)` (asserts the Welcome)."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        from kvsched import protocol as p

        self.p = p
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.enc, self.dec = p.make_encoder(), p.make_daemon_decoder()
        self.inner_dec = p.make_replied_daemon_decoder()
        self.unread: list = []
        self.messages = 0

    def send(self, frame) -> None:
        self.sock.send(frame if isinstance(frame, bytes) else self.enc.encode(frame))

    def recv(self, timeout_s: float = 30.0):
        if self.unread:
            return self.unread.pop(0)
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        self.messages += 1
        frame = self.dec.decode(self.sock.recv())
        if isinstance(frame, self.p.Replies):
            self.unread = [self.inner_dec.decode(raw) for raw in frame.frames]
            return self.unread.pop(0) if self.unread else None
        return frame

    def hello(
        self, client_name: str = "raw", pid: int = 0, host: str = "elsewhere", version: int | None = None
    ) -> None:
        self.send(self.p.Hello(self.p.PROTOCOL_VERSION if version is None else version, client_name, pid, host))
        assert isinstance(self.recv(), self.p.Welcome)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
