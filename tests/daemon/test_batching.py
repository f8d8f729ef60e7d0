"""Protocol version 2 against a real daemon: `Batch` in, `Replies` out, per-frame errors with
`batch_index`, the in-flight cap counting inner frames; version-1 peers keep one frame per message;
the client coalesces a loop turn into one `Batch` and falls back to version 1 when refused."""

from __future__ import annotations

import asyncio
import threading
import urllib.request

import pytest
import zmq

from kvsched import protocol as p
from kvsched.client import AdminClient, SchedulerClient
from tests.conftest import RawPeer, free_port, purge, start_daemon, wait_until

pytestmark = pytest.mark.timeout(120)

CONFIG = """
[daemon]
block_size = 16
liveness_timeout_ms = 3000
heartbeat_ms = 200
inflight_cap_per_connection = 3
metrics_port = {port}

[[workers]]
worker_id = 1
total_kv_blocks = 1000
max_num_batched_tokens = 1000

[[classes]]
name = "default"
prefill_busy_threshold = 1000
"""
ENC = p.make_encoder()


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def active_leases(admin_endpoint: str) -> int:
    with AdminClient(admin_endpoint) as admin:
        return admin.call(p.Status()).active_leases


@pytest.fixture
def daemon(tmp_path):
    port = free_port()
    d = start_daemon(tmp_path, CONFIG.format(port=port))
    d.port = port
    yield d
    d.stop()
    purge(d.instance)


def test_v2_batch_is_handled_in_order_and_answered_in_one_replies_message(daemon):
    with RawPeer(daemon.endpoint) as peer:
        peer.send(p.Hello(2, "v2"))
        welcome = peer.recv()
        assert isinstance(welcome, p.Welcome) and welcome.protocol_max == 2
        assert welcome.max_frame_bytes == 1 << 20
        frames = [
            ENC.encode(p.Enqueue("b-1", 100)),
            ENC.encode({"no": "frame"}),  # MessagePack, but not a router frame
            ENC.encode(["enqueue", "b-bad", -5]),  # out of bounds, its id readable
            ENC.encode(p.Hello(2)),  # Hello is not allowed inside a batch
            ENC.encode(p.Enqueue("b-2", 100)),
            ENC.encode(p.Heartbeat(7)),
        ]
        before = peer.messages
        peer.send(p.encode_batch(frames))
        got = [peer.recv() for _ in range(6)]
        assert peer.messages == before + 1  # everything the wake owed, in one message
        assert [type(f).__name__ for f in got] == ["Admitted", "Error", "Error", "Error", "Admitted", "HeartbeatAck"]
        assert [f.batch_index for f in got[1:4]] == [1, 2, 3]
        assert got[2].request_id == "b-bad" and got[1].request_id is None
        assert (got[0].request_id, got[4].request_id, got[5].seq) == ("b-1", "b-2", 7)
        peer.send(p.encode_batch([ENC.encode(p.Heartbeat(8))])[:-1])  # truncated: not MessagePack at all
        whole = peer.recv()
        assert isinstance(whole, p.Error) and whole.code == p.ErrorCode.MALFORMED and whole.batch_index is None
        peer.send(
            p.encode_batch(
                [
                    ENC.encode(p.Release("b-1", got[0].slot, got[0].generation)),
                    ENC.encode(p.Release("b-2", got[4].slot, got[4].generation)),
                ]
            )
        )
        assert wait_until(lambda: active_leases(daemon.admin_endpoint) == 0)
        assert peer.recv(timeout_s=0.2) is None  # releases are not answered
    # The daemon writes its frame tally to Prometheus every ~100 ms of its own loop (a loaded machine
    # can hold that loop back longer than the 0.2 s above): wait until the last batch is counted.
    frames = 1 + 6 + 1 + 2  # inner frames counted
    assert wait_until(lambda: metric(daemon.port, "kvsched_frames_received_total") >= frames)
    assert metric(daemon.port, "kvsched_frames_received_total") == frames
    assert metric(daemon.port, "kvsched_batches_received_total") == 2


def test_inflight_cap_counts_frames_inside_a_batch(daemon):
    with RawPeer(daemon.endpoint) as peer:
        peer.hello(version=2)
        peer.send(p.encode_batch([ENC.encode(p.Enqueue(f"c-{i}", 1200)) for i in range(5)]))
        got = [peer.recv() for _ in range(2)]
        # c-0 runs (1200 prefill tokens: the worker is busy); c-1, c-2, c-3 wait: 3 outstanding, the cap
        assert [type(f).__name__ for f in got] == ["Admitted", "Rejected"]
        assert (got[0].request_id, got[1].request_id, got[1].reason) == ("c-0", "c-4", "overloaded")
        assert peer.recv(timeout_s=0.3) is None


def test_v1_peer_gets_one_frame_per_message_and_batch_refused(daemon):
    with RawPeer(daemon.endpoint) as peer:
        peer.hello(version=1)
        peer.send(ENC.encode(p.Enqueue("v1-a", 100)))
        peer.send(ENC.encode(p.Heartbeat(1)))
        peer.send(ENC.encode(p.Heartbeat(2)))
        before = peer.messages
        got = [peer.recv() for _ in range(3)]
        assert peer.messages == before + 3 and not peer.unread  # never a Replies
        assert isinstance(got[0], p.Admitted) and [f.seq for f in got[1:]] == [1, 2]
        peer.send(p.encode_batch([ENC.encode(p.Heartbeat(3))]))
        err = peer.recv()
        assert isinstance(err, p.Error) and err.code == p.ErrorCode.MALFORMED and "version 2" in err.message
        peer.send(p.Release("v1-a", got[0].slot, got[0].generation))
        assert wait_until(lambda: active_leases(daemon.admin_endpoint) == 0)


@pytest.mark.parametrize("version", [1, 2])
async def test_client_lifecycles_work_at_each_protocol_version(daemon, version):
    async with SchedulerClient(daemon.endpoint, client_name=f"v{version}", protocol_version=version) as client:
        assert client._link.version == version and client._link.batching == (version == 2)

        async def one(i: int) -> None:
            lease = await client.schedule(f"cv{version}-{i}", isl_tokens=32, block_hashes=[i, i + 1])
            async with lease:
                lease.dispatched()
                lease.prefill_done()
                lease.add_output_tokens(4)

        await asyncio.gather(*(one(i) for i in range(3)))  # under the in-flight cap of 3
        for k in range(4):
            await asyncio.gather(*(one(10 * (k + 1) + i) for i in range(3)))
    assert wait_until(lambda: active_leases(daemon.admin_endpoint) == 0)
    # The frame tally reaches Prometheus every ~100 ms of the daemon's loop (later on a loaded
    # machine): wait for it. Every Enqueue was answered, so Hello + 15 Enqueues are counted once a
    # write happened after them; their Batch messages are counted in the same write.
    if version == 2:  # three Enqueues of one loop turn go as one Batch
        assert wait_until(lambda: metric(daemon.port, "kvsched_batches_received_total") > 0)
    else:
        assert wait_until(lambda: metric(daemon.port, "kvsched_frames_received_total") >= 1 + 15)
        assert metric(daemon.port, "kvsched_batches_received_total") == 0


class _V1OnlyDaemon:
    """A ROUTER that answers Hello like a version-1 daemon: Error(VERSION) above 1, Welcome at 1."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.hellos: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        dec = p.make_router_decoder()
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, raw = self.sock.recv_multipart()
            frame = dec.decode(raw)
            if isinstance(frame, p.Hello):
                self.hellos.append(frame.protocol_version)
                reply = (
                    p.Welcome(1, 1, 1, 16, "kvsched-nope-ledger", "kvsched-nope-progress", 1000, 5000)
                    if frame.protocol_version == 1
                    else p.Error(int(p.ErrorCode.VERSION), f"protocol {frame.protocol_version} not in [1, 1]")
                )
                self.sock.send_multipart([ident, ENC.encode(reply)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


async def test_client_falls_back_to_version_1_when_daemon_refuses_version_2(tmp_path):
    fake = _V1OnlyDaemon(f"ipc://{tmp_path}/v1.sock")
    try:
        async with SchedulerClient(f"ipc://{tmp_path}/v1.sock", connect_timeout_s=10) as client:
            assert client.connected and client._link.version == 1 and not client._link.batching
        assert fake.hellos[:2] == [2, 1]
    finally:
        fake.close()


def test_reply_outbox_schedules_no_flush_callback_for_replies_of_a_wake():
    """Replies queued while the actor drains the data socket are flushed by the wake itself: no
    safety-net callback per wake. Outside a wake (timers, admin) one callback per batch of replies."""
    from kvsched.daemon.connections import Connection
    from kvsched.daemon.replies import ReplyOutbox

    scheduled = []
    sent = []

    class _Sock:
        def send(self, data, flags=0):
            sent.append(data)

    box = ReplyOutbox(_Sock(), 1 << 20, None, scheduled.append, lambda: None)
    a, b = Connection(identity=b"a", owner=1), Connection(identity=b"b", owner=2)
    box.in_wake = True
    box.add(a, b"x", None)
    box.add(b, b"y", None)
    assert scheduled == []
    assert box.flush() == [] and sent == [b"a", b"x", b"b", b"y"]
    box.in_wake = False
    box.add(a, b"z", None)
    box.add(b, b"w", None)
    assert len(scheduled) == 1
