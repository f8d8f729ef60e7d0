"""vLLM KV-cache event batches: pure decoding into small typed records (docs/DESIGN.md §6.1).

Wire format (what vLLM's `ZmqEventPublisher` sends; see docs/KV_EVENTS.md):

* ZeroMQ multipart `[topic, seq, payload]`; `seq` is 8 bytes big-endian unsigned.
* `payload` is MessagePack: the batch `[ts, events, data_parallel_rank]` (an array; trailing fields at
  their default may be omitted) — a map `{"ts", "events", "data_parallel_rank"}` is accepted too.
* Each event is tagged by its class name, in one of the two encodings vLLM has used:
  - **array** (older releases, `array_like=True`): `["BlockStored", block_hashes, parent_block_hash,
    token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
    kv_cache_spec_sliding_window]`; releases older than a field simply end earlier, and trailing
    fields at their default may be omitted;
  - **map** (newer releases): `{"type": "BlockStored", "block_hashes": ..., ...}`; fields at their
    default may be omitted — a missing key means None.
* Hashes are u64 ints (negative ints, as some producers send i64, are taken mod 2**64) or bytes
  (the low 64 bits, big-endian: `int.from_bytes(b[-8:], "big")`, as vLLM converts its digests).

Index keys: a block is identified by (hash, group_idx). Group 0 (or None, as sent by releases without
KV-cache groups) keeps the raw hash as key, so keys equal the hashes routers send in `Enqueue`
(computed by `kvsched.hashing`). A non-zero group g is folded in with
`key = splitmix64_finalize((hash + g * 0x9E3779B97F4A7C15) mod 2**64)` — a bijection of the hash for a
fixed g, so two blocks of one group never collide with each other, and a group-g key equals a
group-0 key only by a 2**-64 accident. Requests only carry group-0 hashes, so blocks of other
groups (e.g. sliding-window layers of hybrid models) never count toward a request's overlap.

Unknown event types and unknown fields (extra array positions, extra map keys) are counted and
skipped; the rest of the batch is kept. An event whose known fields have the wrong types is counted
as malformed and skipped. Only an undecodable payload raises `KvEventFormatError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from ..errors import ProtocolError
from ..protocol.limits import MAX_BLOCK_HASHES
from ..shm.mix import GOLDEN, U64_MASK, mix64

GROUP_MIX = GOLDEN  # 2**64 / golden ratio
MEDIUM_GPU = "GPU"

STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
CLEARED_FIELDS: tuple[str, ...] = ()
EVENT_FIELDS = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS, "AllBlocksCleared": CLEARED_FIELDS}
BATCH_FIELDS = ("ts", "events", "data_parallel_rank")


class KvEventFormatError(ProtocolError):
    """A KV-event payload that is not a MessagePack event batch at all (the batch is dropped)."""


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks `keys` (uint64[n], hash mixed with group) were stored in tier `medium`."""

    keys: np.ndarray
    parent_key: int | None  # key of the block before keys[0]; None = start of a sequence
    medium: str | None  # None (older releases) = GPU
    group_idx: int  # KV-cache group; 0 when absent
    block_size: int | None  # tokens per block
    # first-of-chain events only (parent None), for the hash check (`kvevents/hash_check.py`):
    token_ids: list[Any] | None = None  # the stored blocks' tokens, as the engine sent them
    extra_keys: list[Any] | None = None  # per-block extra keys the engine hashed, or None

    @property
    def device(self) -> bool:
        return is_device_medium(self.medium)


@dataclass(frozen=True, slots=True)
class Removed:
    """Blocks `keys` (uint64[n]) were evicted from tier `medium`."""

    keys: np.ndarray
    medium: str | None
    group_idx: int

    @property
    def device(self) -> bool:
        return is_device_medium(self.medium)


@dataclass(frozen=True, slots=True)
class Cleared:
    """The engine dropped its whole prefix cache (`AllBlocksCleared`)."""


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    """One event batch: the events kept, in order, and what was skipped."""

    ts: float  # publisher wall clock (s)
    events: tuple[Event, ...]
    dp_rank: int | None
    unknown_types: int = 0  # events whose tag is not one of the three known classes
    unknown_fields: int = 0  # fields skipped (extra array positions, unknown map keys)
    malformed: int = 0  # events skipped because a known field had the wrong type


def is_device_medium(medium: str | None) -> bool:
    """True for the device (GPU) cache: `medium` is None (releases without tiers) or "GPU"."""
    return medium is None or medium.upper() == MEDIUM_GPU


def normalize_hash(h: Any) -> int:
    """An event hash as u64: ints mod 2**64; bytes -> low 64 bits, big-endian. TypeError otherwise."""
    if isinstance(h, bool):
        raise TypeError("a block hash cannot be a bool")
    if isinstance(h, int):
        return h & U64_MASK
    if isinstance(h, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(h)[-8:], "big")
    raise TypeError(f"a block hash must be int or bytes, not {type(h).__name__}")


def block_key(h: int, group_idx: int | None) -> int:
    """Index key of block (hash u64, group): the hash itself for group 0/None, else a mix (module doc)."""
    if not group_idx:
        return h
    return mix64((h + group_idx * GROUP_MIX) & U64_MASK)


# Most block hashes one event may carry: a request's largest prompt (the protocol's MAX_BLOCK_HASHES).
# A longer list is malformed and skipped unread: each hash costs Python work here, and one BlockStored of
# millions of hashes stalled the actor loop for seconds (tests/kvevents/test_format.py; docs/BENCHMARKS.md,
# "Costs behind code comments").
MAX_EVENT_BLOCKS = MAX_BLOCK_HASHES
# Most block hashes one batch (one message) may carry in all; later events with hashes are malformed
# and skipped unread (a vLLM step publishes a few thousand; this bounds one message's work).
MAX_BATCH_BLOCKS = 4 * MAX_EVENT_BLOCKS


def _keys(hashes: Any, group_idx: int) -> np.ndarray:
    if not isinstance(hashes, (list, tuple)):
        raise TypeError("block_hashes must be an array")
    if len(hashes) > MAX_EVENT_BLOCKS:
        raise ValueError(f"{len(hashes):,} block_hashes in one event (at most {MAX_EVENT_BLOCKS:,})")
    return np.array([block_key(normalize_hash(h), group_idx) for h in hashes], dtype=np.uint64)


def _opt_int(v: Any, name: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int")
    return v


def _opt_str(v: Any, name: str) -> str | None:
    if v is not None and not isinstance(v, str):
        raise TypeError(f"{name} must be a string")
    return v


def _fields(raw: Any) -> tuple[str | None, dict[str, Any], int]:
    """(tag, known fields by name, number of unknown fields) of one raw event, either encoding."""
    if isinstance(raw, (list, tuple)):
        if not raw or not isinstance(raw[0], str):
            return None, {}, 0
        names = EVENT_FIELDS.get(raw[0])
        if names is None:
            return raw[0], {}, 0
        values = raw[1:]
        return raw[0], dict(zip(names, values, strict=False)), max(0, len(values) - len(names))
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            return None, {}, 0
        names = EVENT_FIELDS.get(tag)
        if names is None:
            return tag, {}, 0
        unknown = sum(1 for k in raw if k != "type" and k not in names)
        return tag, {k: raw[k] for k in names if k in raw}, unknown
    return None, {}, 0


def _first_list(v: Any, parent: Any) -> list[Any] | None:
    """`v` when it is a non-empty list on a first-of-chain event (parent None), else None."""
    return v if parent is None and isinstance(v, list) and v else None


def _decode(tag: str | None, f: dict[str, Any]) -> tuple[Event | None, str]:
    if tag is None:
        return None, "malformed"
    try:
        if tag == "BlockStored":
            group = _opt_int(f.get("group_idx"), "group_idx") or 0
            parent = f.get("parent_block_hash")
            return Stored(
                keys=_keys(f.get("block_hashes"), group),
                parent_key=None if parent is None else block_key(normalize_hash(parent), group),
                medium=_opt_str(f.get("medium"), "medium"),
                group_idx=group,
                block_size=_opt_int(f.get("block_size"), "block_size"),
                token_ids=_first_list(f.get("token_ids"), parent),
                extra_keys=_first_list(f.get("extra_keys"), parent),
            ), "ok"
        if tag == "BlockRemoved":
            group = _opt_int(f.get("group_idx"), "group_idx") or 0
            return Removed(
                keys=_keys(f.get("block_hashes"), group), medium=_opt_str(f.get("medium"), "medium"), group_idx=group
            ), "ok"
        if tag == "AllBlocksCleared":
            return Cleared(), "ok"
    except (TypeError, ValueError, OverflowError):
        return None, "malformed"
    return None, "unknown_type"


_DECODER = msgspec.msgpack.Decoder()


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one batch payload (either encoding). Raises KvEventFormatError if it is not a batch."""
    try:
        raw = _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise KvEventFormatError(f"KV-event payload is not MessagePack: {exc}") from exc
    except RecursionError:  # the untyped decode stops at the interpreter's recursion limit
        raise KvEventFormatError("KV-event payload is nested too deeply") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
        batch_unknown = sum(1 for k in raw if k not in BATCH_FIELDS)
    elif isinstance(raw, (list, tuple)) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
        batch_unknown = max(0, len(raw) - 3)
    else:
        raise KvEventFormatError("KV-event payload is not an event batch [ts, events, dp_rank]")
    if not isinstance(events, (list, tuple)) or isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise KvEventFormatError("KV-event batch has no events array or no numeric ts")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        rank = None
    out: list[Event] = []
    unknown_types = malformed = 0
    unknown_fields = batch_unknown
    budget = MAX_BATCH_BLOCKS
    for ev in events:
        tag, fields, n_unknown = _fields(ev)
        hashes = fields.get("block_hashes")
        if isinstance(hashes, (list, tuple)) and len(hashes) <= MAX_EVENT_BLOCKS:  # (longer: malformed below)
            if len(hashes) > budget:  # over the batch's budget: skipped unread
                malformed += 1
                continue
            budget -= len(hashes)
        rec, status = _decode(tag, fields)
        if status == "ok":
            assert rec is not None
            out.append(rec)
            unknown_fields += n_unknown
        elif status == "unknown_type":
            unknown_types += 1
        else:
            malformed += 1
    return DecodedBatch(float(ts), tuple(out), rank, unknown_types, unknown_fields, malformed)


def seq_to_bytes(seq: int) -> bytes:
    """A sequence number as sent on the wire: 8 bytes big-endian (-1 = the replay end marker)."""
    return seq.to_bytes(8, "big", signed=seq < 0)


def seq_from_bytes(b: bytes, signed: bool = False) -> int:
    """8 big-endian bytes -> int; ValueError for another length. Replay replies read it signed."""
    if len(b) != 8:
        raise ValueError(f"sequence number must be 8 bytes, got {len(b)}")
    return int.from_bytes(b, "big", signed=signed)


END_SEQ = seq_to_bytes(-1)  # b"\xff" * 8


def offset_endpoint(endpoint: str, dp_rank: int) -> str:
    """The endpoint of data-parallel rank `dp_rank`: tcp port + rank; ipc/inproc path + `_dp<rank>`.

    Rank 0 keeps the endpoint unchanged (as vLLM does). ValueError for a tcp endpoint without a port.
    """
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit() or base == "tcp":
            raise ValueError(f"tcp endpoint without a port: {endpoint!r}")
        return f"{base}:{int(port) + dp_rank}"
    return f"{endpoint}_dp{dp_rank}"
