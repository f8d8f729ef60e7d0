"""The router side's socket path in one process: thread CPU of the client `Link` per wake and per send.

`bench_transport.py` prints the routers' CPU per lifecycle, but on a shared machine its cells move
by ±25 % between runs. This bench isolates the client link's own I/O path: a real `Link` (the
`SchedulerClient`'s connection) behind a ROUTER on `inproc://` in the same thread, Hello / Welcome
exchanged for real, then per round one `Admitted` frame sent by the ROUTER and the link's reader
callback (`Link._on_readable`, called directly as the event loop would) timed in thread CPU time:
receive, readability checks, decode, dispatch. Then `Link._raw_send` of one small frame
(the send and its re-check of the edge-triggered FD). Medians of `--repeats`.

    .venv/bin/python bench/bench_link.py                    # this tree
    .venv/bin/python bench/bench_link.py --baseline main     # and `main`'s kvsched/, alternating
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from baseline_trees import add_tree_args, alternate_trees, median


def measure(rounds: int, repeats: int) -> dict:
    """Run in a process whose `kvsched` is the tree under test: {read_us, send_us} per repeat."""
    import asyncio
    import time

    import uvloop
    import zmq

    import kvsched
    from kvsched import protocol as p
    from kvsched.client.link import Link

    async def main() -> dict:
        loop = asyncio.get_running_loop()
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.bind("inproc://bench-link")
        frames: list = []
        link = Link(ctx, "inproc://bench-link", "bench-link", frames.append, lambda welcome, again: None)
        link.open(loop)
        identity, _hello = router.recv_multipart()
        enc = p.make_encoder()
        router.send_multipart(
            [
                identity,
                enc.encode(
                    p.Welcome(1, p.PROTOCOL_MIN, p.PROTOCOL_MAX, 16, "", "", 1000, 5000, p.DEFAULT_MAX_FRAME_BYTES)
                ),
            ]
        )
        for _ in range(200):
            await asyncio.sleep(0.005)
            if link.connected:
                break
        assert link.connected, "no Welcome"
        admitted = enc.encode(p.Admitted("bench-request-0001", 3, 0, 17, 1, 0, 0, 5, "", 1))
        clock = time.thread_time_ns
        reads, sends = [], []
        for rep in range(repeats + 1):  # the first repeat warms up and is dropped
            read_ns = send_ns = 0
            for i in range(rounds):
                router.send(identity, zmq.SNDMORE)
                router.send(admitted)
                t0 = clock()
                link._on_readable()  # noqa: SLF001 - the reader callback, as the loop calls it
                read_ns += clock() - t0
                t0 = clock()
                link._raw_send(admitted)  # noqa: SLF001 - one send and its edge re-check
                send_ns += clock() - t0
                router.recv_multipart()
                if i % 256 == 255:
                    await asyncio.sleep(0)  # run what the sends queued (call_soon), as the loop would
            if rep:
                reads.append(read_ns / rounds / 1000)
                sends.append(send_ns / rounds / 1000)
            frames.clear()
        link.close()
        router.close(0)
        ctx.term()
        return {"read_us": reads, "send_us": sends}

    return {"kvsched": str(Path(kvsched.__file__).parent), **uvloop.run(main())}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10_000, help="Wakes (and sends) per repeat.")
    ap.add_argument("--repeats", type=int, default=5, help="Repeats per run; the median is printed.")
    add_tree_args(ap)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.rounds, args.repeats)))
        return
    samples: dict[str, dict[str, list[float]]] = {}
    child_args = ["--rounds", str(args.rounds), "--repeats", str(args.repeats)]
    for name, got in alternate_trees(__file__, child_args, args.baseline, args.alternate, "kvsched-bench-link-"):
        s = samples.setdefault(name, {"read_us": [], "send_us": []})
        s["read_us"] += got["read_us"]
        s["send_us"] += got["send_us"]

    print(f"{'tree':12} | {'read µs/wake':>12} {'send µs':>8}")
    for name, s in samples.items():
        print(f"{name:12} | {median(s['read_us']):>12.2f} {median(s['send_us']):>8.2f}")


if __name__ == "__main__":
    main()
