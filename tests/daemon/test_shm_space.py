"""A too-small /dev/shm is a start error naming the sizes, never a SIGBUS under load.

Each test runs a real daemon process in its own mount namespace (`unshare -m`) over a small tmpfs
mounted at /dev/shm — what a container gets by default (Docker: 64 MiB) — so it needs root and
util-linux `unshare`; it is skipped otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import unique_instance

pytestmark = pytest.mark.timeout(180)


def _can_mount_private_tmpfs() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


needs_namespace = pytest.mark.skipif(
    not _can_mount_private_tmpfs(), reason="needs root and unshare -m to mount a private tmpfs on /dev/shm"
)


def _in_small_shm(size_mb: int, argv: list[str], timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Run argv in a new mount namespace whose /dev/shm is a fresh `size_mb` MiB tmpfs."""
    script = f'mount -t tmpfs -o size={size_mb}m tmpfs /dev/shm && exec "$@"'
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=os.environ.copy(),
    )


@needs_namespace
def test_daemon_refuses_to_start_when_dev_shm_is_too_small(tmp_path):
    """Default capacities (8,192 slots x 1,024 blocks, 64 workers) need ~340 MiB of segments; a 64 MiB
    /dev/shm (Docker's default) must fail the start at once, exit non-zero, never print READY, and name
    the needed and available sizes and the container fix. The old daemon reported READY here and died
    with SIGBUS once ~7,200 leases had touched the ledger's pages."""
    inst = unique_instance("shm")
    argv = [
        sys.executable,
        "-m",
        "kvsched.daemon.app",
        "--instance",
        inst,
        "--workers",
        "2",
        "--endpoint",
        f"ipc://{tmp_path}/d.sock",
        "--admin-endpoint",
        f"ipc://{tmp_path}/a.sock",
    ]
    script = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"'
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err_fh:
        proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *argv],
            stdout=subprocess.PIPE,
            stderr=err_fh,
            text=True,
            env=os.environ.copy(),
        )
        try:
            first_line = proc.stdout.readline()  # READY line, or "" when it exits
            ready = first_line.startswith("KVSCHED_READY")
            if ready:
                proc.kill()
            code = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
    err = err_path.read_text()
    assert not ready, "the daemon reported READY with a 64 MiB /dev/shm: " + err[-2000:]
    assert code != 0, err
    assert "not enough shared memory in /dev/shm" in err, err
    m = re.search(r"need [0-9.]+ MiB \((\d+) bytes\), [0-9.]+ MiB \((\d+) bytes\) available", err)
    assert m, err
    needed, available = int(m.group(1)), int(m.group(2))
    assert available <= 64 << 20 < needed, (needed, available)
    assert "--shm-size=" in err, err


DRIVER = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from kvsched.daemon.process import DaemonProcess

    cfg_path, inst, rundir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    st = os.statvfs("/dev/shm")
    free_before = st.f_bavail * st.f_frsize
    d = DaemonProcess.start(cfg_path, instance=inst, runtime_dir=rundir)
    st = os.statvfs("/dev/shm")
    used = free_before - st.f_bavail * st.f_frsize
    names = [n for n in os.listdir("/dev/shm") if n.startswith(f"kvsched-{inst}-") and not n.endswith(".lock")]
    sizes = {n: os.stat(f"/dev/shm/{n}").st_size for n in names}
    files = {n: os.stat(f"/dev/shm/{n}").st_blocks * 512 for n in names}
    code = d.stop()
    print(json.dumps({"used": used, "sizes": sizes, "allocated": files, "stop_code": code}))
""")


@needs_namespace
def test_daemon_reserves_every_segment_page_at_start(tmp_path):
    """With capacities that fit (256 slots x 64 blocks), the daemon starts in a 32 MiB /dev/shm and
    every page of its segments is allocated before READY (blocks allocated == file size), so no
    later first write can hit a full tmpfs. The old daemon left the ledger sparse (pages allocated
    on first write)."""
    inst = unique_instance("shm")
    cfg = tmp_path / "small.toml"
    cfg.write_text(
        "[daemon]\nmax_slots = 256\nmax_blocks_per_request = 64\nmax_workers = 4\n\n[[workers]]\nworker_id = 1\n"
    )
    res = _in_small_shm(32, [sys.executable, "-c", DRIVER, str(cfg), inst, str(tmp_path)])
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert {f"kvsched-{inst}-ledger", f"kvsched-{inst}-progress"} <= set(out["sizes"]), out
    for name, size in out["sizes"].items():
        assert out["allocated"][name] >= size, (name, out)
    assert out["used"] >= sum(out["sizes"].values()), out
