"""Golden vLLM KV-event frames, written by hand as raw MessagePack in both encodings (docs/DESIGN.md §6.1)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvsched.kvevents.format import (
    END_SEQ,
    Cleared,
    KvEventFormatError,
    Removed,
    Stored,
    block_key,
    decode_batch,
    normalize_hash,
    offset_endpoint,
    seq_from_bytes,
    seq_to_bytes,
)

enc = msgspec.msgpack.encode
BIG = 0xFEDC_BA98_7654_3210  # > 2**63: must survive as u64


def keys(ev) -> list[int]:
    return [int(k) for k in ev.keys]


def test_array_encoding_golden_batch_decodes_all_three_events():
    # vLLM <= 0.10-ish: BlockStored(block_hashes, parent, token_ids, block_size, lora_id) only.
    payload = enc(
        [
            1714000000.25,
            [
                ["BlockStored", [1, 2, BIG], None, list(range(48)), 16, None],
                ["BlockRemoved", [2]],
                ["AllBlocksCleared"],
            ],
            0,
        ]
    )
    b = decode_batch(payload)
    assert b.ts == 1714000000.25 and b.dp_rank == 0
    assert [type(e) for e in b.events] == [Stored, Removed, Cleared]
    st, rm = b.events[0], b.events[1]
    assert keys(st) == [1, 2, BIG] and st.keys.dtype == np.uint64
    assert st.parent_key is None and st.block_size == 16 and st.medium is None and st.device
    assert keys(rm) == [2] and rm.device
    assert (b.unknown_types, b.unknown_fields, b.malformed) == (0, 0, 0)


def test_array_encoding_with_every_field_up_to_sliding_window():
    ev = [
        "BlockStored",
        [10, 11],
        9,
        list(range(32)),
        16,
        3,
        "CPU",
        "adapter",
        [None, ["salt"]],
        0,
        "full_attention",
        None,
    ]
    b = decode_batch(enc([1.0, [ev, ["BlockRemoved", [10], "CPU", 0]], 1]))
    st, rm = b.events
    assert keys(st) == [10, 11] and st.parent_key == 9 and st.medium == "CPU" and not st.device
    assert keys(rm) == [10] and rm.medium == "CPU" and not rm.device
    assert b.unknown_fields == 0 and b.dp_rank == 1


def test_map_encoding_golden_batch_missing_keys_mean_none():
    payload = enc(
        [
            2.5,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [5, 6],
                    "parent_block_hash": 4,
                    "token_ids": [1] * 32,
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                },
                {"type": "BlockStored", "block_hashes": [7], "token_ids": [2] * 16, "block_size": 16},
                {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
            ],
            3,
        ]
    )
    b = decode_batch(payload)
    a, c, rm, cl = b.events
    assert keys(a) == [5, 6] and a.parent_key == 4 and a.device and a.group_idx == 0
    assert keys(c) == [7] and c.parent_key is None and c.medium is None
    assert isinstance(rm, Removed) and keys(rm) == [5] and isinstance(cl, Cleared)
    assert b.dp_rank == 3 and b.unknown_fields == 0


def test_batch_as_map_and_without_dp_rank():
    b = decode_batch(enc({"ts": 3.0, "events": [["AllBlocksCleared"]]}))
    assert b.dp_rank is None and isinstance(b.events[0], Cleared)
    b = decode_batch(enc([3.0, [["AllBlocksCleared"]]]))  # trailing default omitted
    assert b.dp_rank is None and len(b.events) == 1


def test_bytes_hashes_map_to_low_64_bits_big_endian():
    digest = bytes(range(32))  # a 32-byte sha256-like digest
    low = int.from_bytes(digest[-8:], "big")
    payload = enc(
        [
            0.0,
            [
                ["BlockStored", [digest, b"\x00" * 24 + BIG.to_bytes(8, "big")], digest, [], 16, None, "GPU"],
                {"type": "BlockRemoved", "block_hashes": [digest], "medium": "GPU"},
            ],
            0,
        ]
    )
    b = decode_batch(payload)
    assert keys(b.events[0]) == [low, BIG] and b.events[0].parent_key == low
    assert keys(b.events[1]) == [low]
    assert normalize_hash(b"\x01\x02") == 0x0102
    assert normalize_hash(-1) == (1 << 64) - 1  # i64 producers


def test_unknown_types_and_fields_are_skipped_and_counted_without_losing_the_batch():
    payload = enc(
        [
            0.0,
            [
                ["BlockStored", [1], None, [], 16, None, "GPU", None, None, 0, None, None, "future-1", "future-2"],
                ["BlockPinned", [1, 2]],  # unknown type, array form
                {"type": "BlockTouched", "block_hashes": [3]},  # unknown type, map form
                {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "metadata": {"x": 1}},
                {"type": "BlockStored", "block_hashes": "oops", "token_ids": []},  # malformed
                ["BlockStored", [2], None, [], 16, None, "GPU"],
                42,  # not an event at all
            ],
            0,
            "extra-batch-field",
        ]
    )
    b = decode_batch(payload)
    assert [type(e) for e in b.events] == [Stored, Removed, Stored]
    assert keys(b.events[2]) == [2]
    assert b.unknown_types == 2
    assert b.unknown_fields == 2 + 1 + 1  # two extra positions, one map key, one batch position
    assert b.malformed == 2


def test_group_idx_zero_keeps_the_hash_and_nonzero_groups_are_mixed():
    b = decode_batch(
        enc(
            [
                0.0,
                [
                    {"type": "BlockStored", "block_hashes": [77], "token_ids": [], "block_size": 16, "group_idx": 0},
                    {"type": "BlockStored", "block_hashes": [77], "token_ids": [], "block_size": 16, "group_idx": 1},
                    {"type": "BlockRemoved", "block_hashes": [77], "group_idx": 2},
                ],
                0,
            ]
        )
    )
    g0, g1, g2 = (keys(e)[0] for e in b.events)
    assert g0 == 77 == block_key(77, None)
    assert g1 == block_key(77, 1) and g2 == block_key(77, 2)
    assert len({g0, g1, g2}) == 3 and all(0 <= g < 1 << 64 for g in (g1, g2))


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", enc("text"), enc([1.0]), enc([True, []]), enc({"ts": 1.0}), b"\x92\x01" + b"\x91" * 200_000 + b"\xc0"],
)  # nested deeper than recursion
def test_payload_that_is_not_a_batch_raises_format_error(payload):
    with pytest.raises(KvEventFormatError):
        decode_batch(payload)


def test_seq_bytes_and_end_marker():
    assert seq_to_bytes(5) == b"\x00" * 7 + b"\x05"
    assert END_SEQ == b"\xff" * 8 and seq_from_bytes(END_SEQ, signed=True) == -1
    assert seq_from_bytes(END_SEQ) == (1 << 64) - 1
    with pytest.raises(ValueError):
        seq_from_bytes(b"\x00")


def test_offset_endpoint_by_dp_rank():
    assert offset_endpoint("tcp://10.0.0.5:5557", 0) == "tcp://10.0.0.5:5557"
    assert offset_endpoint("tcp://10.0.0.5:5557", 3) == "tcp://10.0.0.5:5560"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint("ipc:///run/e.sock", 2) == "ipc:///run/e.sock_dp2"
    with pytest.raises(ValueError):
        offset_endpoint("tcp://host", 1)


def test_a_block_stored_over_the_per_event_cap_is_malformed_and_cheap():
    """Found from outside: one BlockStored of 6.5M hashes stalled the daemon's actor loop for 6.7 s
    (each hash is normalised in Python). Result: an event with more than `MAX_EVENT_BLOCKS` hashes is
    counted malformed without touching its hashes, and the batch's other events are kept."""
    from kvsched.kvevents.format import MAX_EVENT_BLOCKS, decode_batch

    huge = list(range(2**40, 2**40 + 2_000_000))
    payload = enc([1.0, [["BlockStored", huge, None, [], 16, None], ["BlockStored", [5, 6], None, [], 16, None]], 0])
    assert len(huge) > MAX_EVENT_BLOCKS
    batch = decode_batch(payload)
    assert batch.malformed == 1 and len(batch.events) == 1
    assert batch.events[0].keys.tolist() == [5, 6]


def test_a_batch_over_the_per_batch_hash_budget_keeps_its_first_events_and_skips_the_rest():
    """The per-event cap alone still let one message of many capped events (up to the 64 MiB socket
    cap: ~7M hashes) stall the loop. Result: once a batch's events hold `MAX_BATCH_BLOCKS` hashes, the
    later events with hashes are counted malformed unread; hash-less events (AllBlocksCleared) are kept."""
    from kvsched.kvevents.format import MAX_BATCH_BLOCKS, MAX_EVENT_BLOCKS, decode_batch

    per = MAX_EVENT_BLOCKS
    n = MAX_BATCH_BLOCKS // per + 3
    events = [
        ["BlockStored", list(range(2**40 + i * per, 2**40 + (i + 1) * per)), None, [], 16, None] for i in range(n)
    ]
    events.append(["AllBlocksCleared"])
    batch = decode_batch(enc([1.0, events, 0]))
    kept = MAX_BATCH_BLOCKS // per
    assert batch.malformed == n - kept and len(batch.events) == kept + 1
    assert isinstance(batch.events[-1], Cleared)
