"""`Outbox`: the client link's outgoing frames that are not sent at once.

Two queues, both of encoded frames (bytes):

* the frames of this event-loop turn on a version-2 connection, coalesced: the first frame of a
  turn schedules one flush (`loop.call_soon`), which sends them as one message per chunk that fits
  under the daemon's `Welcome.max_frame_bytes` (one frame alone goes as itself, more go as a
  `Batch`, docs/PROTOCOL.md);
* the reconnect buffer (bounded by `MAX_BUFFERED_FRAMES`): lease frames (Release / Update) sent
  while the daemon is presumed gone, flushed after the next `Welcome`, after the owner's
  `Reattach` claimed the leases their Releases name (`held_releases`).

It owns no socket and no connection state: the `Link` gives it the send and the "daemon gone"
callbacks and decides when a frame is queued, held or flushed.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from .. import protocol as p

MAX_BUFFERED_FRAMES = 100_000


class Outbox:
    """A loop turn's frames (coalesced into `Batch` messages) and the reconnect buffer.

    Args:
        send: sends one encoded message on the live connection; False when it cannot (no
            connection, or the pipe to the daemon is gone).
        down: called when a flush could not send: the daemon is presumed gone (the link's
            `link_down`, which may put unread Releases at the front of the buffer first).
        call_soon: schedules a callback for the end of this loop turn (the loop's `call_soon`).
    Attributes:
        max_frame_bytes: the daemon's limit on one message (bytes; from the last `Welcome`).
        held: the reconnect buffer, oldest first.
    """

    __slots__ = ("_call_soon", "_down", "_queued", "_send", "_turn", "held", "max_frame_bytes")

    def __init__(
        self, send: Callable[[bytes], bool], down: Callable[[], None], call_soon: Callable[[Callable[[], None]], object]
    ) -> None:
        self._send, self._down, self._call_soon = send, down, call_soon
        self._turn: list[tuple[bytes, bool]] = []  # (frame, bufferable) sent this loop turn, not yet flushed
        self._queued = False
        self.held: list[bytes] = []
        self.max_frame_bytes = p.DEFAULT_MAX_FRAME_BYTES

    @property
    def turn_pending(self) -> bool:
        """Frames of this loop turn wait for their flush."""
        return bool(self._turn)

    # ------------------------------------------------------------------ this loop turn
    def queue(self, raw: bytes, bufferable: bool) -> None:
        """Coalesce: the first frame of a loop turn schedules one flush for everything sent in it.
        `bufferable` frames are held for the next connection when the flush cannot send them."""
        self._turn.append((raw, bufferable))
        if not self._queued:
            self._queued = True
            self._call_soon(self._flush_soon)

    def _flush_soon(self) -> None:
        self._queued = False
        self.flush()

    def flush(self) -> None:
        """Send the frames of this loop turn: one message (the frame, or a `Batch`) per chunk that
        fits under `max_frame_bytes`. When the daemon cannot be reached the bufferable frames are
        held for the next connection (Enqueues are re-sent by `Reattach`)."""
        out, self._turn = self._turn, []
        limit = self.max_frame_bytes - p.BATCH_OVERHEAD_BYTES
        start, size, i = 0, 0, 0
        while i <= len(out):
            if i == len(out) or (i > start and size + len(out[i][0]) > limit):
                chunk = out[start:i]
                if chunk:
                    payload = chunk[0][0] if len(chunk) == 1 else p.encode_batch([raw for raw, _ in chunk])
                    if not self._send(payload):
                        self._down()
                        self.held.extend(raw for raw, keep in out[start:] if keep)
                        del self.held[MAX_BUFFERED_FRAMES:]
                        return
                start, size = i, 0
            if i < len(out):
                size += len(out[i][0])
            i += 1

    # ------------------------------------------------------------------ reconnect buffer
    def hold(self, raw: bytes) -> bool:
        """Keep a frame for the next connection; False when the buffer is full (frame dropped)."""
        if len(self.held) < MAX_BUFFERED_FRAMES:
            self.held.append(raw)
            return True
        return False

    def hold_first(self, raws: list[bytes]) -> None:
        """Put frames ahead of everything held (Releases the gone daemon may not have read)."""
        self.held[:0] = raws
        del self.held[MAX_BUFFERED_FRAMES:]

    def take_held(self) -> list[bytes]:
        """Empty the reconnect buffer and return what it held, oldest first."""
        held, self.held = self.held, []
        return held

    def held_releases(self) -> list[p.LeaseRef]:
        """The leases whose `Release` waits in the reconnect buffer (one per request id, the last
        one held). Decodes the buffer (at reconnect only)."""
        dec = p.make_router_decoder()
        refs: dict[str, p.LeaseRef] = {}
        for raw in self.held:
            try:
                frame = dec.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if isinstance(frame, p.Release) and frame.slot >= 0:
                refs[frame.request_id] = p.LeaseRef(frame.request_id, frame.slot, frame.generation)
        return list(refs.values())
