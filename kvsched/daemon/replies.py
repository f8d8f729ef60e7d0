"""Replies to routers: sent at once to version-1 peers, gathered per wake for version-2 peers.

A version-2 peer (protocol version 2, docs/PROTOCOL.md "Versions and batching") gets everything one wake owes it
in one message: the frame itself when there is one, else a `Replies` frame holding them in order;
split only to stay under `max_frame_bytes`. `ReplyOutbox.flush()` sends them and returns the
admissions that could not be delivered, which the actor releases at once (a gone peer must not keep
a booking). I/O only; no policy.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

from .. import protocol as p
from ..core.types import Admit
from .connections import Connection
from .ratelimit import RateLimitedLog

_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)


class ReplyOutbox:
    """Per-wake reply buffer over one ROUTER socket.

    Args:
        sock: the bound ROUTER (ROUTER_MANDATORY set: a send to a gone peer raises EHOSTUNREACH).
        max_frame_bytes: largest message sent (bytes); bigger `Replies` are split.
        warn: rate-limited logger for undeliverable replies.
        schedule: `loop.call_soon`, used as a safety net for paths that do not flush: once per batch
            of replies queued outside a data-socket wake (timers, admin); a wake flushes itself.
        on_flush_due: the callback `schedule` runs (the actor's flush-and-release).
    Attributes:
        sends: messages sent (or attempted) so far; the actor compares it across a wake to know
            whether to re-check the socket (a send can swallow the ZMQ FD's edge).
        in_wake: True while the actor drains the data socket; replies queued then are flushed at the
            end of the wake, so no safety-net callback is scheduled for them.
    """

    def __init__(
        self,
        sock: zmq.Socket,
        max_frame_bytes: int,
        warn: RateLimitedLog,
        schedule: Callable[[Callable[[], None]], object],
        on_flush_due: Callable[[], None],
    ) -> None:
        self.sock = sock
        self.limit = max(1, max_frame_bytes - p.BATCH_OVERHEAD_BYTES)
        self.warn = warn
        self._schedule = schedule
        self._on_flush_due = on_flush_due
        self._boxes: dict[bytes, tuple[Connection, list[tuple[bytes, Admit | None]]]] = {}
        self._queued = False
        self.in_wake = False
        self.sends = 0  # messages handed to ZeroMQ (or refused by it) so far

    def __bool__(self) -> bool:
        return bool(self._boxes)

    def add(self, conn: Connection, raw: bytes, admit: Admit | None) -> None:
        """Queue one encoded frame for `conn` (a version-2 peer); `admit` when it is an Admitted."""
        box = self._boxes.get(conn.identity)
        if box is None:
            box = self._boxes[conn.identity] = (conn, [])
            if not self._queued and not self.in_wake:
                self._queued = True
                self._schedule(self._flush_due)
        box[1].append((raw, admit))

    def _flush_due(self) -> None:
        self._queued = False
        self._on_flush_due()

    def send_now(self, conn: Connection, payload: bytes) -> bool:
        """Send one message to `conn`. False when ZeroMQ refuses it (peer gone, or its queue full)."""
        self.sends += 1
        try:
            self.sock.send(conn.identity, _SNDMORE_NOBLOCK)  # EHOSTUNREACH here for a gone peer
            self.sock.send(payload, _NOBLOCK)
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH (ROUTER_MANDATORY) or EAGAIN (peer HWM)
            self.warn.warning("undeliverable", "reply undeliverable owner=%d errno=%s", conn.owner, exc.errno)
            return False

    def flush(self) -> list[Admit]:
        """Send every queued reply; returns the Admits that could not be delivered."""
        boxes, self._boxes = self._boxes, {}
        lost: list[Admit] = []
        for conn, items in boxes.values():
            lost += self._send_items(conn, items)
        return lost

    def _send_items(self, conn: Connection, items: list[tuple[bytes, Admit | None]]) -> list[Admit]:
        if len(items) == 1:  # the common case: one reply this wake, sent as itself
            raw, admit = items[0]
            return [] if self.send_now(conn, raw) or admit is None else [admit]
        if sum(len(raw) for raw, _ in items) <= self.limit:  # one Replies message
            if self.send_now(conn, p.encode_replies([raw for raw, _ in items])):
                return []
            return [a for _, a in items if a is not None]
        lost: list[Admit] = []
        start, size = 0, 0
        for i in range(len(items) + 1):
            if i == len(items) or (i > start and size + len(items[i][0]) > self.limit):
                chunk = items[start:i]
                payload = chunk[0][0] if len(chunk) == 1 else p.encode_replies([raw for raw, _ in chunk])
                if not self.send_now(conn, payload):
                    lost += [a for _, a in chunk if a is not None]
                start, size = i, 0
            if i < len(items):
                size += len(items[i][0])
        return lost
