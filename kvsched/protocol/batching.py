"""Protocol version 2's batching: `Batch` (router → daemon) and `Replies` (daemon → router) carry
several complete encoded frames in one ZeroMQ message, and `encode_batch` / `encode_replies` build
their bytes from already-encoded frames (docs/PROTOCOL.md, "Versions and batching").

A connection uses them only at `BATCH_MIN_VERSION` or above (`kvsched.protocol.limits`).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from .frames import Frame
from .limits import MAX_LIST


class Batch(Frame, tag="batch", frozen=True):
    """Protocol version 2: any number of router frames (not `Hello`, not `Batch`) in one message,
    handled in order exactly as if they had arrived one by one. Each element is one complete
    encoded frame (decoded on its own); a malformed one gets its own `Error` with `batch_index`."""

    frames: Annotated[list[msgspec.Raw], Meta(max_length=MAX_LIST)] = msgspec.field(default_factory=list)


class Replies(Frame, tag="replies", frozen=True):
    """Protocol version 2: every frame the daemon owes one connection from one wake, in order, in
    one message. Each element is one complete encoded daemon frame (never a `Replies`)."""

    frames: list[msgspec.Raw] = msgspec.field(default_factory=list)


def _array_header(n: int) -> bytes:
    """MessagePack array header for `n` elements (fixarray, array 16 or array 32)."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


_BATCH_HEAD = b"\x92\xa5batch"  # array of 2: tag "batch", then the frames array
_REPLIES_HEAD = b"\x92\xa7replies"


def encode_batch(raws: list[bytes]) -> bytes:
    """The bytes of `Batch(frames=raws)` without re-encoding the frames: equal to
    `make_encoder().encode(Batch([msgspec.Raw(r) for r in raws]))` (a test checks it)."""
    return b"".join((_BATCH_HEAD, _array_header(len(raws)), *raws))


def encode_replies(raws: list[bytes]) -> bytes:
    """The bytes of `Replies(frames=raws)`, built like `encode_batch`."""
    return b"".join((_REPLIES_HEAD, _array_header(len(raws)), *raws))


BATCH_OVERHEAD_BYTES = len(_REPLIES_HEAD) + 5  # the largest head + array-32 header of either message
