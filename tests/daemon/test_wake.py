"""One actor wake over a real ROUTER/DEALER pair (inproc): what it reads, what it sends, what it skips.

The wake is the reader callback `Actor.data_reader.wake`, called here as the event loop would call it.
"""

from __future__ import annotations

import asyncio

import numpy as np
import zmq

from kvsched import protocol as p
from kvsched.config import DaemonConfig
from kvsched.daemon.actor import Actor
from kvsched.daemon.connections import ConnectionTable
from kvsched.daemon.metrics import Metrics
from tests.core.factories import make_scheduler

HASHES = np.arange(1, 5, dtype="<u8").tobytes()


class Harness:
    """An Actor on a bound ROUTER, one DEALER peer that said Hello (protocol 2), counted core calls."""

    def __init__(self, name: str, budget: int = 512, worker_urls: dict[int, str] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.bind(f"inproc://{name}")
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.connect(f"inproc://{name}")
        conns = ConnectionTable(10**9)
        self.sched = make_scheduler(
            owner_alive=conns.owner_alive, total_kv_blocks=100_000, max_num_batched_tokens=10**8, max_slots=256
        )
        self.calls = {"fold_words": 0, "drain_cleanup": 0}
        for name_ in self.calls:
            self._count(name_)
        cfg = DaemonConfig(frame_budget_per_wake=budget)
        welcome = p.Welcome(
            daemon_epoch=1,
            protocol_min=p.PROTOCOL_MIN,
            protocol_max=p.PROTOCOL_MAX,
            block_size=cfg.block_size,
            shm_ledger="",
            shm_progress="",
            heartbeat_ms=1000,
            liveness_timeout_ms=5000,
        )
        self.actor = Actor(
            self.loop, self.sched, self.router, welcome, cfg, Metrics(), worker_urls=worker_urls, conns=conns
        )
        self.enc, self.dec = p.make_encoder(), p.make_daemon_decoder()
        self.inner = p.make_replied_daemon_decoder()
        self.send(p.Hello(2, "test"))
        self.actor.data_reader.wake()
        assert [type(f) for f in self.replies()] == [p.Welcome]

    def _count(self, name: str) -> None:
        inner = getattr(self.sched, name)

        def counted(*a, **k):
            self.calls[name] += 1
            return inner(*a, **k)

        setattr(self.sched, name, counted)

    def send(self, *frames) -> None:
        raws = [self.enc.encode(f) for f in frames]
        self.dealer.send(raws[0] if len(raws) == 1 else p.encode_batch(raws))

    def messages(self) -> list:
        """Decoded messages waiting at the DEALER (a `Replies` stays one message)."""
        out = []
        while self.dealer.poll(0):
            out.append(self.dec.decode(self.dealer.recv()))
        return out

    def replies(self) -> list:
        """The frames waiting at the DEALER, `Replies` unpacked."""
        out = []
        for m in self.messages():
            out += [self.inner.decode(r) for r in m.frames] if type(m) is p.Replies else [m]
        return out

    def close(self) -> None:
        self.actor.stopped = True
        self.dealer.close(0)
        self.router.close(0)
        self.ctx.term()


async def test_one_wake_reads_every_waiting_message_and_answers_once():
    """Three messages waiting: one wake handles all three and sends its replies as one message."""
    h = Harness("wake-all")
    try:
        for i in range(3):
            h.send(p.Enqueue(f"r{i}", 64, HASHES))
        h.actor.data_reader.wake()
        msgs = h.messages()
        assert len(msgs) == 1 and type(msgs[0]) is p.Replies
        assert [h.inner.decode(r).request_id for r in msgs[0].frames] == ["r0", "r1", "r2"]
        assert h.calls == {"fold_words": 2, "drain_cleanup": 2}  # the Hello's wake and this one: one each
    finally:
        h.close()


async def test_wake_with_nothing_to_read_skips_fold_and_cleanup():
    """The ZMQ FD also signals after sends: a wake that finds no message costs no kernel call and
    no cleanup pass (the 10 ms tick and the fold timer fold the words meanwhile)."""
    h = Harness("wake-empty")
    try:
        before = dict(h.calls)
        for _ in range(5):
            h.actor.data_reader.wake()
        assert h.calls == before and h.messages() == []
    finally:
        h.close()


async def test_budget_ends_the_wake_and_schedules_the_next():
    """With a budget of 2 frames, 3 messages take two wakes; the first schedules the second."""
    h = Harness("wake-budget", budget=2)
    try:
        for i in range(3):
            h.send(p.Enqueue(f"r{i}", 64, HASHES))
        scheduled = []
        real_call_soon = h.loop.call_soon
        h.loop.call_soon = lambda cb, *a: scheduled.append(cb)  # type: ignore[method-assign]
        try:
            h.actor.data_reader.wake()
        finally:
            h.loop.call_soon = real_call_soon  # type: ignore[method-assign]
        assert [f.request_id for f in h.replies()] == ["r0", "r1"]
        assert scheduled == [h.actor.data_reader.wake]
        h.actor.data_reader.wake()
        assert [f.request_id for f in h.replies()] == ["r2"]
    finally:
        h.close()


async def test_release_and_enqueue_in_one_batch_are_handled_in_order():
    """A Batch [Release(r0), Enqueue(r0)] reuses the id at once: the release is applied first."""
    h = Harness("wake-order")
    try:
        h.send(p.Enqueue("r0", 64, HASHES))
        h.actor.data_reader.wake()
        (a,) = h.replies()
        h.send(p.Release("r0", a.slot, a.generation, "completed", 64), p.Enqueue("r0", 64, HASHES))
        h.actor.data_reader.wake()
        (b,) = h.replies()
        assert type(b) is p.Admitted and b.request_id == "r0"
        assert h.sched.owner_of("r0") is not None
    finally:
        h.close()


async def test_replies_sent_outside_a_wake_look_again_for_frames_their_sends_hid():
    """1. a frame from the router waits in the daemon's socket; 2. a reply owed outside a wake (a
    timer's admission, an admin action) is flushed by the outbox's own callback. ZeroMQ's FD is
    edge-like and a send processes the socket's commands, which can swallow the signal of that
    frame. Result: the flush schedules a wake (`data_reader.wake`) when the socket is readable (before:
    nothing did, and the frame waited for the next 10 ms tick or another router's message)."""
    h = Harness("outside-wake")
    try:
        h.send(p.Heartbeat(1))
        await asyncio.sleep(0.05)  # the frame reaches the daemon's socket (inproc: at once)
        conn = next(iter(h.actor.conns))
        h.actor.outbox.add(conn, h.enc.encode(p.HeartbeatAck(0)), None)  # owed outside a wake
        scheduled = []
        real_call_soon = h.loop.call_soon
        h.loop.call_soon = lambda cb, *a: scheduled.append(cb)  # type: ignore[method-assign]
        try:
            h.actor.outbox._flush_due()
        finally:
            h.loop.call_soon = real_call_soon  # type: ignore[method-assign]
        assert [type(f) for f in h.replies()] == [p.HeartbeatAck]
        assert h.actor.data_reader.wake in scheduled
    finally:
        h.close()


async def test_a_batch_larger_than_the_budget_is_finished_over_the_next_wakes_before_other_messages():
    """1. a Batch of 5 frames (the fourth not a valid frame) then a lone Enqueue wait, budget 2 frames per
    wake; 2. the reader wakes four times. Result: each wake handles at most 2 frames, in order: the
    batch's frames first, then the lone Enqueue; the invalid frame's Error names its place in the
    batch (3). Before: the first wake handled the whole batch, so one message could hold the loop for
    as long as its frames took (a client batches up to max_frame_bytes: tens of thousands of Enqueues)."""
    h = Harness("wake-batch", budget=2)
    try:
        raws = [h.enc.encode(p.Enqueue(f"r{i}", 64, HASHES)) for i in range(5)]
        raws[3] = h.enc.encode(["enqueue", "r3"])  # MessagePack, but not a frame (fields missing)
        h.dealer.send(p.encode_batch(raws))
        h.send(p.Enqueue("r5", 64, HASHES))
        await asyncio.sleep(0.05)  # inproc: both are there at once
        seen = []
        for _ in range(4):
            h.actor.data_reader.wake()
            seen.append([f"error@{f.batch_index}" if type(f) is p.Error else f.request_id for f in h.replies()])
        assert seen == [["r0", "r1"], ["r2", "error@3"], ["r4", "r5"], []]
    finally:
        h.close()


async def test_the_rest_of_a_batch_from_a_connection_closed_meanwhile_is_dropped():
    """A Batch of 4 frames, budget 2: after the first wake the connection is closed (found dead).
    Result: the next wake handles none of the batch's remaining frames."""
    h = Harness("wake-batch-dead", budget=2)
    try:
        h.send(*[p.Enqueue(f"r{i}", 64, HASHES) for i in range(4)])
        await asyncio.sleep(0.05)
        h.actor.data_reader.wake()
        assert [f.request_id for f in h.replies()] == ["r0", "r1"]
        h.actor.conns.close(next(iter(h.actor.conns)))
        h.actor.data_reader.wake()
        assert h.replies() == [] and h.sched.owner_of("r2") is None
        assert h.actor.dropped_dead_frames == 2
    finally:
        h.close()


async def test_a_flooded_socket_keeps_one_wake_queued_however_often_its_reader_fires():
    """1. 40 Enqueues wait, budget 2 frames per wake; 2. the socket's reader fires four times (the
    ZMQ FD also signals after sends and internal commands), each wake using its budget and asking for
    the next; 3. the loop turns twice. Result: each turn runs one queued wake (2 frames). Before: each
    wake that used its budget queued one more copy, all copies ran in one turn and each queued its
    successor, so a long flood made every loop turn (the admin socket's reader, every timer) wait for
    more and more data wakes."""
    h = Harness("wake-once", budget=2)
    try:
        for i in range(40):
            h.send(p.Enqueue(f"r{i}", 64, HASHES))
        await asyncio.sleep(0.05)
        for _ in range(4):
            h.actor.data_reader.wake()
        assert len(h.replies()) == 8
        per_turn = []
        for _ in range(2):
            await asyncio.sleep(0)  # one loop turn: the wakes queued before it run
            per_turn.append(len(h.replies()))
        assert per_turn == [2, 2]
    finally:
        h.close()
