"""The daemon's frame path in one process: CPU per lifecycle, split into the scheduler core and the rest.

`bench_transport.py` measures the whole daemon process against an echo; on a shared machine its
cells move by ±25 % from run to run, too much to see a change of a few µs in the actor. This bench
takes the processes and the event loop's scheduling out: the real `Actor` (real `Scheduler` from
`create_scheduler`, the transport bench's daemon config: 8 workers, 64 block hashes per request, 16
of them one of 32 shared prefixes) behind a ROUTER on `inproc://`, and one DEALER in the same thread
that sends what a version-2 client sends: `Hello`, then per round a `Batch` of `window` Enqueues,
the daemon's wake (`Actor.data_reader.wake`, called directly), the replies read back, a `Batch` of the
`window` Releases, another wake. Lifecycle = Enqueue → Admitted → Release (dispatched /
prefill_done are shared-memory stores, not frames; they are absent here, so `fold_words` finds
nothing to fold, as in a wake where no router stored anything).

Printed per window: actor CPU µs per lifecycle (thread CPU time inside the two wakes), of which the
core (thread CPU time inside the Scheduler's `enqueue`, `release`, `drain_cleanup`, `fold_words`,
measured by wrapping them; the wrappers' own cost, calibrated on a no-op, is subtracted), and the rest = what the daemon
would cost per lifecycle if the core were free. The 10 ms timer tick (`Ticker.fire`) is called
directly once per 8 lifecycles (its 100 ms and 1 s work on every 10th and 100th call, as at ~800
lifecycles/s) and printed apart: µs per tick, and the part outside the wrapped core calls.

    .venv/bin/python bench/bench_actor.py                       # this tree
    .venv/bin/python bench/bench_actor.py --baseline main        # and `main`'s kvsched/, alternating
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from baseline_trees import add_tree_args, alternate_trees, median

ROOT = Path(__file__).resolve().parents[1]
CORE_METHODS = ("enqueue", "release", "drain_cleanup", "fold_words")
TICK_EVERY_LIFECYCLES = 8  # one 10 ms tick per this many lifecycles (~800 lifecycles/s, window-1 cells)


def measure(windows: list[int], rounds: int, repeats: int) -> dict:
    """Run in a process whose `kvsched` is the tree under test; returns {window: [row per repeat]}."""
    import asyncio

    import uvloop
    import zmq

    try:
        import tomllib
    except ImportError:  # pragma: no cover - Python < 3.11
        import tomli as tomllib

    from kvsched import protocol as p
    from kvsched.config import config_from_dict
    from kvsched.core.create import create_scheduler
    from kvsched.daemon.actor import Actor
    from kvsched.daemon.connections import ConnectionTable
    from kvsched.daemon.metrics import Metrics

    sys.path.append(str(ROOT / "bench"))  # after kvsched is imported: bench_transport puts ROOT first
    from bench_transport import DAEMON_TOML, ISL
    from transport_backends import request_hashes

    cfg = config_from_dict(tomllib.loads(DAEMON_TOML))
    clock = time.thread_time_ns
    d = cfg.daemon

    async def one(window: int) -> dict:
        loop = asyncio.get_running_loop()
        conns = ConnectionTable(d.liveness_timeout_ms * 1000)
        sched = create_scheduler(cfg, owner_alive=conns.owner_alive)
        core_ns = [0, 0]  # thread CPU ns inside the core, wrapped calls

        def wrap(f):
            def timed(*a, **k):
                t0 = clock()
                try:
                    return f(*a, **k)
                finally:
                    core_ns[0] += clock() - t0
                    core_ns[1] += 1

            return timed

        for name in CORE_METHODS:  # time inside the core, per call
            setattr(sched, name, wrap(getattr(sched, name)))
        noop = wrap(lambda: None)  # the wrapper's own cost, subtracted from the actor's time per call
        t0 = clock()
        for _ in range(20_000):
            noop()
        overhead_ns = (clock() - t0) / 20_000
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.SNDHWM, 100_000)
        router.setsockopt(zmq.RCVHWM, 100_000)
        ep = f"inproc://bench-actor-{window}"
        router.bind(ep)
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.SNDHWM, 100_000)
        dealer.setsockopt(zmq.RCVHWM, 100_000)
        dealer.connect(ep)
        welcome = p.Welcome(
            daemon_epoch=1,
            protocol_min=p.PROTOCOL_MIN,
            protocol_max=p.PROTOCOL_MAX,
            block_size=d.block_size,
            shm_ledger="",
            shm_progress="",
            heartbeat_ms=d.heartbeat_ms,
            liveness_timeout_ms=d.liveness_timeout_ms,
            max_frame_bytes=d.max_frame_bytes,
        )
        actor = Actor(loop, sched, router, welcome, d, Metrics(), conns=conns)
        enc, dec, inner_dec = p.make_encoder(), p.make_daemon_decoder(), p.make_replied_daemon_decoder()

        def wake() -> float:
            t0 = clock()
            actor.data_reader.wake()  # the reader callback, called as the loop would
            return clock() - t0

        def replies() -> list:
            out = []
            while dealer.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                f = dec.decode(dealer.recv())
                out += [inner_dec.decode(r) for r in f.frames] if type(f) is p.Replies else [f]
            return out

        dealer.send(enc.encode(p.Hello(p.PROTOCOL_MAX, "bench-actor", 0)))
        wake()
        assert type(replies()[0]) is p.Welcome
        hashes = [request_hashes(i) for i in range(4096)]
        rows = []

        def tick(k: int) -> float:
            """The `k`th periodic tick (`Ticker.fire`), its next timer cancelled: thread CPU ns. The
            ticks come faster than every 10 ms here, so the once-per-100 ms and once-per-second work
            is made due on every 10th and 100th tick, as with 10 ms ticks."""
            actor.ticker._last_tick_s = time.monotonic_ns() / 1e9 - d.progress_fold_ms / 1000  # noqa: SLF001 - on time
            if k % 10 == 0:
                actor.ticker._next_liveness_us = 0  # noqa: SLF001
            if k % 100 == 0:
                actor.ticker._next_gauges_us = 0  # noqa: SLF001
            t0 = clock()
            actor.ticker.fire()  # the timer callback, called as the loop would
            dt = clock() - t0
            actor.ticker.stop()  # the benchmark drives the ticks itself
            return dt

        for rep in range(repeats + 1):  # the first repeat warms up (numba, caches) and is dropped
            actor_ns = tick_ns = tick_core_ns = ticks = 0
            tick_every = max(1, TICK_EVERY_LIFECYCLES // window)
            core_ns[0] = core_ns[1] = 0
            n = 0
            for r in range(rounds):
                if r % tick_every == 0:  # the 10 ms tick, once per TICK_EVERY_LIFECYCLES lifecycles
                    before = core_ns[:]
                    dt = tick(ticks)
                    tick_ns += dt - (core_ns[1] - before[1]) * overhead_ns
                    tick_core_ns += core_ns[0] - before[0]
                    core_ns[:] = before  # the tick's fold and cleanup are not the lifecycles' core
                    ticks += 1
                batch = [
                    enc.encode(p.Enqueue(f"q{r}-{i}", ISL, hashes[(r * window + i) % 4096])) for i in range(window)
                ]
                dealer.send(batch[0] if window == 1 else p.encode_batch(batch))
                actor_ns += wake()
                admitted = replies()
                assert len(admitted) == window and all(type(a) is p.Admitted for a in admitted), admitted[:1]
                rel = [enc.encode(p.Release(a.request_id, a.slot, a.generation, "completed", ISL)) for a in admitted]
                dealer.send(rel[0] if window == 1 else p.encode_batch(rel))
                actor_ns += wake()
                n += window
                if r % 64 == 63:
                    await asyncio.sleep(0)  # run what the wakes queued (call_soon), as the loop would
            actor_ns -= core_ns[1] * overhead_ns
            if rep:
                rows.append(
                    {
                        "lifecycles": n,
                        "actor_us_per_lc": actor_ns / n / 1000,
                        "core_us_per_lc": core_ns[0] / n / 1000,
                        "core_calls_per_lc": core_ns[1] / n,
                        "tick_us": tick_ns / ticks / 1000,
                        "tick_rest_us": (tick_ns - tick_core_ns) / ticks / 1000,
                    }
                )
        actor.stop_reading = lambda: None  # never started: nothing to remove
        dealer.close(0)
        router.close(0)
        ctx.term()
        return {"window": window, "rows": rows}

    async def main() -> list:
        return [await one(w) for w in windows]

    import kvsched

    return {"kvsched": str(Path(kvsched.__file__).parent), "results": uvloop.run(main())}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", default="1,8,32", help="Comma-separated frames per Batch (default 1,8,32).")
    ap.add_argument("--rounds", type=int, default=400, help="Rounds (Enqueue batch + Release batch) per repeat.")
    ap.add_argument("--repeats", type=int, default=5, help="Repeats per window; the median is printed.")
    ap.add_argument("--out", help="Write the JSON here.")
    add_tree_args(ap)
    args = ap.parse_args(argv)
    windows = [int(x) for x in args.windows.split(",")]
    if args.child:
        print(json.dumps(measure(windows, args.rounds, args.repeats)))
        return
    samples: dict[tuple[str, int], list[dict]] = {}
    child_args = [
        "--windows",
        ",".join(map(str, windows)),
        "--rounds",
        str(args.rounds),
        "--repeats",
        str(args.repeats),
    ]
    for name, got in alternate_trees(__file__, child_args, args.baseline, args.alternate, "kvsched-bench-actor-"):
        for res in got["results"]:
            samples.setdefault((name, res["window"]), []).extend(res["rows"])

    print(
        f"{'tree':12} {'window':>6} | {'actor µs/lc':>11} {'core µs/lc':>10} {'rest µs/lc':>10} {'rest share':>10}"
        f" | {'tick µs':>7} {'tick rest':>9}"
    )
    table = []
    for (name, w), rows in samples.items():
        a = median([r["actor_us_per_lc"] for r in rows])
        c = median([r["core_us_per_lc"] for r in rows])
        rest = median([r["actor_us_per_lc"] - r["core_us_per_lc"] for r in rows])
        tk, tk_rest = median([r["tick_us"] for r in rows]), median([r["tick_rest_us"] for r in rows])
        table.append(
            {
                "tree": name,
                "window": w,
                "actor_us_per_lc": round(a, 2),
                "core_us_per_lc": round(c, 2),
                "rest_us_per_lc": round(rest, 2),
                "tick_us": round(tk, 2),
                "tick_rest_us": round(tk_rest, 2),
                "samples": len(rows),
            }
        )
        print(f"{name:12} {w:>6} | {a:>11.1f} {c:>10.1f} {rest:>10.1f} {rest / a:>10.0%} | {tk:>7.1f} {tk_rest:>9.1f}")
    if args.baseline:
        for w in windows:
            new = next(t for t in table if t["tree"] == "this tree" and t["window"] == w)
            old = next(t for t in table if t["tree"] != "this tree" and t["window"] == w)
            print(
                f"window {w}: rest {new['rest_us_per_lc']:.1f} vs {old['rest_us_per_lc']:.1f} µs/lc "
                f"(x{new['rest_us_per_lc'] / old['rest_us_per_lc']:.2f}), actor {new['actor_us_per_lc']:.1f} vs "
                f"{old['actor_us_per_lc']:.1f} (x{new['actor_us_per_lc'] / old['actor_us_per_lc']:.2f}), tick "
                f"{new['tick_us']:.1f} vs {old['tick_us']:.1f} µs (x{new['tick_us'] / old['tick_us']:.2f})"
            )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "windows": windows,
                    "rounds": args.rounds,
                    "repeats": args.repeats,
                    "loadavg_1m": os.getloadavg()[0],
                    "table": table,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
