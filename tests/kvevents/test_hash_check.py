"""The KV-event hash check: events built as vLLM builds them (sha256 over cbor2 canonical encodings,
published through a vLLM-format publisher in both encodings) against what routers compute."""

from __future__ import annotations

import hashlib

import cbor2
import pytest
import zmq

from kvsched import protocol as p
from kvsched.client import AdminClient
from kvsched.hashing import vllm_extra_keys
from kvsched.kvevents.format import decode_batch
from kvsched.kvevents.hash_check import HashCheck
from kvsched.sim.kv_publisher import KvEventPublisher
from tests.conftest import free_port, purge, start_daemon, wait_until


def vllm_chain(tokens: list[int], block_size: int, seed: str, extra=None) -> list[int]:
    """vLLM's sha256_cbor chain, written from its definition: NONE_HASH = sha256(cbor(seed)); block
    digest = sha256(cbor((parent digest, tuple(tokens), extra))); event hash = low 64 bits, big-endian."""
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    out = []
    for i in range(len(tokens) // block_size):
        key = (parent, tuple(tokens[i * block_size : (i + 1) * block_size]), None if extra is None else extra[i])
        parent = hashlib.sha256(cbor2.dumps(key, canonical=True)).digest()
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


def event_batch(encoding: str, tokens: list[int], block_size: int, seed: str, extra=None, parent=None) -> bytes:
    ctx = zmq.Context()
    pub = KvEventPublisher(ctx, "inproc://hc", encoding=encoding)
    try:
        pub.block_stored(
            vllm_chain(tokens, block_size, seed, extra), parent, block_size, token_ids=tokens, extra_keys=extra
        )
        pub.flush()
        return pub.buffer[-1][1]
    finally:
        pub.close()
        ctx.term()


TOKENS = list(range(1000, 1064))  # 4 blocks of 16


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_matching_seed_passes_and_another_pythonhashseed_is_flagged(encoding):
    check = HashCheck(hash_seed=None, block_size=16)
    assert check.observe(3, decode_batch(event_batch(encoding, TOKENS, 16, "vllm-none-hash")), 0) is None
    assert check.checked == 1 and not check.bad_rows
    bad = check.observe(3, decode_batch(event_batch(encoding, TOKENS, 16, "0")), 1_000_000)
    assert bad is not None and bad.row == 3 and bad.event_hash != bad.expected_hash
    assert bad.event_hash == vllm_chain(TOKENS, 16, "0")[0] and check.mismatches == 1 and 3 in check.bad_rows
    assert (
        HashCheck(hash_seed="0", block_size=16).observe(3, decode_batch(event_batch(encoding, TOKENS, 16, "0")), 0)
        is None
    )


def test_a_matching_event_clears_the_flag_and_checks_are_rate_limited():
    check = HashCheck(hash_seed="7", block_size=16, max_checks_per_s=10)
    assert check.observe(1, decode_batch(event_batch("array", TOKENS, 16, "8")), 0) is not None
    assert check.observe(1, decode_batch(event_batch("array", TOKENS, 16, "7")), 50_000) is None
    assert check.checked == 1 and 1 in check.bad_rows  # within 100 ms: not checked
    check.observe(1, decode_batch(event_batch("array", TOKENS, 16, "7")), 200_000)
    assert check.checked == 2 and not check.bad_rows


def test_other_block_size_is_a_mismatch_and_chained_events_are_not_checked():
    check = HashCheck(block_size=16)
    got = check.observe(0, decode_batch(event_batch("map", TOKENS, 32, "vllm-none-hash")), 0)
    assert got is not None and got.expected_hash == -1 and got.block_size == 32
    chained = HashCheck(block_size=16)
    assert chained.observe(0, decode_batch(event_batch("map", TOKENS, 16, "x", parent=12345)), 0) is None
    assert chained.checked == 0  # not first-of-chain: its tokens do not start a prefix


def test_extra_keys_carried_by_the_event_are_used_for_the_check():
    extra = vllm_extra_keys("0.33.0", 4, lora_name="ad", lora_path="/a", cache_salt="salt")
    check = HashCheck(block_size=16)
    assert check.observe(0, decode_batch(event_batch("map", TOKENS, 16, "vllm-none-hash", extra)), 0) is None
    assert check.checked == 1


async def test_daemon_flags_the_worker_whose_engine_hashes_differently(tmp_path):
    ports = [free_port() for _ in range(4)]
    d = start_daemon(
        tmp_path,
        f"""
[daemon]
block_size = 16

[[workers]]
worker_id = 1
kv_events_endpoint = "tcp://127.0.0.1:{ports[0]}"
kv_replay_endpoint = "tcp://127.0.0.1:{ports[1]}"

[[workers]]
worker_id = 2
kv_events_endpoint = "tcp://127.0.0.1:{ports[2]}"
kv_replay_endpoint = "tcp://127.0.0.1:{ports[3]}"
""",
    )
    ctx = zmq.Context()
    good = KvEventPublisher(ctx, f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}")
    bad = KvEventPublisher(ctx, f"tcp://127.0.0.1:{ports[2]}", f"tcp://127.0.0.1:{ports[3]}", encoding="map")

    def flags() -> dict[int, bool]:
        for pub, seed in ((good, "vllm-none-hash"), (bad, "1234")):
            pub.block_stored(vllm_chain(TOKENS, 16, seed), None, 16, token_ids=TOKENS)
            pub.flush()
        with AdminClient(d.admin_endpoint) as admin:
            return {w.worker_id: w.hash_mismatch for w in admin.call(p.Workers()).workers}

    try:
        assert wait_until(lambda: flags() == {1: False, 2: True}, timeout_s=20, interval_s=0.2)
        assert "differ from what routers send" in d.log_tail(200)
    finally:
        good.close()
        bad.close()
        ctx.term()
        d.stop()
        purge(d.instance)
