"""Protocol version 2 framing: `Batch` / `Replies` bytes, their inner decoders, appended fields."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched import protocol as p

ENC = p.make_encoder()
INNER = [
    p.Enqueue("r1", 100, p.hashes_to_bytes([1, 2])),
    p.Update("r1", 5, 7, "requeue"),
    p.Release("r1", 5, 7, "completed", 142),
    p.Heartbeat(3),
    p.Reattach([p.LeaseRef("r1", 5, 7)], []),
]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(range(len(INNER))), max_size=70))
def test_encode_batch_equals_msgspec_encoding_and_decodes_in_order(picks):
    raws = [ENC.encode(INNER[i]) for i in picks]
    wire = p.encode_batch(raws)
    assert wire == ENC.encode(p.Batch([msgspec.Raw(r) for r in raws]))  # fixarray, array16 headers
    batch = p.make_router_decoder().decode(wire)
    inner = p.make_batched_router_decoder()
    assert [inner.decode(r) for r in batch.frames] == [INNER[i] for i in picks]


def test_encode_replies_equals_msgspec_encoding_when_array16():
    raws = [ENC.encode(p.HeartbeatAck(i)) for i in range(300)]
    wire = p.encode_replies(raws)
    assert wire == ENC.encode(p.Replies([msgspec.Raw(r) for r in raws]))
    got = p.make_daemon_decoder().decode(wire)
    assert [p.make_replied_daemon_decoder().decode(r).seq for r in got.frames] == list(range(300))


def test_batch_may_not_carry_hello_or_batch():
    inner = p.make_batched_router_decoder()
    for frame in (p.Hello(2), p.Batch([])):
        try:
            inner.decode(ENC.encode(frame))
        except msgspec.ValidationError:
            continue
        raise AssertionError(f"{type(frame).__name__} decoded inside a batch")


def test_version_1_bytes_decode_with_appended_defaults():
    v1_welcome = ENC.encode(["welcome", 1, 1, 1, 16, "l", "p", 1000, 5000])
    assert p.make_daemon_decoder().decode(v1_welcome).max_frame_bytes == 0
    assert p.make_daemon_decoder().decode(ENC.encode(["error", 1, "bad"])).batch_index is None
    assert p.peek_request_id(ENC.encode(["enqueue", "rid-9", -5])) == "rid-9"
    assert p.peek_request_id(b"\xc1") is None
