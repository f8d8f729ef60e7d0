"""Queue-layer throughput: PolicyQueue (lazy heaps + lane-head index + DRR) vs a naive list-scan
queue, measured side by side in the same run.

Figures: enqueue+pop ops/s at 10^3 / 10^4 / 10^5 queued; pop ops/s with 1..1024 pinned lanes;
1..16 classes; cancel cost (µs per request) at 10^5 queued. Prints a table and writes
out/bench/queue.json. Run: `.venv/bin/python bench/bench_queue.py [--quick]` (< ~3 min).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from kvsched.config import ClassConfig
from kvsched.core.ordering import QueueEntry, fcfs_key
from kvsched.core.policy_queue import PolicyQueue
from kvsched.core.types import WorkerKey


def ALWAYS(c, x) -> bool:
    return True


class NaiveQueue:
    """Baseline: one plain list; pop = full scan for the minimum key; cancel = list scan."""

    def __init__(self) -> None:
        self.items: list[QueueEntry] = []

    def add(self, e: QueueEntry) -> None:
        e.key = fcfs_key(e)
        self.items.append(e)

    def pop(self) -> QueueEntry:
        best = min(range(len(self.items)), key=lambda i: self.items[i].key)
        return self.items.pop(best)

    def remove(self, rid: str) -> None:
        for i, e in enumerate(self.items):
            if e.request_id == rid:
                del self.items[i]
                return


class Gen:
    def __init__(self, lanes: int = 0, classes: int = 1) -> None:
        self.seq, self.lanes, self.classes = 0, lanes, classes
        self.rng = random.Random(1)

    def entry(self) -> QueueEntry:
        self.seq += 1
        lane = WorkerKey(self.rng.randrange(self.lanes), 0) if self.lanes else None
        return QueueEntry(
            f"r{self.seq}",
            enqueue_seq=self.seq,
            arrival_us=self.seq,
            cost=self.rng.randint(1, 2048),
            isl_tokens=512,
            placement=lane,
            class_idx=self.rng.randrange(self.classes),
        )


def _policy_queue(n: int, lanes: int = 0, classes: int = 1) -> tuple[PolicyQueue, Gen]:
    pq = PolicyQueue([ClassConfig(name=f"c{i}", quantum=512 * (i + 1)) for i in range(classes)])
    g = Gen(lanes, classes)
    for _ in range(n):
        e = g.entry()
        pq.enqueue(e.class_idx, e, 1)
    return pq, g


def _rate(fn, ops: int) -> float:
    t0 = time.perf_counter()
    fn(ops)
    return ops / (time.perf_counter() - t0)


def bench_depth(n: int, ops: int, naive_ops: int) -> dict:
    pq, g = _policy_queue(n)

    def run(k: int) -> None:
        for _ in range(k):
            e = g.entry()
            pq.enqueue(e.class_idx, e, 1)
            pq.pop_next(ALWAYS, ALWAYS)

    nq, g2 = NaiveQueue(), Gen()
    for _ in range(n):
        nq.add(g2.entry())

    def run_naive(k: int) -> None:
        for _ in range(k):
            nq.add(g2.entry())
            nq.pop()

    return {"queued": n, "policy_queue_ops_s": _rate(run, ops), "naive_ops_s": _rate(run_naive, naive_ops)}


def bench_lanes(lanes: int, ops: int) -> dict:
    pq, g = _policy_queue(10_000, lanes=lanes)

    def run(k: int) -> None:
        for _ in range(k):
            e = g.entry()
            pq.enqueue(0, e, 1)
            pq.pop_next(ALWAYS, ALWAYS)

    return {"lanes": lanes, "policy_queue_ops_s": _rate(run, ops)}


def bench_classes(classes: int, ops: int) -> dict:
    pq, g = _policy_queue(10_000, classes=classes)

    def run(k: int) -> None:
        for _ in range(k):
            e = g.entry()
            pq.enqueue(e.class_idx, e, 1)
            pq.pop_next(ALWAYS, ALWAYS)

    return {"classes": classes, "policy_queue_ops_s": _rate(run, ops)}


def bench_cancel(n: int, cancels: int, naive_cancels: int) -> dict:
    pq, _g = _policy_queue(n)
    entries = [e for cq in pq.classes for e in cq.iter_ready()]
    victims = random.Random(2).sample(entries, cancels)
    t0 = time.perf_counter()
    for e in victims:
        pq.remove(e)
    pq.compact()  # the end of the cleanup batch: at most one rebuild per container
    us = (time.perf_counter() - t0) / cancels * 1e6
    nq, g2 = NaiveQueue(), Gen()
    for _ in range(n):
        nq.add(g2.entry())
    ids = random.Random(3).sample([e.request_id for e in nq.items], naive_cancels)
    t0 = time.perf_counter()
    for rid in ids:
        nq.remove(rid)
    naive_us = (time.perf_counter() - t0) / naive_cancels * 1e6
    return {"queued": n, "policy_queue_us_per_cancel": us, "naive_us_per_cancel": naive_us}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer operations (smoke run)")
    ap.add_argument("--out", default="out/bench/queue.json")
    args = ap.parse_args()
    scale = 0.1 if args.quick else 1.0
    ops = max(1000, int(30_000 * scale))
    res = {
        "depth": [
            bench_depth(n, ops, max(50, int(min(ops, 3_000_000 // n) * scale))) for n in (1_000, 10_000, 100_000)
        ],
        "lanes": [bench_lanes(k, ops) for k in (1, 16, 256, 1024)],
        "classes": [bench_classes(k, ops) for k in (1, 4, 16)],
        "cancel": bench_cancel(100_000, max(1000, int(20_000 * scale)), max(50, int(300 * scale))),
    }
    print(f"{'figure':<28}{'PolicyQueue':>16}{'naive list':>16}{'ratio':>9}")
    for row in res["depth"]:
        p, n = row["policy_queue_ops_s"], row["naive_ops_s"]
        print(f"{'enqueue+pop @' + format(row['queued'], ','):<28}{p:>12,.0f} /s{n:>12,.0f} /s{p / n:>8.1f}x")
    for row in res["lanes"]:
        print(f"{'enqueue+pop, ' + str(row['lanes']) + ' lanes':<28}{row['policy_queue_ops_s']:>12,.0f} /s")
    for row in res["classes"]:
        print(f"{'enqueue+pop, ' + str(row['classes']) + ' classes':<28}{row['policy_queue_ops_s']:>12,.0f} /s")
    c = res["cancel"]
    print(
        f"{'cancel @100,000':<28}{c['policy_queue_us_per_cancel']:>11.2f} µs{c['naive_us_per_cancel']:>11.1f} µs"
        f"{c['naive_us_per_cancel'] / c['policy_queue_us_per_cancel']:>8.0f}x"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
