"""`Receipts`: which of the `Release` frames the client link sent the daemon has surely read.

A daemon that dies with Releases unread loses them; the link buffers those again when it presumes
the daemon gone, so the next daemon (or the same one after a reap) applies them after the
`Reattach`. The daemon reads a connection's frames in order, so an answer to a frame sent later —
the `HeartbeatAck` of a later `Heartbeat`, the `Admitted` / `Rejected` of a later `Enqueue` —
confirms every Release sent before that frame. Frames are numbered in send order on a connection
(send seq). No I/O: the link reports what it sent and what came back.
"""

from __future__ import annotations

import time
from collections import deque

from .. import protocol as p
from .outbox import MAX_BUFFERED_FRAMES

MAX_UNCONFIRMED_RELEASES = 4096  # re-sent after a reconnect at most (older ones: surely read)


class Receipts:
    """Releases sent that no later answer confirmed yet, and the send seqs that would confirm them.

    Attributes:
        horizon_s: a Release older than this (s) counts as read: twice the daemon's liveness
            timeout (a daemon that kept answering that long read it); 10 s before any Welcome.
    """

    __slots__ = ("_enqueue_seq", "_heartbeat", "_seq", "_unconfirmed", "horizon_s")

    def __init__(self) -> None:
        # (send seq, monotonic s, encoded Release), oldest first
        self._unconfirmed: deque[tuple[int, float, bytes]] = deque(maxlen=MAX_UNCONFIRMED_RELEASES)
        self._seq = 0
        self._enqueue_seq: dict[str, int] = {}  # request id -> send seq of its Enqueue (until answered)
        self._heartbeat: tuple[int, int] = (0, 0)  # (heartbeat seq, send seq) of the last Heartbeat
        self.horizon_s = 10.0

    def sent(self, frame: p.Frame, raw: bytes) -> None:
        """`frame` (encoded as `raw`) goes out on the current connection: number it; remember a
        Release until confirmed and an Enqueue until answered (at most `MAX_BUFFERED_FRAMES`)."""
        self._seq += 1
        kind = type(frame)
        if kind is p.Release:
            now = time.monotonic()
            unconfirmed = self._unconfirmed
            unconfirmed.append((self._seq, now, raw))
            while unconfirmed[0][1] < now - self.horizon_s:
                unconfirmed.popleft()
        elif type(frame) is p.Enqueue and len(self._enqueue_seq) < MAX_BUFFERED_FRAMES:
            self._enqueue_seq[frame.request_id] = self._seq

    def heartbeat_sent(self, hb_seq: int) -> None:
        """Heartbeat number `hb_seq` goes out: its ack will confirm what was sent before it."""
        self._seq += 1
        self._heartbeat = (hb_seq, self._seq)

    def heartbeat_acked(self, hb_seq: int) -> None:
        """A `HeartbeatAck(hb_seq)` came back (an ack of an older heartbeat confirms nothing)."""
        if hb_seq == self._heartbeat[0]:
            self._confirm(self._heartbeat[1])

    def answered(self, request_id: str) -> None:
        """An `Admitted` / `Rejected` for `request_id` came back: its Enqueue was read."""
        seq = self._enqueue_seq.pop(request_id, None)
        if seq is not None:
            self._confirm(seq)

    def _confirm(self, seq: int) -> None:
        """The daemon answered the frame sent as number `seq`: it read every Release sent before it."""
        unconfirmed = self._unconfirmed
        while unconfirmed and unconfirmed[0][0] < seq:
            unconfirmed.popleft()

    def unread(self) -> list[bytes]:
        """The Releases sent within `horizon_s` before now that no later answer confirmed (older
        ones were read by a daemon that kept answering). Empties the record."""
        horizon = time.monotonic() - self.horizon_s
        out = [raw for _, t, raw in self._unconfirmed if t >= horizon]
        self._unconfirmed.clear()
        self._enqueue_seq.clear()  # a restarted daemon answers them after the Reattach: nothing to confirm
        return out
