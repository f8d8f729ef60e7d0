"""Per-call split of the in-process lifecycle of `bench_core.py`: thread CPU µs of each call.

Remote-router lifecycle (`bench_core.run_lifecycles`, approximate index, 8 leases in flight): the
`RequestSpec` build (with its id string), `enqueue`, `update(dispatched)`, `update(prefill_done)`,
`release` and `drain_cleanup`, each timed on its own. Local-router lifecycle (the ledger given
private progress / state words, as the daemon maps them): after the router's `dispatched` store one
`fold_words` + `drain_cleanup`, after its `prefill_done` store the same, then one fold that finds
nothing (the actor folds on every wake). Daemon frames: the same remote lifecycle as decoded frames
through the actor's dispatch table (`Actor._handle_frame`: Enqueue, Update x2, Release) and the
wake's `drain_cleanup` + `Actor.deliver`; no sockets, no decoding (sends captured). Every figure
includes one pair of `time.thread_time_ns` reads (~0.5 µs here);
best of `--repeats` runs of `--n` lifecycles after 2,000 warm-up ones.

With `--baseline REV` the `kvsched/` package of git revision REV runs in a subprocess, alternating
with this tree for `--rounds` rounds (the machine is shared: compare figures of one run only).

Usage: python bench/bench_core_split.py [--baseline main] [--n 3000] [--repeats 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(1, str(HERE))

import bench_core as bc
import numpy as np

CALLS = ("spec", "enqueue", "update_dispatched", "update_prefill_done", "release", "drain_cleanup")
FOLDS = ("fold_drain_dispatched", "fold_drain_prefill_done", "fold_idle")
FRAMES = ("frame_enqueue", "frame_dispatched", "frame_prefill_done", "frame_release", "frame_drain")


def remote(sched, hashes, n: int, window: int, start: int, clock: list[int], acc: list[int]) -> None:
    """`bench_core.run_lifecycles` with each call timed into `acc` (ns, in `CALLS` order)."""
    from kvsched.core.types import RequestSpec

    tt, held, t = time.thread_time_ns, [], clock[0]
    for i in range(start, start + n):
        t += 50
        t0 = tt()
        spec = RequestSpec(request_id=f"r{i}", isl_tokens=bc.ISL, block_hashes=hashes[i % bc.N_SEQUENCES], owner=1)
        t1 = tt()
        a = sched.enqueue(spec, t)[0]
        t2 = tt()
        sched.update(a.request_id, a.slot, a.generation, "dispatched", None, t)
        t3 = tt()
        sched.update(a.request_id, a.slot, a.generation, "prefill_done", None, t)
        t4 = tt()
        held.append(a)
        r0 = r1 = 0
        if len(held) > window - 1:
            old = held.pop(0)
            r0 = tt()
            sched.release(old.request_id, old.slot, old.generation, "completed", bc.ISL + 1, t)
            r1 = tt()
        t5 = tt()
        sched.drain_cleanup(t)
        t6 = tt()
        for k, d in enumerate((t1 - t0, t2 - t1, t3 - t2, t4 - t3, r1 - r0, t6 - t5)):
            acc[k] += d
    for old in held:
        sched.release(old.request_id, old.slot, old.generation, "completed", bc.ISL + 1, t)
    sched.drain_cleanup(t)
    clock[0] = t


def local(sched, state, hashes, n: int, window: int, start: int, clock: list[int], acc: list[int]) -> None:
    """Local-router lifecycles: state-word stores folded by `fold_words`; folds timed into `acc`."""
    from kvsched.core.types import RequestSpec
    from kvsched.shm.words import STATE_DISPATCHED, STATE_PREFILL_DONE, write_state

    tt, held, t = time.thread_time_ns, [], clock[0]
    for i in range(start, start + n):
        t += 50
        a = sched.enqueue(
            RequestSpec(request_id=f"r{i}", isl_tokens=bc.ISL, block_hashes=hashes[i % bc.N_SEQUENCES], owner=1), t
        )[0]
        write_state(state, a.slot, a.generation, STATE_DISPATCHED)
        t0 = tt()
        sched.fold_words()
        sched.drain_cleanup(t)
        t1 = tt()
        write_state(state, a.slot, a.generation, STATE_PREFILL_DONE)
        t2 = tt()
        sched.fold_words()
        sched.drain_cleanup(t)
        t3 = tt()
        sched.fold_words()
        t4 = tt()
        acc[0] += t1 - t0
        acc[1] += t3 - t2
        acc[2] += t4 - t3
        held.append(a)
        if len(held) > window - 1:
            old = held.pop(0)
            sched.release(old.request_id, old.slot, old.generation, "completed", bc.ISL + 1, t)
        sched.drain_cleanup(t)
    for old in held:
        sched.release(old.request_id, old.slot, old.generation, "completed", bc.ISL + 1, t)
    sched.drain_cleanup(t)
    clock[0] = t


def frames(tr, conn, sent, blobs, n: int, window: int, start: int, clock: list[int], acc: list[int]) -> None:
    """The daemon's per-frame path (`Translator.handle`, no sockets, no decoding): Enqueue, two
    Updates and a Release from a remote router, and the wake's `drain_cleanup` delivered; timed into
    `acc` (ns, in `FRAMES` order)."""
    from kvsched import protocol as p

    tt, held, t = time.thread_time_ns, [], clock[0]
    for i in range(start, start + n):
        t += 50
        enq = p.Enqueue(f"r{i}", bc.ISL, blobs[i % bc.N_SEQUENCES])
        t0 = tt()
        tr.handle(conn, enq, t)
        t1 = tt()
        a = sent[-1]
        u1, u2 = (
            p.Update(a.request_id, a.slot, a.generation, "dispatched"),
            p.Update(a.request_id, a.slot, a.generation, "prefill_done"),
        )
        t2 = tt()
        tr.handle(conn, u1, t)
        t3 = tt()
        tr.handle(conn, u2, t)
        t4 = tt()
        held.append(a)
        r0 = r1 = 0
        if len(held) > window - 1:
            old = held.pop(0)
            rel = p.Release(old.request_id, old.slot, old.generation, "completed", bc.ISL + 1)
            r0 = tt()
            tr.handle(conn, rel, t)
            r1 = tt()
        t5 = tt()
        tr.deliver(tr.scheduler.drain_cleanup(t), t)
        t6 = tt()
        sent.clear()
        for k, d in enumerate((t1 - t0, t3 - t2, t4 - t3, r1 - r0, t6 - t5)):
            acc[k] += d
    for old in held:
        tr.handle(conn, p.Release(old.request_id, old.slot, old.generation, "completed", bc.ISL + 1), t)
    tr.deliver(tr.scheduler.drain_cleanup(t), t)
    tr.tally.flush()
    clock[0] = t


def _translator(sched):
    """The actor's frame handling without sockets: its dispatch (`handle`), `deliver`, its scheduler
    and tally; what it would send is captured in `sent`."""
    import asyncio
    from types import SimpleNamespace

    import zmq

    from kvsched.config import DaemonConfig
    from kvsched.daemon.actor import Actor
    from kvsched.daemon.connections import ConnectionTable
    from kvsched.daemon.metrics import Metrics

    conns, sent = ConnectionTable(10**12), []
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    actor = Actor(asyncio.new_event_loop(), sched, sock, None, DaemonConfig(), Metrics(), conns=conns)
    actor._send = lambda c, f, a=None: sent.append(f) or True  # noqa: SLF001 - the sends, captured
    if hasattr(actor, "tr"):  # a `--baseline` revision whose Translator sent (before the actor owned the sends)
        actor.tr.send = actor._send  # noqa: SLF001
    tr = SimpleNamespace(
        handle=actor._handle_frame,  # noqa: SLF001 - the dispatch, without the socket read
        deliver=getattr(actor, "deliver", None) or actor._deliver,  # noqa: SLF001 - `_deliver` in a baseline
        scheduler=sched,
        tally=actor.tally,
    )
    return tr, conns.open(b"router", 0), sent


def _best(run, n: int, repeats: int, k: int) -> list[float]:
    run(2000, 0, [0] * k)  # warm-up
    best, start = None, 2000
    for _ in range(repeats):
        acc = [0] * k
        run(n, start, acc)
        start += n
        row = [x / n / 1000 for x in acc]
        best = row if best is None else [min(a, b) for a, b in zip(best, row, strict=True)]
    return [round(x, 2) for x in best]


def measure(n: int, repeats: int, window: int = 8) -> dict:
    """Best-of-`repeats` µs per call, remote and local lifecycles."""
    from kvsched.core.create import create_scheduler
    from kvsched.core.ledger import Ledger
    from kvsched.shm.layout import LedgerArrays

    hashes = bc.make_hashes(np.random.default_rng(0))
    sched, clock = bc.build("approx"), [1_000_000]
    calls = _best(lambda n_, s_, acc: remote(sched, hashes, n_, window, s_, clock, acc), n, repeats, len(CALLS))
    cfg = bc.make_config()
    d = cfg.daemon
    arrays = LedgerArrays.private(d.max_workers, d.max_slots, d.max_blocks_per_request, None, d.block_size)
    state = np.zeros(d.max_slots, np.uint64)
    ledger = Ledger(arrays, progress=np.zeros(d.max_slots, np.uint64), overload=cfg.overload, state=state)
    lsched, clock = create_scheduler(cfg, ledger=ledger), [1_000_000]
    lsched.set_max_waiting_share(1.0)
    folds = _best(lambda n_, s_, acc: local(lsched, state, hashes, n_, window, s_, clock, acc), n, repeats, len(FOLDS))
    tr, conn, sent = _translator(bc.build("approx"))
    blobs, clock = [h.tobytes() for h in hashes], [1_000_000]
    frm = _best(lambda n_, s_, acc: frames(tr, conn, sent, blobs, n_, window, s_, clock, acc), n, repeats, len(FRAMES))
    return dict(zip(CALLS + FOLDS + FRAMES, calls + folds + frm, strict=True))


def _baseline(src: str, n: int, repeats: int) -> dict:
    """The figures of the `kvsched/` package exported into `src` (`bench_core.export_revision`), in a
    subprocess; its numba cache lives beside it, so only the first round of a run compiles."""
    env = dict(os.environ, PYTHONPATH=src, KVSCHED_BENCH_CORE_SRC=src, NUMBA_CACHE_DIR=str(Path(src) / ".nb"))
    out = subprocess.run(
        [sys.executable, __file__, "--inner", "--n", str(n), "--repeats", str(repeats)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=src,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", metavar="REV", help="also measure the kvsched package of this git revision")
    ap.add_argument("--n", type=int, default=3000, help="lifecycles per repeat")
    ap.add_argument("--repeats", type=int, default=3, help="repeats, best kept")
    ap.add_argument("--rounds", type=int, default=2, help="alternating baseline / this-tree rounds")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        print(json.dumps(measure(args.n, args.repeats)))
        return
    print(f"thread CPU µs per call (best of {args.repeats} x {args.n}; each figure includes ~0.5 µs of clock reads)")
    names = CALLS + FOLDS + FRAMES
    results = []
    with tempfile.TemporaryDirectory(prefix="kvsched-split-base-") as src:
        if args.baseline:
            bc.export_revision(args.baseline, src)
        for _ in range(args.rounds):
            results += ([(args.baseline, _baseline(src, args.n, args.repeats))] if args.baseline else []) + [
                ("this tree", measure(args.n, args.repeats))
            ]
    print(f"{'call':<24}" + "".join(f"{label[:10]:>11}" for label, _ in results))
    for k in names:
        print(f"{k:<24}" + "".join(f"{r[k]:>11.2f}" for _, r in results))


if __name__ == "__main__":
    main()
