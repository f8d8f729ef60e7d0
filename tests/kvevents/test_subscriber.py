"""The daemon's KV-event subscriber against real sockets: replay, restarts, reconnects, staleness
(docs/DESIGN.md §6.2, §6.3; docs/KV_EVENTS.md)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time

import msgspec
import numpy as np
import pytest
import zmq

from kvsched.config import WorkerConfig
from kvsched.daemon.kv_events import KvEventSubscriber
from kvsched.daemon.kv_sources import KvEventSource, sources_for_worker
from kvsched.kvevents.format import END_SEQ, seq_from_bytes, seq_to_bytes
from kvsched.shm.overlap import OverlapIndex
from kvsched.sim.kv_publisher import KvEventPublisher

pytestmark = pytest.mark.timeout(60)
enc = msgspec.msgpack.encode
ROW = 2
TOPIC = "kv-events"


@pytest.fixture
def ipc_dir():
    d = tempfile.mkdtemp(prefix="kvev", dir="/tmp")  # short: ipc paths are limited to ~107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


async def until(pred, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(0.01)
    return bool(pred())


def depth(idx: OverlapIndex, hashes) -> int:
    out = np.zeros(idx.max_workers, np.int32)
    idx.depth(np.array(hashes, dtype=np.uint64), 0, out)
    return int(out[ROW])


class Harness:
    def __init__(self, ctx, ipc_dir, **kw):
        self.ev = f"ipc://{ipc_dir}/ev"
        self.rp = f"ipc://{ipc_dir}/rp"
        self.dev, self.off = OverlapIndex(4, 1 << 10), OverlapIndex(4, 1 << 10)
        self.stale_calls: list[tuple[int, bool]] = []
        self.sub = KvEventSubscriber(
            asyncio.get_running_loop(),
            ctx,
            [KvEventSource(ROW, self.ev, self.rp, TOPIC)],
            self.dev,
            self.off,
            mark_stale=lambda r, s: self.stale_calls.append((r, s)),
            **kw,
        )

    def last_seq(self) -> int:
        return self.sub.applier.stream(ROW).last_seq

    async def sync(self, publish_probe) -> None:
        """Publish empty probe batches until the SUB has joined and any first-contact replay is done."""
        seen = self.last_seq()
        while self.last_seq() == seen:
            publish_probe()
            await asyncio.sleep(0.02)
        assert await until(lambda: not self.sub.applier.replay_pending(ROW))


def probe(pub: KvEventPublisher):
    return lambda: pub.publish_raw(enc([time.time(), [], 0]))


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_gap_triggers_replay_from_the_publisher_router(ctx, ipc_dir, encoding):
    h = Harness(ctx, ipc_dir)
    pub = KvEventPublisher(ctx, h.ev, h.rp, topic=TOPIC, encoding=encoding, hashes_as_bytes=encoding == "map")
    pub.attach(asyncio.get_running_loop())
    h.sub.start()
    try:
        await h.sync(probe(pub))
        pub.block_stored([1, 2, 3], None, 16)
        pub.block_stored([1, 2], None, 16, medium="CPU")
        pub.flush(drop=True)  # lost on the live stream: only the replay has it
        pub.block_removed([9])
        pub.block_stored([4], 3, 16)
        pub.flush()
        assert await until(lambda: depth(h.dev, [1, 2, 3, 4]) == 4)
        assert depth(h.off, [1, 2]) == 2
        c = h.sub.counters()
        assert c["gaps"] == 1 and c["replayed"] == 2 and c["replay_lost"] == 0
        assert (ROW, False) in h.stale_calls and c["stale_workers"] == 0
    finally:
        h.sub.stop()
        pub.close()


async def test_replay_from_a_hand_written_server_with_topic_frames(ctx, ipc_dir):
    """Replies in the `[b"", topic, seq, payload]` form, hand-built batches in both encodings."""
    loop = asyncio.get_running_loop()
    h = Harness(ctx, ipc_dir)
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(h.ev)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(h.rp)
    store: dict[int, bytes] = {}
    requests: list[int] = []

    def serve():
        while True:
            try:
                ident, _empty, start = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            requests.append(seq_from_bytes(start))
            for seq in sorted(store):
                if seq >= seq_from_bytes(start):
                    router.send_multipart([ident, b"", TOPIC.encode(), seq_to_bytes(seq), store[seq]])
            router.send_multipart([ident, b"", END_SEQ, b""])
        if router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            loop.call_soon(serve)

    loop.add_reader(router.getsockopt(zmq.FD), serve)
    seq = 0

    def live(payload: bytes) -> None:
        nonlocal seq
        store[seq] = payload
        pub.send_multipart([TOPIC.encode(), seq_to_bytes(seq), payload])
        seq += 1

    h.sub.start()
    try:
        await h.sync(lambda: live(enc([time.time(), [], 0])))
        requests.clear()
        # Two batches only the replay server has, then a live one: a gap of two.
        store[seq] = enc([1.0, [["BlockStored", [10, 20], None, [0] * 32, 16, None, "GPU"], ["BlockPinned", [10]]], 0])
        store[seq + 1] = enc(
            [
                2.0,
                [
                    {
                        "type": "BlockRemoved",
                        "block_hashes": [(20).to_bytes(32, "big")],
                        "medium": "GPU",
                        "future_field": 1,
                    }
                ],
                0,
            ]
        )
        seq += 2
        live(
            enc(
                [
                    3.0,
                    [
                        {
                            "type": "BlockStored",
                            "block_hashes": [30],
                            "parent_block_hash": 20,
                            "token_ids": [0] * 16,
                            "block_size": 16,
                            "lora_id": None,
                            "medium": "GPU",
                            "lora_name": None,
                        }
                    ],
                    0,
                ]
            )
        )
        assert await until(lambda: depth(h.dev, [30]) == 1 and depth(h.dev, [10]) == 1)
        assert await until(lambda: not h.sub.applier.replay_pending(ROW))
        assert depth(h.dev, [20]) == 0 and depth(h.dev, [10, 20]) == 1
        c = h.sub.counters()
        assert requests == [seq - 3] and c["gaps"] == 1 and c["replayed"] == 2
        assert c["unknown_types"] == 1 and c["unknown_fields"] == 1 and c["malformed_frames"] == 0
    finally:
        h.sub.stop()
        loop.remove_reader(router.getsockopt(zmq.FD))
        router.close(0)
        pub.close(0)


async def test_restart_of_the_engine_clears_the_worker(ctx, ipc_dir):
    loop = asyncio.get_running_loop()
    h = Harness(ctx, ipc_dir)
    old = KvEventPublisher(ctx, h.ev, h.rp, topic=TOPIC, first_seq=1000)  # a long-running engine
    old.attach(loop)
    h.sub.start()
    new = None
    try:
        await h.sync(probe(old))
        old.block_stored([1, 2], None, 16)
        old.flush()
        assert await until(lambda: depth(h.dev, [1, 2]) == 2)
        old.close()
        new = KvEventPublisher(ctx, h.ev, h.rp, topic=TOPIC)  # the restarted engine: seq from 0 again
        new.attach(loop)
        await h.sync(probe(new))
        new.block_stored([7], None, 16)
        new.flush()
        assert await until(lambda: depth(h.dev, [7]) == 1)
        assert depth(h.dev, [1]) == 0 and h.sub.counters()["restarts"] == 1
    finally:
        h.sub.stop()
        old.close()
        if new is not None:
            new.close()


async def test_all_blocks_cleared_over_the_wire(ctx, ipc_dir):
    h = Harness(ctx, ipc_dir)
    pub = KvEventPublisher(ctx, h.ev, h.rp, topic=TOPIC, encoding="map")
    pub.attach(asyncio.get_running_loop())
    h.sub.start()
    try:
        await h.sync(probe(pub))
        pub.block_stored([5, 6], None, 16)
        pub.block_stored([5], None, 16, medium="CPU")
        pub.flush()
        assert await until(lambda: depth(h.dev, [5, 6]) == 2 and depth(h.off, [5]) == 1)
        pub.all_cleared()
        pub.flush()
        assert await until(lambda: depth(h.dev, [5]) == 0 and depth(h.off, [5]) == 0)
    finally:
        h.sub.stop()
        pub.close()


async def test_silence_never_marks_the_worker_stale(ctx, ipc_dir):
    """An idle engine publishes nothing: a connected, silent stream stays fresh past its limit."""
    h = Harness(ctx, ipc_dir, stale_after_s=0.3)
    pub = KvEventPublisher(ctx, h.ev, h.rp, topic=TOPIC)
    pub.attach(asyncio.get_running_loop())
    h.sub.start()
    try:
        assert h.stale_calls == [(ROW, False)]  # not connected yet: stale only if that lasts
        await h.sync(probe(pub))
        await asyncio.sleep(1.5)  # five times the limit without a batch
        assert h.stale_calls == [(ROW, False)] and h.sub.counters()["stale_workers"] == 0
    finally:
        h.sub.stop()
        pub.close()


async def test_no_connection_since_the_start_marks_the_worker_stale_until_a_handshake(ctx, ipc_dir):
    h = Harness(ctx, ipc_dir, stale_after_s=0.3)
    h.sub.start()
    pub = None
    try:
        assert await until(lambda: h.stale_calls[-1] == (ROW, True))
        assert h.sub.counters()["stale_workers"] == 1
        pub = KvEventPublisher(ctx, h.ev, h.rp, topic=TOPIC)  # the engine comes up, publishes nothing
        pub.attach(asyncio.get_running_loop())
        assert await until(lambda: h.stale_calls[-1] == (ROW, False))
    finally:
        h.sub.stop()
        if pub is not None:
            pub.close()


async def test_a_disconnect_lasting_the_limit_marks_the_worker_stale_and_a_reconnect_ends_it(ctx, ipc_dir):
    loop = asyncio.get_running_loop()
    h = Harness(ctx, ipc_dir, stale_after_s=0.3)
    pub = KvEventPublisher(ctx, h.ev, h.rp, topic=TOPIC)
    pub.attach(loop)
    h.sub.start()
    again = None
    try:
        await h.sync(probe(pub))
        assert h.stale_calls == [(ROW, False)]
        pub.close()
        assert await until(lambda: h.stale_calls[-1] == (ROW, True))
        assert h.sub.counters()["disconnects"] >= 1
        again = KvEventPublisher(ctx, h.ev, h.rp, topic=TOPIC)  # back, and idle
        again.attach(loop)
        assert await until(lambda: h.stale_calls[-1] == (ROW, False))
    finally:
        h.sub.stop()
        pub.close()
        if again is not None:
            again.close()


async def test_a_gap_replay_cannot_fill_marks_the_worker_stale_until_the_engine_clears_its_cache(ctx, ipc_dir):
    h = Harness(ctx, ipc_dir, stale_after_s=0.3, replay_timeout_s=0.1, replay_retries=0)
    pub = KvEventPublisher(ctx, h.ev, None, topic=TOPIC)  # no replay service: a gap stays unfilled
    h.sub.start()
    try:
        await h.sync(probe(pub))
        pub.block_removed([1])
        pub.flush(drop=True)
        pub.block_stored([2], None, 16)
        pub.flush()
        assert await until(lambda: depth(h.dev, [2]) == 1)
        assert await until(lambda: h.stale_calls[-1] == (ROW, True))
        assert h.sub.counters()["replay_lost"] >= 1
        pub.all_cleared()  # the index is exact again from here
        pub.flush()
        ok = await until(lambda: h.stale_calls[-1] == (ROW, False))
        assert ok, (h.sub.applier.stream(ROW), h.stale_calls, h.sub.streams[0].health, h.sub.counters())
        await asyncio.sleep(1.0)  # then silent: it stays fresh
        assert h.stale_calls[-1] == (ROW, False) and h.sub.counters()["stale_workers"] == 0
    finally:
        h.sub.stop()
        pub.close()


class SplitPublisher:
    """A vLLM-format publisher whose PUB socket can go away and come back while its replay ROUTER
    (and ring buffer) stays: batches published while nobody is connected reach only the buffer."""

    def __init__(self, ctx, ev: str, rp: str) -> None:
        self.ctx, self.ev, self.seq, self.store = ctx, ev, 0, {}
        self.pub = None
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(rp)
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.router.getsockopt(zmq.FD), self.serve)
        self.open()

    def open(self) -> None:
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(self.ev)

    def close_pub(self) -> None:
        self.pub.close(0)
        self.pub = None

    def publish(self, events: list) -> None:
        payload = enc([time.time(), events, 0])
        self.store[self.seq] = payload
        if self.pub is not None:
            self.pub.send_multipart([TOPIC.encode(), seq_to_bytes(self.seq), payload])
        self.seq += 1

    def serve(self) -> None:
        while True:
            try:
                ident, _empty, start = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            for seq in sorted(self.store):
                if seq >= seq_from_bytes(start):
                    self.router.send_multipart([ident, b"", seq_to_bytes(seq), self.store[seq]])
            self.router.send_multipart([ident, b"", END_SEQ, b""])
        if self.router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self.loop.call_soon(self.serve)

    def close(self) -> None:
        self.loop.remove_reader(self.router.getsockopt(zmq.FD))
        self.router.close(0)
        if self.pub is not None:
            self.pub.close(0)


async def test_batches_published_while_disconnected_are_replayed_on_reconnect_without_a_later_batch(ctx, ipc_dir):
    """1. the engine stores block 1 (applied live), 2. its PUB goes away; meanwhile it stores 2 and
    removes 1 (only its ring buffer has those), 3. the PUB comes back and the engine stays idle.
    Result: the reconnect's catch-up replay applies both; nothing waited for a live batch."""
    h = Harness(ctx, ipc_dir)
    pub = SplitPublisher(ctx, h.ev, h.rp)
    h.sub.start()
    try:
        await h.sync(lambda: pub.publish([]))
        pub.publish([["BlockStored", [1], None, [0] * 16, 16, None, "GPU"]])
        assert await until(lambda: depth(h.dev, [1]) == 1)
        pub.close_pub()
        assert await until(lambda: h.sub.counters()["disconnects"] >= 1)
        pub.publish([["BlockStored", [2], None, [0] * 16, 16, None, "GPU"]])
        pub.publish([["BlockRemoved", [1], "GPU"]])
        pub.open()
        assert await until(lambda: depth(h.dev, [2]) == 1 and depth(h.dev, [1]) == 0)
        assert h.sub.counters()["restarts"] == 0 and h.last_seq() == pub.seq - 1
    finally:
        h.sub.stop()
        pub.close()


async def test_an_engine_that_restarted_while_disconnected_is_forgotten_on_reconnect_while_idle(ctx, ipc_dir):
    """The publisher that comes back no longer holds the last applied seq (its seqs start again at 0,
    and it published nothing yet): its worker's entries are cleared without waiting for a batch."""
    loop = asyncio.get_running_loop()
    h = Harness(ctx, ipc_dir)
    old = KvEventPublisher(ctx, h.ev, h.rp, topic=TOPIC)
    old.attach(loop)
    h.sub.start()
    new = None
    try:
        await h.sync(probe(old))
        old.block_stored([1, 2], None, 16)
        old.flush()
        assert await until(lambda: depth(h.dev, [1, 2]) == 2)
        old.close()
        new = KvEventPublisher(ctx, h.ev, h.rp, topic=TOPIC)  # restarted, idle
        new.attach(loop)
        assert await until(lambda: depth(h.dev, [1]) == 0)
        assert h.sub.counters()["restarts"] == 1 and h.stale_calls[-1] == (ROW, False)
    finally:
        h.sub.stop()
        old.close()
        if new is not None:
            new.close()


async def test_unanswered_replay_is_retried_then_given_up(ctx, ipc_dir):
    h = Harness(ctx, ipc_dir, replay_timeout_s=0.1, replay_retries=1)
    pub = KvEventPublisher(ctx, h.ev, None, topic=TOPIC)  # no replay service
    mute = ctx.socket(zmq.ROUTER)  # accepts requests, never answers
    mute.setsockopt(zmq.LINGER, 0)
    mute.bind(h.rp)
    h.sub.start()
    try:
        await h.sync(probe(pub))  # waits until a first-contact replay (if any) gave up
        before = h.sub.counters()
        pub.block_stored([2], None, 16)
        pub.flush(drop=True)  # a gap nobody can fill
        pub.block_stored([3], None, 16)
        pub.flush()
        assert await until(lambda: depth(h.dev, [3]) == 1)
        assert await until(lambda: not h.sub.applier.replay_pending(ROW))
        after = h.sub.counters()
        assert after["gaps"] == before["gaps"] + 1
        assert after["replay_requests"] == before["replay_requests"] + 2  # first try + one retry
        assert after["replay_lost"] == before["replay_lost"] + 1 and depth(h.dev, [2]) == 0
    finally:
        h.sub.stop()
        mute.close(0)
        pub.close()


def test_sources_for_worker_offsets_ports_by_dp_rank():
    w = WorkerConfig(
        worker_id=3,
        dp_size=2,
        kv_events_endpoint="tcp://10.0.0.5:5557",
        kv_replay_endpoint="tcp://10.0.0.5:6557",
        kv_events_topic="kv",
    )
    assert sources_for_worker(w, {0: 4, 1: 5}) == [
        KvEventSource(4, "tcp://10.0.0.5:5557", "tcp://10.0.0.5:6557", "kv", 30.0),
        KvEventSource(5, "tcp://10.0.0.5:5558", "tcp://10.0.0.5:6558", "kv", 30.0),
    ]
    assert sources_for_worker(WorkerConfig(worker_id=1), {0: 0}) == []


async def test_sources_added_and_removed_at_runtime(ctx, ipc_dir):
    h = Harness(ctx, ipc_dir)
    src = h.sub.streams[0].src
    h.sub.remove_source(ROW)  # before start: nothing open yet
    assert h.sub.streams == []
    pub = KvEventPublisher(ctx, h.ev, h.rp, topic=TOPIC)
    pub.attach(asyncio.get_running_loop())
    h.sub.start()
    try:
        h.sub.add_source(src)
        assert h.stale_calls == [(ROW, False)]  # not connected yet: stale only if that lasts
        with pytest.raises(ValueError):
            h.sub.add_source(src)
        await h.sync(probe(pub))
        pub.block_stored([11, 12], None, 16)
        pub.flush()
        assert await until(lambda: depth(h.dev, [11, 12]) == 2)
        h.sub.remove_source(ROW)
        assert depth(h.dev, [11]) == 0 and h.sub.streams == []
    finally:
        h.sub.stop()
        h.sub.stop()  # idempotent
        pub.close()
