"""`protocol/walk.py` against msgspec's own encoder: the iterative walk finds exactly the bytes of each
value, for any nesting, and refuses cut-short input (property tests, hypothesis)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched import protocol as p
from kvsched.protocol.walk import array_elements, batch_frames, skip, tag_of

enc = msgspec.msgpack.encode

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=300)
    | st.binary(max_size=70_000)
    | st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=300))
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=10), inner, max_size=8),
    max_leaves=60,
)


@settings(max_examples=300, deadline=None)
@given(values)
def test_skip_ends_exactly_where_the_encoded_value_ends(v):
    raw = enc(v)
    assert skip(raw, 0) == len(raw)
    assert skip(b"\x01" + raw + b"\x02", 1) == len(raw) + 1  # from an offset, ignoring what follows


@settings(max_examples=300, deadline=None)
@given(st.lists(values, max_size=20))
def test_array_elements_are_the_elements_own_encodings(items):
    raw = enc(items)
    assert [bytes(e) for e in array_elements(raw)] == [enc(x) for x in items]
    assert [bytes(e) for e in array_elements(raw, first=2)] == [enc(x) for x in items[:2]]


@settings(max_examples=200, deadline=None)
@given(values, st.data())
def test_cut_short_input_is_a_value_error(v, data):
    raw = enc([v, v])
    cut = data.draw(st.integers(1, len(raw) - 1))
    with pytest.raises(ValueError):
        array_elements(raw[:cut])


def test_nesting_far_past_msgspecs_depth_limit_is_walked():
    deep = b"\x91" * 50_000 + b"\xc0"
    with pytest.raises(RecursionError):
        msgspec.msgpack.decode(deep)
    assert skip(deep, 0) == len(deep)


def test_batch_frames_splits_a_batch_and_refuses_anything_else():
    frames = [enc(["heartbeat", 1]), b"\x91" * 5_000 + b"\xc0", enc(["release", "r"])]
    assert batch_frames(p.encode_batch(frames), 10) == frames
    assert batch_frames(p.encode_batch(frames), 2) is None  # over the cap
    assert batch_frames(enc(["replies", [1]]), 10) is None
    assert batch_frames(enc(["batch", [1], 2]), 10) is None
    assert batch_frames(b"\xc1", 10) is None and batch_frames(b"", 10) is None
    assert tag_of(enc(["enqueue", "r"])) == "enqueue" and tag_of(b"\x92\x01") is None


def test_a_walk_past_its_value_budget_gives_up_and_the_batch_is_answered_whole():
    """A 1 MiB frame of nested arrays is 1M values (0.12 s of Python per pass, measured): a peer could
    stall the actor with one such batch per message. The walk stops at `MAX_WALK_VALUES` and
    `batch_frames` answers None (the message then gets one Error, as msgspec's own failure does)."""
    from kvsched.protocol.walk import MAX_WALK_VALUES

    small = b"\x91" * 2_000 + b"\xc0"
    big = b"\x91" * (MAX_WALK_VALUES + 10) + b"\xc0"
    ok = enc(["heartbeat", 1])
    assert batch_frames(p.encode_batch([small, ok]), 10) == [small, ok]
    assert batch_frames(p.encode_batch([big, ok]), 10) is None
    with pytest.raises(ValueError, match="values to walk"):
        skip(big, 0, [MAX_WALK_VALUES])
    assert tag_of(enc([["deep"], "r"])) is None  # a tag is one value
