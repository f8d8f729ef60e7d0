"""Block hashing: golden vectors computed here, independently, from the documented recipes."""

from __future__ import annotations

import hashlib

import cbor2
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.hashing import block_hashes, canonical_cbor, vllm_none_hash

M64 = (1 << 64) - 1


def vllm_reference(tokens, block_size, seed, extra=None):
    """vLLM sha256_cbor chain, written from the description with hashlib + cbor2."""
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    out = []
    for i in range(len(tokens) // block_size):
        blk = tuple(tokens[i * block_size : (i + 1) * block_size])
        key = None if extra is None else extra[i]
        parent = hashlib.sha256(cbor2.dumps((parent, blk, key), canonical=True)).digest()
        out.append(int.from_bytes(parent, "big") & M64)
    return out


def test_vllm_mode_matches_golden_vectors_from_the_description():
    tokens = list(range(100, 150))  # 3 complete blocks of 16 + 2 tokens
    got = block_hashes(tokens, 16, mode="vllm", hash_seed="0")
    assert got.dtype == np.uint64 and len(got) == 3
    assert got.tolist() == vllm_reference(tokens, 16, "0")
    # PYTHONHASHSEED unset on recent vLLM: the fixed "vllm-none-hash" seed
    assert block_hashes(tokens, 16, mode="vllm").tolist() == vllm_reference(tokens, 16, "vllm-none-hash")
    assert vllm_none_hash("42") == hashlib.sha256(cbor2.dumps("42", canonical=True)).digest()


def test_vllm_mode_golden_literal_first_block():
    # Literal vector: the value is pinned so a change in the recipe is caught even if the helper drifts.
    seed_digest = hashlib.sha256(b"\x61\x30").digest()  # cbor("0") = 0x61 '0'
    msg = b"\x83\x58\x20" + seed_digest + b"\x84\x01\x02\x03\x18\x64" + b"\xf6"  # [bytes32, [1,2,3,100], null]
    expect = int.from_bytes(hashlib.sha256(msg).digest(), "big") & M64
    assert block_hashes([1, 2, 3, 100], 4, mode="vllm", hash_seed="0").tolist() == [expect]


def test_vllm_mode_with_extra_keys_per_block():
    tokens = list(range(64))
    extra = [("lora-a", "salt"), None, ("lora-a",), (("mm", 3),)]
    got = block_hashes(tokens, 16, mode="vllm", hash_seed="7", extra_keys=extra)
    assert got.tolist() == vllm_reference(tokens, 16, "7", extra)
    assert got.tolist() != block_hashes(tokens, 16, mode="vllm", hash_seed="7").tolist()
    with pytest.raises(ValueError):
        block_hashes(tokens, 16, mode="vllm", extra_keys=[None])


def xx_reference(tokens, block_size, seed=0):
    out, h = [], 0
    for i in range(len(tokens) // block_size):
        blk = b"".join(t.to_bytes(4, "little") for t in tokens[i * block_size : (i + 1) * block_size])
        h = xxhash.xxh64(h.to_bytes(8, "little") + blk, seed=seed).intdigest()
        out.append(h)
    return out


def test_xxhash_mode_matches_golden_vectors():
    tokens = [5, 70000, 3, 2**32 - 1] * 10  # 40 tokens: 2 blocks of 16, 8 left over
    assert block_hashes(tokens, 16).tolist() == xx_reference(tokens, 16)
    assert block_hashes(np.array(tokens, np.int64), 16, hash_seed=9).tolist() == xx_reference(tokens, 16, 9)
    s = xxhash.xxh64(b"pool-a").intdigest()
    assert block_hashes(tokens, 16, hash_seed="pool-a").tolist() == xx_reference(tokens, 16, s)


@pytest.mark.parametrize("mode", ["xxhash", "vllm"])
def test_chaining_and_partial_last_block_excluded(mode):
    a = list(range(50))
    b = list(range(50))
    b[20] = 999  # differs in block 1 only
    ha, hb = block_hashes(a, 16, mode=mode), block_hashes(b, 16, mode=mode)
    assert len(ha) == 3 and ha[0] == hb[0] and ha[1] != hb[1] and ha[2] != hb[2]  # chain carries the change
    assert block_hashes(a[:48], 16, mode=mode).tolist() == ha.tolist()  # the 2 extra tokens are ignored
    assert len(block_hashes(a[:15], 16, mode=mode)) == 0
    c = list(range(16, 32)) + list(range(16))  # same blocks, other order: not the same hashes
    assert block_hashes(c, 16, mode=mode)[1] != ha[0]


def test_bad_arguments():
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        block_hashes([1, 2], 1, mode="md5")
    with pytest.raises(ValueError):
        block_hashes([-1, 2], 1)
    with pytest.raises(TypeError):
        canonical_cbor({"a": 1})


cbor_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64 - 1)
    | st.binary(max_size=40)
    | st.text(max_size=20)
    | st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=5) | st.lists(inner, max_size=5).map(tuple),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(cbor_values)
def test_canonical_cbor_equals_cbor2(value):
    assert canonical_cbor(value) == cbor2.dumps(value, canonical=True)


def test_vllm_mode_every_cbor_integer_width_and_the_generic_path():
    tokens = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1]
    assert block_hashes(tokens, 4, mode="vllm", hash_seed="1").tolist() == vllm_reference(tokens, 4, "1")
    arr = np.array(tokens * 2, dtype=np.uint32)
    assert block_hashes(arr, 8, mode="vllm").tolist() == vllm_reference(tokens * 2, 8, "vllm-none-hash")
    odd = [2**40, -3, 5, 7]  # outside the fast path's range: generic CBOR
    assert block_hashes(odd, 2, mode="vllm").tolist() == vllm_reference(odd, 2, "vllm-none-hash")


def test_vllm_extra_keys_shapes_per_release():
    from kvsched.hashing import vllm_extra_keys

    assert vllm_extra_keys("0.33.0", 3) is None
    assert vllm_extra_keys("0.11.0", 2, lora_int_id=7, cache_salt="s") == [(7, "s"), (7,)]
    assert vllm_extra_keys("0.20.1", 2, lora_name="ad", cache_salt="s") == [("ad", "s"), ("ad",)]
    assert vllm_extra_keys("0.20.1", 2, cache_salt="s") == [("s",), None]
    assert vllm_extra_keys("v0.33.0", 2, lora_name="ad", lora_path="/l", cache_salt="s") == [
        (("lora", "ad", "/l"), ("cache_salt", "s")),
        (("lora", "ad", "/l"),),
    ]
    for bad in ("0.9.2", "0.12.0", "0.13.1", "latest"):
        with pytest.raises(ValueError):
            vllm_extra_keys(bad, 1, cache_salt="s")
    with pytest.raises(ValueError, match="int id"):
        vllm_extra_keys("0.10.2", 1, lora_name="ad")


def test_extra_keys_change_the_vllm_hash_of_their_blocks_only():
    from kvsched.hashing import block_hashes, vllm_extra_keys

    toks = list(range(48))
    plain = block_hashes(toks, 16, mode="vllm")
    salted = block_hashes(toks, 16, mode="vllm", extra_keys=vllm_extra_keys("0.33.0", 3, cache_salt="s"))
    assert (plain != salted).all()  # block 0 differs, and the chain carries it to every later block
    assert (block_hashes(toks, 16, mode="vllm", extra_keys=[None, None, None]) == plain).all()


prefixes = st.lists(st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=40), min_size=1, max_size=3)


@settings(max_examples=150, deadline=None)
@given(
    prefixes,
    st.lists(
        st.tuples(
            st.integers(0, 2),
            st.lists(st.integers(0, 70000), max_size=30),
            st.booleans(),
            st.sampled_from(["list", "int64", "uint32"]),
        ),
        min_size=1,
        max_size=8,
    ),
    st.integers(1, 5),
    st.integers(1, 6),
    st.sampled_from([None, "7"]),
)
def test_cached_vllm_hashes_equal_the_reference_chain(heads, prompts, block_size, capacity, seed):
    """Prompts sharing prefixes, hashed through one small cache (evictions included), give the
    reference chain every time; salted prompts (extra keys on block 0) are never mixed up."""
    from kvsched.hashing import BlockHashCache

    cache = BlockHashCache(capacity)
    for which, tail, salted, kind in prompts:
        tokens = heads[which % len(heads)] + tail
        n = len(tokens) // block_size
        extra = [("cache_salt", "s")] + [None] * (n - 1) if salted and n else None
        arg = tokens if kind == "list" else np.array(tokens, dtype=np.int64 if kind == "int64" else np.uint32)
        got = block_hashes(arg, block_size, mode="vllm", hash_seed=seed, extra_keys=extra, cache=cache)
        want = vllm_reference(tokens, block_size, "vllm-none-hash" if seed is None else seed, extra)
        assert got.tolist() == want
    assert len(cache) <= capacity


def test_cache_hits_on_a_shared_prefix_and_falls_back_for_tokens_out_of_range():
    from kvsched.hashing import BlockHashCache

    cache = BlockHashCache()
    a, b = [*list(range(100, 164)), 1, 2, 3, 4], [*list(range(100, 164)), 9, 9, 9, 9]
    block_hashes(a, 16, mode="vllm", cache=cache)
    assert (cache.hits, cache.misses) == (0, 4)
    assert block_hashes(b, 16, mode="vllm", cache=cache).tolist() == vllm_reference(b, 16, "vllm-none-hash")
    assert (cache.hits, cache.misses) == (4, 4)  # the 4 complete blocks are the shared prefix
    big = [2**40] * 16  # beyond uint32: the general path, same result as without a cache
    assert block_hashes(big, 16, mode="vllm", cache=cache).tolist() == vllm_reference(big, 16, "vllm-none-hash")
    with pytest.raises(ValueError):
        BlockHashCache(0)


@pytest.mark.parametrize("mode", ["xxhash", "vllm"])
@pytest.mark.parametrize("token_ids", ["abc" * 20, b"abc" * 20, [1.5] * 32, np.ones(32)])
def test_token_ids_that_are_not_integers_raise_type_error(token_ids, mode):
    with pytest.raises(TypeError):
        block_hashes(token_ids, 16, mode=mode)


@pytest.mark.parametrize("mode", ["xxhash", "vllm"])
def test_a_2d_token_array_is_refused_not_hashed_as_zero_blocks(mode):
    """Found from outside: a tokenizer's (1, n) batch gave 0 hashes, silently (len() is 1)."""
    with pytest.raises(ValueError, match="1-D"):
        block_hashes(np.array([list(range(32))]), 16, mode=mode)


def test_the_earlier_import_path_names_the_same_functions():
    """`kvsched.client.hashing` (the path README and docs named before the hashing moved to the ground
    floor) still imports, and its names are the ground floor's objects, not copies."""
    import kvsched.client.hashing as old
    import kvsched.hashing as new

    for name in old.__all__:
        assert getattr(old, name) is getattr(new, name), name
    tokens = list(range(40))
    assert old.block_hashes(tokens, 16).tolist() == new.block_hashes(tokens, 16).tolist()
