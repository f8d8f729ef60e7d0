"""Every frame round-trips; hostile bytes fail at decode with msgspec errors, never anything else."""

from __future__ import annotations

import contextlib
import random

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched import protocol as p
from kvsched.hashing import hashes_from_bytes

ROUTER_FRAMES = [
    p.Hello(p.PROTOCOL_VERSION, "r", 123, "host"),
    p.Enqueue("r1", 100, p.hashes_to_bytes([1, 2, 3]), "batch", 2, 1, "s", 50, (3, 1), [3, 4], True, 500, "lora"),
    p.Update("r1", 5, 7, "prefill_done"),
    p.Update("r1", 5, 7, "progress", 42),
    p.Release("r1", 5, 7, "completed", 142),
    p.Release("r1"),
    p.Heartbeat(9),
    p.Reattach([p.LeaseRef("r1", 5, 7)], [p.Enqueue("r2", 10)]),
]
DAEMON_FRAMES = [
    p.Welcome(1, 1, 1, 16, "kvsched-x-ledger", "kvsched-x-progress", 1000, 5000),
    p.Admitted("r1", 3, 1, 5, 7, 2, 32, 1500),
    p.Rejected("r1", "queue_full", "limit", "batch", "requests", 10, 10),
    p.Error(int(p.ErrorCode.MALFORMED), "bad", None),
    p.HeartbeatAck(9),
    p.Reattached(["a"], ["b"]),
]
ADMIN_FRAMES = [
    p.Status(),
    p.Queues(policy_class="x"),
    p.Workers(),
    p.Leases(worker_id=1),
    p.Drain(worker_id=1),
    p.Undrain(worker_id=1, dp_rank=0),
    p.AddWorker(worker_id=4),
    p.RemoveWorker(worker_id=4),
    p.Cancel(request_id="r"),
    p.Reload(),
    p.Explain(request_id="r"),
]


@pytest.mark.parametrize("frame", ROUTER_FRAMES, ids=lambda f: type(f).__name__)
def test_router_frame_round_trips_when_encoded(frame):
    assert p.make_router_decoder().decode(p.make_encoder().encode(frame)) == frame


@pytest.mark.parametrize("frame", DAEMON_FRAMES, ids=lambda f: type(f).__name__)
def test_daemon_frame_round_trips_when_encoded(frame):
    assert p.make_daemon_decoder().decode(p.make_encoder().encode(frame)) == frame


@pytest.mark.parametrize("frame", ADMIN_FRAMES, ids=lambda f: type(f).__name__)
def test_admin_frame_round_trips_when_encoded(frame):
    raw = p.make_encoder().encode(frame)
    assert p.make_admin_request_decoder().decode(raw) == frame
    assert p.peek_admin_tag(raw)


def test_hashes_travel_as_little_endian_u64_when_given_ints_array_or_bytes():
    ints = [0, 1, 2**64 - 1]
    raw = p.hashes_to_bytes(ints)
    assert raw == b"".join(h.to_bytes(8, "little") for h in ints)
    assert p.hashes_to_bytes(np.array(ints, dtype=np.uint64)) == raw
    assert p.hashes_to_bytes(raw) == raw
    assert hashes_from_bytes(raw).tolist() == ints
    with pytest.raises(ValueError):
        p.hashes_to_bytes(b"123")
    with pytest.raises(ValueError):
        p.hashes_to_bytes([2**64])


@pytest.mark.parametrize(
    "bad, why",
    [
        ("abc", "not str"),  # before: ValueError "invalid literal for int() with base 10: 'a'"
        ([1, "a"], "elements must be integers, not str"),
        ([1.5], "elements must be integers, not float"),  # before: silently truncated to 1
        (5, "not int"),  # before: TypeError "'int' object is not iterable"
    ],
)
def test_malformed_block_hashes_raise_type_error_naming_the_argument(bad, why):
    """Found from outside: `schedule(..., block_hashes="abc")` raised a ValueError about int() that did
    not say which argument was wrong."""
    with pytest.raises(TypeError, match="block_hashes") as err:
        p.hashes_to_bytes(bad)
    assert why in str(err.value)


@pytest.mark.parametrize(
    "bad",
    [
        p.make_encoder().encode(["enqueue", "r", 0]),  # isl below 1
        p.make_encoder().encode(["enqueue", "x" * 200, 5]),  # request id too long
        p.make_encoder().encode(["update", "r", -1, 0, "progress"]),  # negative slot
        p.make_encoder().encode(["update", "r", 1, 2**40, "progress"]),  # generation past u32
        p.make_encoder().encode(["release", "r", 1, 1, "exploded"]),  # unknown outcome
        p.make_encoder().encode(["teleport", "r"]),  # unknown tag
        p.make_encoder().encode({"t": "status"}),  # admin frame on the data decoder
        b"\x9e\xa7enqueue",  # truncated
    ],
)
def test_hostile_frame_fails_decode_with_msgspec_error_when_out_of_bounds(bad):
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        p.make_router_decoder().decode(bad)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_never_raise_anything_but_msgspec_errors(raw):
    with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
        p.make_router_decoder().decode(raw)


def test_mutated_valid_frames_never_raise_anything_but_msgspec_errors():
    rng = random.Random(7)
    enc = p.make_encoder()
    dec = p.make_router_decoder()
    seeds = [enc.encode(f) for f in ROUTER_FRAMES]
    for _ in range(5000):
        raw = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        if rng.random() < 0.3:
            raw = raw[: rng.randrange(len(raw))]
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            dec.decode(bytes(raw))


def test_every_reject_reason_has_a_client_exception():
    from kvsched.errors import REJECTION_CLASSES

    assert set(p.REJECT_REASONS) == set(REJECTION_CLASSES)


def test_peeks_read_the_request_id_of_a_bad_frame_and_never_raise_on_deep_nesting():
    enc = p.make_encoder()
    bad_isl = enc.encode(["enqueue", "r-7", "ten"])
    assert p.peek_request_id(bad_isl) == "r-7"
    assert p.peek_request_id(enc.encode(["heartbeat", "x"])) is None  # no request id in this frame
    assert p.peek_request_id(enc.encode(["enqueue", "x" * 200, 1])) is None  # over the id bound
    deep = b"\x91" * 30_000 + b"\xc0"  # 30,000 nested one-element arrays
    assert p.peek_request_id(deep) is None
    assert p.peek_admin_tag(deep) is False
    nested_tail = b"\x93" + enc.encode("enqueue") + enc.encode("r-8") + deep  # [tag, id, [[[...]]]]
    assert p.peek_request_id(nested_tail) in ("r-8", None)  # read or not, never an exception


@pytest.mark.parametrize(
    "bad", [np.array([1.5, 2.0]), np.array([True, False]), np.array(["1", "2"]), np.zeros((2, 2), np.uint64)]
)
def test_hashes_to_bytes_refuses_arrays_it_would_truncate_or_flatten(bad):
    with pytest.raises((TypeError, ValueError), match="block_hashes"):
        p.hashes_to_bytes(bad)


def test_hashes_to_bytes_takes_signed_arrays_mod_2_64_like_kv_events():
    got = p.hashes_to_bytes(np.array([-1, 2], np.int64))
    assert got == np.array([2**64 - 1, 2], np.uint64).astype("<u8").tobytes()
    assert p.hashes_to_bytes(np.array([1, 2], ">u8")) == np.array([1, 2], "<u8").tobytes()
