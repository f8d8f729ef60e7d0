"""Bytes to frames and back: what each socket decodes (`RouterFrame`, `DaemonFrame`, the frames a
`Batch` / `Replies` may carry, admin requests and replies), the encoder and decoder factories, the
bounded peeks that name a bad frame's request id or admin tag, and the wire form of block hashes
(little-endian u64; docs/PROTOCOL.md, "Encoding rules").
"""

from __future__ import annotations

import operator
import sys
from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING, Annotated, SupportsIndex, TypeAlias, get_args

import msgspec
from msgspec import Meta

from .admin_frames import AdminReply, AdminRequest
from .batching import Batch, Replies
from .frames import (
    Admitted,
    Enqueue,
    Error,
    Heartbeat,
    HeartbeatAck,
    Hello,
    Reattach,
    Reattached,
    Rejected,
    Release,
    Update,
    Welcome,
)
from .limits import RequestId
from .walk import array_elements

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

# What `hashes_to_bytes` accepts: the wire bytes themselves, ints (Python or numpy), or an integer array.
BlockHashesLike: TypeAlias = "bytes | bytearray | memoryview | Iterable[SupportsIndex] | npt.NDArray[np.integer]"

RouterFrame = Hello | Enqueue | Update | Release | Heartbeat | Reattach | Batch
BatchedRouterFrame = Enqueue | Update | Release | Heartbeat | Reattach  # what a `Batch` may carry
DaemonFrame = Welcome | Admitted | Rejected | Error | HeartbeatAck | Reattached | Replies
RepliedDaemonFrame = Welcome | Admitted | Rejected | Error | HeartbeatAck | Reattached  # inside `Replies`

# Data socket: router frames, plus admin requests so they can be refused with a precise code.
DataSocketFrame = Hello | Enqueue | Update | Release | Heartbeat | Reattach | Batch


def make_encoder() -> msgspec.msgpack.Encoder:
    """One encoder per socket (reuse it: it keeps an internal buffer)."""
    return msgspec.msgpack.Encoder()


def make_router_decoder() -> msgspec.msgpack.Decoder[RouterFrame]:
    """Daemon side of the data socket: decodes any `RouterFrame`."""
    return msgspec.msgpack.Decoder(RouterFrame)


def make_daemon_decoder() -> msgspec.msgpack.Decoder[DaemonFrame]:
    """Client side of the data socket: decodes any `DaemonFrame`."""
    return msgspec.msgpack.Decoder(DaemonFrame)


def make_batched_router_decoder() -> msgspec.msgpack.Decoder[BatchedRouterFrame]:
    """Daemon side: decodes one frame found inside a `Batch` (any `RouterFrame` but Hello / Batch)."""
    return msgspec.msgpack.Decoder(BatchedRouterFrame)


def make_replied_daemon_decoder() -> msgspec.msgpack.Decoder[RepliedDaemonFrame]:
    """Client side: decodes one frame found inside a `Replies`."""
    return msgspec.msgpack.Decoder(RepliedDaemonFrame)


def make_admin_request_decoder() -> msgspec.msgpack.Decoder[AdminRequest]:
    """Daemon side of the admin socket."""
    return msgspec.msgpack.Decoder(AdminRequest)


def make_admin_reply_decoder() -> msgspec.msgpack.Decoder[AdminReply]:
    """CLI side of the admin socket."""
    return msgspec.msgpack.Decoder(AdminReply)


_ADMIN_TAGS = frozenset(cls.__struct_config__.tag for cls in get_args(AdminRequest))
_ID_TAGS = frozenset(("enqueue", "update", "release"))


class _TagPeek(msgspec.Struct):
    """The `t` key of a MessagePack map (other keys skipped): typed, so nesting cannot recurse far."""

    t: Annotated[str, Meta(max_length=64)]


class _IdPeek(msgspec.Struct, array_like=True):
    """The first two elements of a hot-path frame (tag, request_id); later elements are ignored."""

    t: Annotated[str, Meta(max_length=64)]
    request_id: RequestId


_TAG_PEEK = msgspec.msgpack.Decoder(_TagPeek)
_ID_PEEK = msgspec.msgpack.Decoder(_IdPeek)


def peek_admin_tag(raw: bytes) -> bool:
    """True when `raw` is a MessagePack map whose `t` names an admin request (the data socket then
    answers `ADMIN_ON_DATA_SOCKET` rather than a generic decode error). Never raises."""
    try:
        return _TAG_PEEK.decode(raw).t in _ADMIN_TAGS
    except Exception:
        return False


def peek_request_id(raw: bytes) -> str | None:
    """The request id of a frame that failed the full decode, when a bounded typed look-up can read
    it (an array whose tag is enqueue / update / release and whose second element is a valid id);
    else None. Never raises."""
    try:
        peek = _ID_PEEK.decode(raw)
    except RecursionError:  # a later element nested past msgspec's depth limit: walk to the first two
        return _walked_request_id(raw)
    except Exception:
        return None
    return peek.request_id if peek.t in _ID_TAGS else None


_RID = msgspec.msgpack.Decoder(RequestId)
_TAG = msgspec.msgpack.Decoder(str)


def _walked_request_id(raw: bytes) -> str | None:
    """`peek_request_id` for a frame msgspec cannot even skip through (`walk.py`). Never raises."""
    try:
        head = array_elements(raw, first=2, budget=[2])  # tag and id: one value each
        return _RID.decode(head[1]) if len(head) == 2 and _TAG.decode(head[0]) in _ID_TAGS else None
    except Exception:
        return None


def hashes_to_bytes(block_hashes: BlockHashesLike) -> bytes:
    """Encode block hashes as little-endian u64 bytes (the wire form).

    Args:
        block_hashes: bytes (returned as-is, length must be a multiple of 8), a sequence of ints in
            [0, 2**64), or a 1-D numpy integer array (converted to uint64 little-endian; a signed
            array's negative values are taken mod 2**64, as KV events' i64 hashes are).
    Raises:
        ValueError: a length that is not a multiple of 8, an int out of u64 range, an array not 1-D.
        TypeError: a str, elements that are not integers, a float / bool / object array (the message
            names `block_hashes`).
    """
    numpy = sys.modules.get("numpy")  # an array argument means numpy is loaded; the wire form needs no numpy
    if isinstance(block_hashes, str):  # iterable, but its characters are not hashes
        raise TypeError("block_hashes must be bytes, a sequence of ints or a numpy integer array, not str")
    if isinstance(block_hashes, (bytes, bytearray, memoryview)):
        raw = bytes(block_hashes)
        if len(raw) % 8:
            raise ValueError(f"block_hashes bytes length {len(raw)} is not a multiple of 8")
        return raw
    if numpy is not None and isinstance(block_hashes, numpy.ndarray):
        if block_hashes.dtype.kind not in "iu":
            raise TypeError(
                f"block_hashes must be an integer array, not {block_hashes.dtype} (a float or bool "
                f"array would be truncated into other hashes)"
            )
        if block_hashes.ndim != 1:
            raise ValueError(f"block_hashes must be a 1-D array, not shape {block_hashes.shape}")
        # a signed array is taken mod 2**64, as KV events' i64 hashes are (docs/KV_EVENTS.md)
        wire: bytes = block_hashes.astype("<u8", copy=False).tobytes()  # C order, as the wire wants
        return wire
    if not hasattr(block_hashes, "__iter__"):
        raise TypeError(
            f"block_hashes must be bytes, a sequence of ints or a numpy integer array, "
            f"not {type(block_hashes).__name__}"
        )
    try:
        words = array("Q", map(operator.index, block_hashes))  # ints, numpy ints; u64 in native order
    except OverflowError as exc:
        raise ValueError("block_hashes: a hash out of u64 range [0, 2**64)") from exc
    except TypeError:
        bad = next((h for h in block_hashes if not hasattr(h, "__index__")), None)  # None: a spent iterator
        what = f"not {type(bad).__name__} ({bad!r:.40})" if bad is not None else "and one was not"
        raise TypeError(f"block_hashes elements must be integers, {what}") from None
    if sys.byteorder == "big":
        words.byteswap()
    return words.tobytes()
