"""Chained block hashes of a prompt, for `Enqueue.block_hashes` (docs/DESIGN.md §6.6; docs/KV_EVENTS.md).

`block_hashes(token_ids, block_size, mode=...)` hashes every *complete* block of `block_size` tokens
(a last partial block is left out, as engines only cache full blocks), each hash chained on the one
before, and returns them as uint64[n_blocks]. Two modes:

* ``"vllm"`` — the integer hashes vLLM puts in its KV events, so the daemon's event-fed index matches
  what routers send. For vLLM V1 engines run with ``--prefix-caching-hash-algo sha256_cbor``:
  ``NONE_HASH = sha256(cbor(seed))`` where seed is the engine's ``PYTHONHASHSEED`` string (pass it as
  `hash_seed`; None = ``"vllm-none-hash"``, the fixed seed recent vLLM releases use when
  ``PYTHONHASHSEED`` is unset); block i's digest is ``sha256(cbor((parent, tuple(tokens_i),
  extra_i)))`` with parent = the previous block's full 32-byte digest (NONE_HASH for block 0), CBOR
  canonical (RFC 7049 §3.9, as ``cbor2.dumps(..., canonical=True)``); the event's hash is the digest's
  low 64 bits, big-endian (``int.from_bytes(digest, "big") & (2**64 - 1)``), which is what vLLM sends
  with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` (its default), and what the daemon derives from the
  bytes it sends otherwise.
* ``"xxhash"`` (default) — fast, for fleets that do not publish KV events (the approximate index only
  needs routers to agree among themselves): ``h_i = xxh64(le64(h_{i-1}) || le32(tokens_i) ||
  cbor(extra_i) if extra_i is not None, seed)`` with ``h_{-1} = 0`` and seed = `hash_seed` (int as is,
  str -> ``xxh64(utf8)``, None -> 0). Token ids must fit in 32 bits.

`extra_keys`, when given, holds one entry per complete block (a tuple, or None for a block without
extra keys); its shape must be the one the engine's vLLM version uses, which changed over releases:
build it with `vllm_extra_keys(version, ...)`.

Which vLLM releases ``mode="vllm"`` reproduces (docs/VLLM.md has the full matrix):

* the chain (sha256 of canonical CBOR, low 64 bits) matches vLLM >= 0.10.2 with
  ``--prefix-caching-hash-algo sha256_cbor``;
* ``hash_seed=None`` matches vLLM >= 0.29.0 only. 0.10.2 - 0.28.x draw a random first parent per
  process unless ``PYTHONHASHSEED`` is set identically on every engine: set it, and pass it here;
* extra keys: LoRA int id (0.10 - 0.11), flat ``(lora_name, ..., cache_salt)`` (0.14 - 0.30), tagged
  ``(("lora", name, path), ("cache_salt", salt))`` (>= 0.31); the salt is on block 0 only;
* hybrid models with several KV-cache groups match on group 0 (full attention) only, and EAGLE
  speculative decoding changes which blocks get cached.

The CBOR encoder here is a small canonical one for the types block keys use (int, bytes, str, None,
bool, float, tuple/list); tests check it byte for byte against ``cbor2``.
"""

from __future__ import annotations

import functools
import hashlib
import math
import operator
import struct
from array import array
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import xxhash

U64_MASK = (1 << 64) - 1
DEFAULT_VLLM_SEED = "vllm-none-hash"  # vLLM's DEFAULT_NONE_HASH_SEED (PYTHONHASHSEED unset, sha256*)


def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes((major << 5 | n,))
    if n < 1 << 8:
        return bytes((major << 5 | 24, n))
    if n < 1 << 16:
        return bytes((major << 5 | 25,)) + n.to_bytes(2, "big")
    if n < 1 << 32:
        return bytes((major << 5 | 26,)) + n.to_bytes(4, "big")
    if n < 1 << 64:
        return bytes((major << 5 | 27,)) + n.to_bytes(8, "big")
    raise ValueError("integers beyond 64 bits are not supported in block keys")


def _float(v: float) -> bytes:
    if math.isnan(v):
        return b"\xf9\x7e\x00"
    if math.isinf(v):
        return b"\xf9\x7c\x00" if v > 0 else b"\xf9\xfc\x00"
    for code, fmt in ((0xF9, ">e"), (0xFA, ">f")):
        try:
            packed = struct.pack(fmt, v)
        except OverflowError:
            continue
        if struct.unpack(fmt, packed)[0] == v:
            return bytes((code,)) + packed
    return b"\xfb" + struct.pack(">d", v)


def canonical_cbor(obj: Any) -> bytes:
    """Canonical CBOR of `obj` (int, bytes, str, None, bool, float, tuple/list). TypeError otherwise."""
    out = bytearray()
    _encode(obj, out)
    return bytes(out)


def _encode(obj: Any, out: bytearray) -> None:
    if obj is None:
        out += b"\xf6"
    elif obj is True:
        out += b"\xf5"
    elif obj is False:
        out += b"\xf4"
    elif isinstance(obj, int):
        out += _head(0, obj) if obj >= 0 else _head(1, -1 - obj)
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        b = bytes(obj)
        out += _head(2, len(b)) + b
    elif isinstance(obj, str):
        b = obj.encode("utf-8")
        out += _head(3, len(b)) + b
    elif isinstance(obj, float):
        out += _float(obj)
    elif isinstance(obj, (tuple, list)):
        out += _head(4, len(obj))
        for item in obj:
            _encode(item, out)
    else:
        raise TypeError(f"cannot encode {type(obj).__name__} in a block key")


def vllm_none_hash(hash_seed: str | None = None) -> bytes:
    """vLLM's NONE_HASH for sha256_cbor: sha256(cbor(seed)); seed None -> "vllm-none-hash"."""
    return _none_hash(DEFAULT_VLLM_SEED if hash_seed is None else str(hash_seed))


@functools.lru_cache(maxsize=64)
def _none_hash(seed: str) -> bytes:
    return hashlib.sha256(canonical_cbor(seed)).digest()


def _extra(extra_keys: Sequence[Any] | None, n_blocks: int) -> Sequence[Any]:
    if extra_keys is None:
        return [None] * n_blocks
    if len(extra_keys) < n_blocks:
        raise ValueError(f"extra_keys has {len(extra_keys)} entries for {n_blocks} complete blocks")
    return extra_keys


_CBOR_UINT: dict[int, bytes] = {}  # token id -> its canonical CBOR (a vocabulary's worth at most)
_CBOR_UINT_MAX = 1 << 20


def _cbor_uint(t: int) -> bytes:
    b = _CBOR_UINT.get(t)
    if b is None:
        b = _head(0, t)
        if len(_CBOR_UINT) < _CBOR_UINT_MAX:
            _CBOR_UINT[t] = b
    return b


def _vllm(token_ids: Any, block_size: int, n: int, hash_seed: Any, extra: Sequence[Any]) -> np.ndarray:
    out: list[int] = []
    parent = vllm_none_hash(hash_seed)
    arr = np.asarray(token_ids[: n * block_size])
    fast = arr.size == 0 or (arr.dtype.kind in "iu" and arr.min() >= 0 and arr.max() <= 0xFFFF_FFFF)
    if fast:  # tokens as cached CBOR uints (a per-token table is cheaper than numpy for prompts)
        get = _CBOR_UINT.get
        enc = [get(t) or _cbor_uint(t) for t in arr.tolist()]
        head = b"\x83\x58\x20", _head(4, block_size)
    sha256, join, from_bytes = hashlib.sha256, b"".join, int.from_bytes
    for i in range(n):
        if fast:
            e = extra[i]
            msg = join(
                (
                    head[0],
                    parent,
                    head[1],
                    join(enc[i * block_size : (i + 1) * block_size]),
                    b"\xf6" if e is None else canonical_cbor(e),
                )
            )
        else:
            block = tuple(map(operator.index, token_ids[i * block_size : (i + 1) * block_size]))  # floats refused
            msg = canonical_cbor((parent, block, extra[i]))
        parent = sha256(msg).digest()
        out.append(from_bytes(parent, "big") & U64_MASK)
    return np.array(out, dtype=np.uint64)


class BlockHashCache:
    """Memo of `mode="vllm"` block digests, keyed by (parent digest, the block's token ids).

    Prompts that share a prefix (a system prompt, the earlier turns of a conversation: the requests
    a KV-aware router exists for) share their first blocks' hashes; with a cache, `block_hashes`
    computes each of those blocks once per process instead of once per request (a dictionary
    lookup instead of CBOR encoding + SHA-256). The key holds the parent's full 32-byte digest, so a
    hit is the same chain position as computing it. Blocks with extra keys are not cached.

    Args:
        capacity: blocks kept (default 65,536, a few MB); when full the oldest entry is dropped.
    Attributes:
        hits / misses: blocks found / computed so far.
        memo: (parent hash bytes + the block's token bytes) -> (its hash bytes, its hash int), oldest first.
    """

    __slots__ = ("capacity", "hits", "memo", "misses")

    def __init__(self, capacity: int = 65_536) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.memo: dict[bytes, tuple[bytes, int]] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self.memo)


_U32_NATIVE = array("I").itemsize == 4


def _u32_bytes(token_ids: Any, count: int) -> bytes | None:
    """The first `count` token ids as native uint32 bytes, or None when one is not in [0, 2**32)."""
    if isinstance(token_ids, np.ndarray):
        arr = token_ids[:count]
        if arr.dtype.kind not in "iu" or (arr.size and (arr.min() < 0 or arr.max() > 0xFFFF_FFFF)):
            return None
        return arr.astype(np.uint32).tobytes()
    try:
        return array("I", token_ids[:count]).tobytes()
    except (OverflowError, TypeError):
        return None


def _vllm_cached(
    token_ids: Any, block_size: int, n: int, hash_seed: Any, extra: Sequence[Any], cache: BlockHashCache
) -> np.ndarray:
    data = _u32_bytes(token_ids, n * block_size)
    if data is None or not _U32_NATIVE:  # what the general path handles (or rejects)
        return _vllm(token_ids, block_size, n, hash_seed, extra)
    memo, step = cache.memo, 4 * block_size
    parent = vllm_none_hash(hash_seed)
    head = b"\x83\x58\x20", _head(4, block_size)
    sha256, join, from_bytes, get = hashlib.sha256, b"".join, int.from_bytes, _CBOR_UINT.get
    tokens: array[int] | None = None
    out = [0] * n
    for i in range(n):
        e = extra[i]
        key = parent + data[i * step : (i + 1) * step] if e is None else None
        hit = memo.get(key) if key is not None else None
        if hit is not None:
            parent, out[i] = hit
            cache.hits += 1
            continue
        if tokens is None:  # Python ints, whatever the caller's integer type
            tokens = array("I")
            tokens.frombytes(data)
        enc = join([get(t) or _cbor_uint(t) for t in tokens[i * block_size : (i + 1) * block_size]])
        parent = sha256(join((head[0], parent, head[1], enc, b"\xf6" if e is None else canonical_cbor(e)))).digest()
        out[i] = from_bytes(parent, "big") & U64_MASK
        if key is not None:
            cache.misses += 1
            if len(memo) >= cache.capacity:
                del memo[next(iter(memo))]  # the oldest entry
            memo[key] = (parent, out[i])
    return np.array(out, dtype=np.uint64)


def _xxhash_seed(hash_seed: Any) -> int:
    if hash_seed is None:
        return 0
    if isinstance(hash_seed, int):
        return hash_seed & U64_MASK
    return xxhash.xxh64_intdigest(str(hash_seed).encode("utf-8"))


def _xxhash(token_ids: Any, block_size: int, n: int, hash_seed: Any, extra: Sequence[Any]) -> np.ndarray:
    arr = np.asarray(token_ids)
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"token_ids must be integers, not {arr.dtype} values")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFF_FFFF):
        raise ValueError("xxhash mode needs token ids in [0, 2**32)")
    data = arr[: n * block_size].astype("<u4").tobytes()
    step = 4 * block_size
    seed = _xxhash_seed(hash_seed)
    out = np.empty(n, dtype=np.uint64)
    h = 0
    for i in range(n):
        msg = h.to_bytes(8, "little") + data[i * step : (i + 1) * step]
        if extra[i] is not None:
            msg += canonical_cbor(extra[i])
        h = xxhash.xxh64_intdigest(msg, seed)
        out[i] = h
    return out


def block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    mode: Literal["xxhash", "vllm"] = "xxhash",
    hash_seed: str | int | None = None,
    extra_keys: Sequence[Any] | None = None,
    cache: BlockHashCache | None = None,
) -> np.ndarray:
    """Chained hashes of the complete blocks of `token_ids` (module docstring for both modes).

    Args:
        token_ids: the prompt's token ids.
        block_size: tokens per KV block (the engine's `--block-size`, = `daemon.block_size`).
        mode: "xxhash" (fast, self-consistent) or "vllm" (equal to vLLM's KV-event hashes).
        hash_seed: vllm: the engine's PYTHONHASHSEED (str); xxhash: the seed (int or str).
        extra_keys: one entry per complete block (tuple or None), or None.
        cache: a `BlockHashCache` to reuse the digests of blocks seen before (vllm mode only; the
            result is the same with or without it).
    Returns:
        uint64[len(token_ids) // block_size]; pass to the client's `schedule(block_hashes=...)`.
        A router of a daemon calls `SchedulerClient.block_hashes(token_ids)` instead, which passes
        the daemon's block size and `kv_hash_seed` (its `Welcome`) and mode "vllm" (docs/VLLM.md).
    Raises:
        ValueError: block_size < 1, an unknown mode, too few extra_keys, token ids out of range, an array
            of token ids that is not 1-D.
        TypeError: token ids that are not integers (a str, bytes, floats).
    """
    if isinstance(token_ids, (str, bytes, bytearray)):
        raise TypeError(f"token_ids must be a sequence or array of integers, not {type(token_ids).__name__}")
    if isinstance(token_ids, np.ndarray) and token_ids.ndim != 1:  # e.g. a tokenizer's (1, n) batch
        raise ValueError(f"token_ids must be 1-D, not shape {token_ids.shape} (take row 0 of a batch of one)")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = len(token_ids) // block_size
    extra = _extra(extra_keys, n)
    if mode == "vllm":
        if cache is not None:
            return _vllm_cached(token_ids, block_size, n, hash_seed, extra, cache)
        return _vllm(token_ids, block_size, n, hash_seed, extra)
    if mode == "xxhash":
        return _xxhash(token_ids, block_size, n, hash_seed, extra)
    raise ValueError(f"unknown hashing mode {mode!r} (expected 'xxhash' or 'vllm')")


def hashes_from_bytes(raw: bytes) -> np.ndarray:
    """Block hashes from their wire form (`Enqueue.block_hashes`: little-endian u64, docs/PROTOCOL.md
    "Encoding rules"; `protocol.hashes_to_bytes` makes it): uint64[len(raw) // 8], a read-only view on
    `raw`. Raises ValueError when len(raw) is not a multiple of 8."""
    return np.frombuffer(raw, dtype="<u8")


def _version(v: str) -> tuple[int, int]:
    try:
        major, minor = (int(x) for x in v.strip().lstrip("v").split(".")[:2])
    except ValueError:
        raise ValueError(f"vLLM version {v!r} is not of the form MAJOR.MINOR[.PATCH]") from None
    return major, minor


def vllm_extra_keys(
    vllm_version: str,
    n_blocks: int,
    *,
    lora_name: str | None = None,
    lora_int_id: int | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
) -> list[tuple[Any, ...] | None] | None:
    """The per-block `extra_keys` a given vLLM release hashes for LoRA and `cache_salt` requests.

    Args:
        vllm_version: the engines' vLLM version ("0.11.0", "0.33.0", ...).
        n_blocks: complete blocks of the prompt (len(token_ids) // block_size).
        lora_name / lora_int_id / lora_path: the request's LoRA adapter (name and path as served,
            int id as vLLM numbers it), or None.
        cache_salt: the request's `cache_salt`, or None.
    Returns:
        A list of n_blocks entries (tuple or None) for `block_hashes(extra_keys=...)`, or None when
        no block has extra keys. Shapes per version: 0.10-0.11 ``(lora_int_id[, salt])``;
        0.14-0.30 ``(lora_name[, salt])``; >= 0.31 ``(("lora", name, path)[, ("cache_salt", salt)])``;
        the salt only on block 0. (Multimodal and prompt-embedding keys are not built.)
    Raises:
        ValueError: a version before 0.10 or in 0.12-0.13 (not checked), a malformed version, or
            the LoRA field that version needs missing.
    Source: vLLM `vllm/v1/core/kv_cache_utils.py::generate_block_hash_extra_keys` of those releases.
    """
    v = _version(vllm_version)
    if v < (0, 10) or (0, 12) <= v < (0, 14):
        raise ValueError(f"vLLM {vllm_version}: extra-key shape not checked (supported: 0.10-0.11, >= 0.14)")
    lora: Any = None
    if lora_name is not None or lora_int_id is not None:
        if v < (0, 12):
            if lora_int_id is None:
                raise ValueError(f"vLLM {vllm_version} hashes the LoRA int id: pass lora_int_id")
            lora = lora_int_id
        elif v < (0, 31):
            if lora_name is None:
                raise ValueError(f"vLLM {vllm_version} hashes the LoRA name: pass lora_name")
            lora = lora_name
        else:
            if lora_name is None:
                raise ValueError(f"vLLM {vllm_version} hashes the LoRA name and path: pass lora_name")
            lora = ("lora", lora_name, lora_path)
    if lora is None and not cache_salt:
        return None
    out: list[tuple[Any, ...] | None] = []
    for i in range(n_blocks):
        keys: list[Any] = [] if lora is None else [lora]
        if i == 0 and cache_salt:
            keys.append(("cache_salt", cache_salt) if v >= (0, 31) else cache_salt)
        out.append(tuple(keys) if keys else None)
    return out
