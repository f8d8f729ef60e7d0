"""Soak: many lifecycles with random cancels, requeues, aborts and router SIGKILLs against one daemon.

Reports the daemon's RSS at start and end, lifecycles/s, and leaked slots / ledger residue after the
last router is gone and the liveness timeout has passed (both must be 0). Writes out/bench/soak.json.

    .venv/bin/python bench/soak.py --lifecycles 1000000 --routers 4
    .venv/bin/python bench/soak.py --lifecycles 20000          # a quick run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import tempfile
import time
from pathlib import Path

CONFIG = """
[daemon]
block_size = 16
liveness_timeout_ms = 1000
heartbeat_ms = 200
max_slots = 4096

[[workers]]
worker_id = 0
dp_size = 4
max_num_batched_tokens = 8192
"""


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def router(endpoint: str, tag: str, quota: int, counter) -> None:
    """One router process: `quota` lifecycles with a random fate each; adds to `counter` every 100."""
    import asyncio

    import uvloop

    from kvsched.client import SchedulerClient
    from kvsched.errors import RequestRejected

    async def main() -> None:
        rng = random.Random(tag)
        async with SchedulerClient(endpoint, client_name=tag) as client:
            sem = asyncio.Semaphore(32)
            done = 0

            async def one(i: int) -> None:
                nonlocal done
                async with sem:
                    rid = f"{tag}-{i}"
                    fate = rng.random()
                    try:
                        if fate < 0.05:  # cancel while (maybe) waiting
                            task = asyncio.create_task(client.schedule(rid, isl_tokens=rng.randint(16, 4000)))
                            await asyncio.sleep(0)
                            task.cancel()
                            try:
                                lease = await task
                                lease.release("aborted")
                            except asyncio.CancelledError:
                                pass
                        else:
                            lease = await client.schedule(
                                rid, isl_tokens=rng.randint(16, 4000), block_hashes=[rng.randrange(64), i]
                            )
                            if fate < 0.10:
                                lease = await lease.requeue()
                            lease.dispatched()
                            lease.prefill_done()
                            lease.add_output_tokens(rng.randint(1, 200))
                            lease.release("aborted" if fate < 0.15 else "completed")
                    except RequestRejected:
                        pass
                    done += 1
                    if done % 100 == 0:
                        with counter.get_lock():
                            counter.value += 100

            await asyncio.gather(*(one(i) for i in range(quota)))

    uvloop.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lifecycles", type=int, default=1_000_000)
    ap.add_argument("--routers", type=int, default=4)
    ap.add_argument("--kill-every-s", type=float, default=10.0, help="SIGKILL one router this often")
    ap.add_argument("--out", default="out/bench/soak.json")
    args = ap.parse_args()

    from kvsched import protocol as p
    from kvsched.client import AdminClient
    from kvsched.daemon.process import DaemonProcess
    from kvsched.shm.segments import unlink_segments

    tmp = Path(tempfile.mkdtemp(prefix="kvsched-soak-"))
    (tmp / "soak.toml").write_text(CONFIG)
    instance = f"soak-{os.getpid()}"
    daemon = DaemonProcess.start(tmp / "soak.toml", instance=instance, runtime_dir=tmp)
    rss_start = rss_kib(daemon.pid)
    ctx = mp.get_context("spawn")
    counter = ctx.Value("q", 0)
    per_router = 2000  # lifecycles per router process before it is replaced
    started = 0
    procs: list = []
    kills = 0
    t0 = time.monotonic()
    next_kill = t0 + args.kill_every_s
    try:
        while True:
            procs = [pr for pr in procs if pr.is_alive()]
            while len(procs) < args.routers and started < args.lifecycles:
                quota = min(per_router, args.lifecycles - started)
                pr = ctx.Process(target=router, args=(daemon.endpoint, f"r{started}", quota, counter))
                pr.start()
                procs.append(pr)
                started += quota
            if not procs:
                break
            if time.monotonic() >= next_kill and procs:
                victim = random.choice(procs)
                os.kill(victim.pid, signal.SIGKILL)
                kills += 1
                next_kill = time.monotonic() + args.kill_every_s
            time.sleep(0.2)
            done = counter.value
            print(
                f"\r{done:,}/{args.lifecycles:,} lifecycles  {done / (time.monotonic() - t0):,.0f}/s  kills={kills}",
                end="",
                flush=True,
            )
        wall = time.monotonic() - t0
        time.sleep(2.5)  # liveness timeout (1 s) + reaper period
        with AdminClient(daemon.admin_endpoint) as admin:
            status = admin.call(p.Status())
            workers = admin.call(p.Workers()).workers
        rss_end = rss_kib(daemon.pid)
    finally:
        for pr in procs:
            pr.kill()
        daemon.stop()
        unlink_segments(instance)
    residue = sum(w.active_blocks + w.active_prefill_tokens + w.active_requests for w in workers)
    result = {
        "lifecycles_started": started,
        "lifecycles_counted": counter.value,
        "router_kills": kills,
        "wall_s": round(wall, 1),
        "lifecycles_per_s": round(counter.value / wall, 1),
        "decisions_total": status.decisions_total,
        "rss_start_kib": rss_start,
        "rss_end_kib": rss_end,
        "leaked_slots": status.active_leases,
        "queued_left": status.queued,
        "ledger_residue": residue,
    }
    print()
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
