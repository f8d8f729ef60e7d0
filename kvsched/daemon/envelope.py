"""ZeroMQ message shapes the daemon's ROUTER sockets accept, and what they answer to the others.

A ROUTER receives `[identity, *frames]`. A DEALER's request is one frame; a REQ socket puts an empty
delimiter frame before it and accepts only a reply that carries the delimiter back (ZeroMQ RFC 28,
"ZMTP REQ/REP"). The admin socket serves both (docs/PROTOCOL.md "Admin socket"); the data socket
serves DEALERs only, since the daemon sends frames nobody asked for (revocations, answers to
queued requests) that a REQ cannot receive, and tells a REQ so.
"""

from __future__ import annotations

ADMIN_SHAPE_ERROR = (
    "an admin request is one ZeroMQ frame (DEALER) or an empty delimiter then one frame (REQ); got {n} frames"
)
REQ_ON_DATA_SOCKET = (
    "the data socket needs a ZeroMQ DEALER socket (one frame per message); a REQ socket cannot "
    'receive the daemon\'s unsolicited frames (docs/PROTOCOL.md "Transport")'
)


def split_request(parts: list[bytes]) -> tuple[list[bytes], bytes | None]:
    """(the envelope to reply with, the request frame) of one admin message `[identity, ...]`; the
    request is None when the shape is neither DEALER's `[id, req]` nor REQ's `[id, b"", req]` (the
    envelope then still reaches the sender, with its delimiter when it sent one)."""
    if len(parts) == 2 or (len(parts) == 3 and parts[1] == b""):
        return parts[:-1], parts[-1]
    return parts[: 2 if parts[1:2] == [b""] else 1], None


def is_req_envelope(payload: bytes, rest: list[bytes]) -> bool:
    """True when a data-socket message `[identity, payload, *rest]` looks like a REQ's `[b"", frame]`."""
    return payload == b"" and len(rest) == 1
