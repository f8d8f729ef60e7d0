"""Wall-clock fleet: frames in, first token / progress / done out, over a real ROUTER socket."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import msgspec
import numpy as np
import zmq

from kvsched.sim.fleet import Fleet, FleetParams, SimBatch, SimDone, SimError, SimFirstToken, SimSubmit
from kvsched.sim.fleet_spec import FleetSpec


@contextmanager
def _serving_fleet(tmp_path):
    """A fleet of two engines (16-token blocks, 1,024 blocks each, speedup 200) serving on a thread,
    and a DEALER connected to it: yields (fleet, socket, encoder); stops and closes them on exit."""
    ep = f"ipc://{tmp_path}/fleet.sock"
    ctx = zmq.Context()
    fleet = Fleet(FleetParams(ep, FleetSpec(workers=2, block_size=16, kv_blocks=1024), speedup=200.0), ctx)
    stop = threading.Event()
    th = threading.Thread(target=fleet.serve, args=(time.monotonic(), stop.is_set), daemon=True)
    th.start()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ep)
    try:
        yield fleet, sock, msgspec.msgpack.Encoder()
    finally:
        stop.set()
        th.join(5)
        sock.close(0)
        fleet.close()
        ctx.term()


def _collect(sock: zmq.Socket, want_done: set[str], timeout_s: float = 10.0) -> list:
    dec = msgspec.msgpack.Decoder(SimBatch)
    items: list = []
    deadline = time.monotonic() + timeout_s
    while want_done and time.monotonic() < deadline:
        if sock.poll(100):
            for it in dec.decode(sock.recv()).items:
                items.append(it)
                if isinstance(it, (SimDone, SimError)):
                    want_done.discard(it.request_id)
    return items


def test_fleet_streams_first_token_then_done_when_request_submitted(tmp_path):
    with _serving_fleet(tmp_path) as (fleet, sock, enc):
        hashes = np.arange(1, 5, dtype="<u8").tobytes()
        sock.send(enc.encode(SimSubmit("a", 0, 0, 64, 40, hashes)))
        sock.send(enc.encode(SimSubmit("b", 1, 0, 64, 3, hashes)))
        sock.send(enc.encode(SimSubmit("c", 9, 0, 64, 3, b"")))
        items = _collect(sock, {"a", "b", "c"})
    by = {}
    for it in items:
        by.setdefault(it.request_id, []).append(type(it).__name__)
    assert by["a"][0] == "SimFirstToken" and by["a"][-1] == "SimDone"
    assert by["b"][0] == "SimFirstToken" and by["b"][-1] == "SimDone"
    assert by["c"] == ["SimError"]
    done = {it.request_id: it for it in items if isinstance(it, SimDone)}
    first = {it.request_id: it for it in items if isinstance(it, SimFirstToken)}
    assert done["a"].output_tokens == 40 and done["a"].t_us > first["a"].t_us
    assert fleet.stats()["completed"] == 2


def test_first_token_reports_chosen_and_deepest_cached_prefix_across_engines(tmp_path):
    """Engine 0 has cached 4 blocks of a prompt (a first request finished there); a second request with
    the same prompt sent to engine 1 reports 0 blocks on its engine and 4 on the deepest engine (the
    overlap it gave up); the same request sent to engine 0 reports 4 and 4."""
    hashes = np.arange(1, 6, dtype="<u8").tobytes()  # 5 blocks, 80 tokens: the first 4 full ones get cached
    with _serving_fleet(tmp_path) as (_fleet, sock, enc):
        sock.send(enc.encode(SimSubmit("warm", 0, 0, 80, 2, hashes)))
        items = _collect(sock, {"warm"})
        sock.send(enc.encode(SimSubmit("elsewhere", 1, 0, 80, 2, hashes)))
        sock.send(enc.encode(SimSubmit("same", 0, 0, 80, 2, hashes)))
        items += _collect(sock, {"elsewhere", "same"})
    first = {it.request_id: it for it in items if isinstance(it, SimFirstToken)}
    assert (first["warm"].overlap_blocks, first["warm"].best_overlap_blocks) == (0, 0)
    deep = first["same"].overlap_blocks
    assert deep >= 4 and first["same"].best_overlap_blocks == deep
    assert (first["elsewhere"].overlap_blocks, first["elsewhere"].best_overlap_blocks) == (0, deep)
