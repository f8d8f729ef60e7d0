"""Heartbeats from the clients' heartbeat DEALERs: each credits the data connection its `conn_token` names.

A client heartbeats from a thread of its own on a DEALER of its own (docs/PROTOCOL.md "Liveness"), so
that a router whose event loop is blocked is not taken for a dead one. Those heartbeats reach the data
socket from a routing id that never says Hello. The actor hands every message from a routing id that
is no connection to `TokenHeartbeats.answer` first: a `heartbeat` whose `conn_token` is not 0 credits
the connection the token names (`ConnectionTable.credit`) and is answered `heartbeat_ack{seq}`; a token
no open connection has is answered `error{code=3}`, counted, and changes nothing — in no case does it
open a connection. Anything else is left to the actor's usual path (a first Hello, bad input).
The actor does not count these against `frame_budget_per_wake` (they have a budget of their own), so
a flood of data frames never delays them past one wake. No policy here, and no socket: the actor sends.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec

from .. import protocol as p
from .connections import ConnectionTable

if TYPE_CHECKING:  # the counter itself is made in metrics.py
    from prometheus_client import Counter

log = logging.getLogger(__name__)

# A heartbeat is a MessagePack array whose first element is the tag: one header byte, then the tag as a
# fixstr. Longer messages are no heartbeat (seq and token take at most 9 bytes each).
_TAG_AT = slice(1, 11)
_TAG = b"\xa9heartbeat"
_MAX_BYTES = 32


class TokenHeartbeats:
    """Answers the heartbeats of heartbeat DEALERs; credits the connections they name.

    Args:
        conns: the actor's `ConnectionTable`.
        unknown: a Prometheus counter, incremented for each heartbeat whose token no open connection
            has (`kvsched_unknown_token_heartbeats_total`).
    """

    def __init__(self, conns: ConnectionTable, unknown: Counter) -> None:
        self.conns = conns
        self.unknown = unknown
        self._dec = msgspec.msgpack.Decoder(p.Heartbeat)
        self._enc = p.make_encoder()

    def answer(self, payload: bytes, now_us: int) -> bytes | None:
        """The encoded answer to `payload` when it is a heartbeat naming a `conn_token` (received at
        `now_us`, µs; the named connection is credited), else None: not one of these (the actor handles
        it as any frame from a new routing id, a token-0 heartbeat included). Never raises."""
        if len(payload) > _MAX_BYTES or payload[_TAG_AT] != _TAG:
            return None
        try:
            beat = self._dec.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None  # answered as bad input by the actor
        if not beat.conn_token:
            return None
        if self.conns.credit(beat.conn_token, now_us) is not None:
            return self._enc.encode(p.HeartbeatAck(beat.seq))
        self.unknown.inc()
        log.debug("heartbeat for an unknown conn_token seq=%d", beat.seq)
        return self._enc.encode(
            p.Error(
                int(p.ErrorCode.NOT_HELLO),
                f"heartbeat conn_token {beat.conn_token} names no open connection (closed, declared dead, or from "
                "before a daemon restart): nothing was credited; heartbeat with the conn_token of the Welcome your "
                "data connection got last",
            )
        )
