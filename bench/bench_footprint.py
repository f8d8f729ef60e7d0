"""Memory and CPU of `kvsched-daemon` during a replay: the figures behind the resource requests and
limits in deploy/kubernetes/ and docker-compose.yml (docs/DEPLOY.md "Sizing").

Runs `kvsched replay` (which starts its own daemon, a simulated fleet and router processes), finds
the daemon among the replay's descendants in /proc and samples it every 0.25 s: resident memory
(VmRSS, with its shared-memory part RssShmem), peak resident memory (VmHWM) and CPU time
(utime + stime). Linux only.

    python bench/bench_footprint.py                       # bundled Mooncake slice, 4 routers, 4 workers
    python bench/bench_footprint.py --speedup 40 --out out/bench/footprint.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def find_daemon(root: int) -> int | None:
    """The first descendant of `root` whose command line runs the daemon."""
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if pid != root and (b"kvsched.daemon.app" in cmd or b"kvsched-daemon" in cmd):
            return pid
        todo += children(pid)
    return None


def sample(pid: int) -> dict | None:
    """{rss_kib, rss_shmem_kib, hwm_kib, cpu_s} of `pid`, or None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    fields = {
        line.split(":")[0]: line.split()[1]
        for line in status.splitlines()
        if line.startswith(("VmRSS", "VmHWM", "RssShmem"))
    }
    return {
        "rss_kib": int(fields.get("VmRSS", 0)),
        "rss_shmem_kib": int(fields.get("RssShmem", 0)),
        "hwm_kib": int(fields.get("VmHWM", 0)),
        "cpu_s": (int(stat[11]) + int(stat[12])) / TICKS,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(ROOT / "kvsched" / "data" / "mooncake_slice.jsonl"))
    ap.add_argument("--routers", type=int, default=4)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--speedup", type=float, default=20.0)
    ap.add_argument("--out", default=str(ROOT / "out" / "bench" / "footprint.json"))
    args = ap.parse_args()
    kvsched = Path(sys.executable).with_name("kvsched")
    replay_out = Path(args.out).with_suffix("")
    cmd = [
        str(kvsched),
        "replay",
        args.trace,
        "--routers",
        str(args.routers),
        "--workers",
        str(args.workers),
        "--speedup",
        str(args.speedup),
        "--out",
        str(replay_out),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    daemon, samples = None, []
    while proc.poll() is None:
        if daemon is None:
            daemon = find_daemon(proc.pid)
        if daemon is not None:
            s = sample(daemon)
            if s is not None:
                samples.append({"t": time.monotonic(), **s})
        time.sleep(0.25)
    output = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0 or len(samples) < 2:
        raise SystemExit(f"replay failed (rc={proc.returncode}, {len(samples)} samples):\n{output[-2000:]}")
    wall = samples[-1]["t"] - samples[0]["t"]
    cpu = samples[-1]["cpu_s"] - samples[0]["cpu_s"]
    per_s = []  # CPU cores used over each ~1 s window
    for a, b in zip(samples, samples[4:], strict=False):
        per_s.append((b["cpu_s"] - a["cpu_s"]) / max(1e-9, b["t"] - a["t"]))
    result = {
        "command": " ".join(cmd[1:]),
        "samples": len(samples),
        "wall_s": round(wall, 2),
        "rss_peak_mib": round(max(s["hwm_kib"] for s in samples) / 1024, 1),
        "rss_last_mib": round(samples[-1]["rss_kib"] / 1024, 1),
        "rss_shmem_peak_mib": round(max(s["rss_shmem_kib"] for s in samples) / 1024, 1),
        "cpu_mean_cores": round(cpu / max(wall, 1e-9), 3),
        "cpu_peak_1s_cores": round(max(per_s, default=0.0), 3),
        "replay_summary_tail": output.strip().splitlines()[-12:],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "replay_summary_tail"}, indent=2))


if __name__ == "__main__":
    main()
