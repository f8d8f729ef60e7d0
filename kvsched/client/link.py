"""The client's connection to the daemon: one data DEALER, Hello/Welcome, heartbeats, liveness, reconnect.

`Link` owns the data socket and the heartbeat thread (`heartbeat.py`: a DEALER of its own, started at
the first `Welcome` that names a `conn_token`), and nothing else. It tells its owner (the
`SchedulerClient`) about every frame and about each `Welcome` (first connect or after a reconnect).
The thread keeps the daemon crediting the data connection while this event loop is blocked. The link
itself also sends a `Heartbeat` on the data connection whenever it has *sent* nothing or *received*
nothing for `heartbeat_ms` (a router whose requests wait in the queue hears nothing for a long time,
however much it sends), so a live daemon always answers within a heartbeat period (its ack also
confirms the Releases sent before it, `receipts.py`). The daemon is presumed gone only when no frame
at all (a `HeartbeatAck` included) arrived for `liveness_timeout_ms`. Before any frame is sent the
link checks that the daemon cannot have reaped the connection meanwhile (neither its own frames nor
the thread's heartbeats left a gap near the liveness timeout: a stopped process, or a native call
that held the GIL that long), so it never talks on a connection the daemon has reaped; it is also
presumed gone when a send finds the connection closed
(ZeroMQ's own reconnect is off, so a dead daemon's pipe is gone at once), or when it answers
`Error(3)` ("send Hello first"). The link then opens a fresh
DEALER and says Hello again with exponential backoff (0.05 s doubling to `max_backoff_s`) until a
`Welcome` arrives; while reconnecting, lease frames are buffered (bounded, `outbox.py`) and flushed
after it.
A Hello is sent only on a completed connection (ZMQ_IMMEDIATE), and once sent it waits for its
answer on that connection as long as the connection stays up (at most `HELLO_PATIENCE_S`), so a
busy daemon is not left with one abandoned connection per backoff step.

Protocol versions: Hello says the highest version this package speaks and falls back to version 1
when the daemon answers `Error(VERSION)`. On a version-2 connection every frame sent within one
event-loop turn goes out as one `Batch` message (one frame alone goes as itself), kept below the
daemon's `Welcome.max_frame_bytes` (the coalescing is `outbox.py`'s); `Replies` messages from the
daemon are unpacked in order.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import cast

import msgspec
import zmq

from .. import protocol as p
from ..errors import FrameTooLarge
from .heartbeat import HeartbeatThread
from .outbox import Outbox
from .receipts import Receipts

log = logging.getLogger(__name__)

# A plain int: pyzmq's enum flags cost an enum construction per call on the hot path.
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_zmq_poll = zmq.zmq_poll


def _readable(sock: zmq.Socket[bytes]) -> bool:
    """True when `sock` has a message to read: `zmq_poll` with a zero timeout, which costs a few µs
    where a `recv` that raises `zmq.Again` costs several times more (the exception object and its
    message) and `getsockopt(EVENTS)` builds an option enum in pyzmq 27. Like those two, it
    processes the socket's pending commands, so it re-arms the edge-triggered ZMQ FD."""
    return bool(_zmq_poll([(sock, _POLLIN)], 0))


# Silence after which the daemon may have reaped us (a share of its liveness timeout, so a frame in
# flight when the loop resumes cannot reach it after the reap): neither this link nor its heartbeat
# thread sent anything that long. Heartbeats keep both far below it (heartbeat_ms ≤ liveness / 2).
REAP_SHARE = 0.8
# How long a Hello that reached a daemon (the connection's handshake completed) waits for its Welcome
# on that connection before the link gives up on it and opens a new one (s). A busy daemon (start-up,
# a flood, a long GC) answers late; a new socket per backoff step would leave it one abandoned
# connection per step and never reach a daemon slower than the backoff ceiling.
HELLO_PATIENCE_S = 30.0
# How long a closed link's queued frames (a last Release) may still go out to a connected daemon (ms,
# ZMQ_LINGER): with 0, ZeroMQ discarded what its I/O thread had not written yet, and the daemon held
# that lease until its liveness timeout. Frames for a daemon that is gone are dropped at once.
CLOSE_LINGER_MS = 2000
_ANSWERED = float("-inf")  # `Link._hello_at` once the Welcome came


def _pid_ns() -> int:
    """Inode of this process's PID namespace (sent in Hello so the daemon watches our pid only when
    it lives in the same namespace); 0 when /proc is not readable."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class Link:
    """One DEALER connection with automatic re-Hello.

    Args:
        ctx: zmq.Context. endpoint: the daemon's data socket. client_name: for the daemon's logs.
        on_frame: called with every decoded daemon frame except Welcome and HeartbeatAck.
        on_welcome: called with (welcome, reconnected: bool) each time the daemon welcomes us.
        max_backoff_s: ceiling of the reconnect backoff (s).
        curve_server_key: the daemon's z85 CURVE public key (TCP endpoints off loopback), or None.
        curve_client_keys: (public, secret) z85 keys of this client; generated when omitted.
    Attributes:
        connected: a Welcome arrived and the daemon has not been presumed gone since.
        reconnecting_since: monotonic time (s) the current outage began, or None.
        welcome: the last Welcome.
        outbox: this loop turn's coalesced frames and the reconnect buffer (`Outbox`).
        receipts: the Releases sent that the daemon may not have read yet (`Receipts`).
        heartbeats: the heartbeat thread (`HeartbeatThread`), from the first Welcome naming a
            `conn_token` until `close()`; None before (and with a daemon that names none).
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        client_name: str,
        on_frame: Callable[[p.DaemonFrame], None],
        on_welcome: Callable[[p.Welcome, bool], None],
        max_backoff_s: float = 2.0,
        curve_server_key: bytes | None = None,
        curve_client_keys: tuple[bytes, bytes] | None = None,
        protocol_version: int = p.PROTOCOL_VERSION,
    ) -> None:
        self.ctx, self.endpoint, self.client_name = ctx, endpoint, client_name
        self.on_frame, self.on_welcome = on_frame, on_welcome
        self.max_backoff_s = max_backoff_s
        self.curve_server_key = curve_server_key
        if curve_server_key is not None and curve_client_keys is None:
            curve_client_keys = zmq.curve_keypair()  # (public, secret) for this process
        self.curve_client_keys = curve_client_keys
        self.loop: asyncio.AbstractEventLoop | None = None
        self.sock: zmq.Socket[bytes] | None = None
        self.enc = p.make_encoder()
        self.dec: msgspec.msgpack.Decoder[p.DaemonFrame] = p.make_daemon_decoder()
        self.inner_dec: msgspec.msgpack.Decoder[p.RepliedDaemonFrame] = p.make_replied_daemon_decoder()
        if not p.PROTOCOL_MIN <= protocol_version <= p.PROTOCOL_VERSION:
            raise ValueError(f"protocol_version must be in [{p.PROTOCOL_MIN}, {p.PROTOCOL_VERSION}]")
        self.max_version = protocol_version  # what Hello first offers
        self.version = protocol_version  # what the current / next Hello says
        self.batching = False  # the connection speaks version 2: coalesce sends into Batch
        self.outbox = Outbox(self._send_if_up, self.link_down, self._call_soon)
        self.connected = False
        self.ever_connected = False
        self.reconnecting_since: float | None = None
        self.welcome: p.Welcome | None = None
        self.receipts = Receipts()
        self._last_send = self._last_recv = time.monotonic()
        self._hb_seq = 0
        self._last_hb = 0.0
        self._recheck_queued = False
        self._timer: asyncio.TimerHandle | None = None
        self._backoff_s = 0.05
        self._next_hello = 0.0
        self._hello_at: float | None = None  # when the Hello went out on the current socket (None: not yet)
        self.closed = False
        self.reconnects = 0  # times the daemon was presumed gone (diagnostics, tests)
        self.heartbeats: HeartbeatThread | None = None

    @property
    def max_frame_bytes(self) -> int:
        """The daemon's limit on one message (bytes, from the last Welcome; the default before)."""
        return self.outbox.max_frame_bytes

    # ------------------------------------------------------------------ socket
    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Create the DEALER, send Hello, start the timer (Welcome arrives via `on_welcome`)."""
        self.loop = loop
        self._new_socket()
        self._next_hello = time.monotonic() + self._backoff_s
        self._timer = loop.call_later(0.05, self._on_timer)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self.loop is None:
            raise RuntimeError("Link.open(loop) was not called")
        return self.loop

    def _call_soon(self, callback: Callable[[], None]) -> None:
        self._running_loop().call_soon(callback)

    def _new_socket(self) -> None:
        self._drop_socket()
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        # No automatic reconnect by ZeroMQ: a reconnected socket would deliver its next frame (a
        # heartbeat, a Release) to a restarted daemon before any Hello. The link opens a fresh
        # socket that says Hello first instead; with the pipe gone, a send fails at once (EAGAIN),
        # which tells the link the daemon went away (zmq_setsockopt(3), ZMQ_RECONNECT_IVL = -1).
        sock.setsockopt(zmq.RECONNECT_IVL, -1)
        # Queue frames only on a completed connection (zmq_setsockopt(3), ZMQ_IMMEDIATE): the Hello
        # is sent once the handshake with the daemon's I/O thread is done, and "can send" (POLLOUT)
        # then says the connection is still up, which lets a Hello wait for a busy daemon's answer.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        if self.curve_server_key is not None and self.curve_client_keys is not None:  # both or neither
            sock.curve_serverkey = self.curve_server_key
            sock.curve_publickey, sock.curve_secretkey = self.curve_client_keys
        sock.connect(self.endpoint)
        self.sock = sock
        self._running_loop().add_reader(sock.fileno(), self._on_readable)
        self._hello_at = None
        self._try_hello()

    def _try_hello(self) -> None:
        """Say Hello if this socket's connection is up (else the timer tries again)."""
        if self._hello():
            self._hello_at = time.monotonic()

    def _hello_pending(self, now: float) -> bool:
        """A Hello went out on a connection that is still up, less than `HELLO_PATIENCE_S` ago:
        its Welcome is worth waiting for.

        Asking `EVENTS` processes the socket's pending commands, which consumes the FD's signal of
        a frame that arrived meanwhile (the Welcome itself, typically): when POLLIN is set, the
        frame is read on the next loop turn, else nothing would wake the reader for it
        (tests/client/test_welcome_race.py)."""
        if self.sock is None or self._hello_at is None or now - self._hello_at > HELLO_PATIENCE_S:
            return False
        events = cast(int, self.sock.getsockopt(_EVENTS))
        if events & _POLLIN and not self._recheck_queued:
            self._recheck_queued = True
            self._running_loop().call_soon(self._recheck)
        return bool(events & _POLLOUT)

    def _drop_socket(self, linger_ms: int = 0) -> None:
        if self.sock is not None:
            if self.loop is not None and not self.loop.is_closed():
                self.loop.remove_reader(self.sock.fileno())
            self.sock.close(linger_ms)
            self.sock = None

    def _hello(self) -> bool:
        return self._raw_send(
            self.enc.encode(
                p.Hello(
                    self.version,
                    self.client_name[: p.MAX_NAME_CHARS],
                    os.getpid(),
                    socket.gethostname()[: p.MAX_NAME_CHARS],
                    _pid_ns(),
                )
            )
        )

    def close(self) -> None:
        """Send this turn's frames and close; queued frames still go out for up to `CLOSE_LINGER_MS`."""
        self._flush_out()
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self.heartbeats is not None:
            self.heartbeats.stop()  # its socket is closed before the owner may terminate the context
        self._drop_socket(CLOSE_LINGER_MS if self.connected else 0)

    # ------------------------------------------------------------------ send / receive
    def send(self, frame: p.Frame, *, buffer_when_down: bool = True) -> bool:
        """Send a frame now, or buffer it while reconnecting (Release / Update frames). Returns False
        when the frame was dropped (link down and not bufferable).

        Raises:
            FrameTooLarge: the encoded frame exceeds `max_frame_bytes` (nothing is sent or buffered).
        """
        raw = self.enc.encode(frame)
        outbox = self.outbox
        if len(raw) > outbox.max_frame_bytes:  # the daemon's transport would drop the connection for it
            raise FrameTooLarge(
                f"{type(frame).__name__} frame for request {getattr(frame, 'request_id', '')!r} "
                f"is {len(raw):,} bytes; the daemon accepts at most {outbox.max_frame_bytes:,} "
                f"(max_frame_bytes): fewer block_hashes or a larger [daemon] max_frame_bytes"
            )
        if self.connected and self._silent_too_long(time.monotonic()):
            self.link_down()  # e.g. our loop was blocked: the daemon reaped this connection
        if self.connected:
            self.receipts.sent(frame, raw)
            if self.batching:
                outbox.queue(raw, buffer_when_down)
                return True
            if self._raw_send(raw):
                return True
            self.link_down()  # no pipe to the daemon (it is gone): keep the frame for the next one
        return buffer_when_down and outbox.hold(raw)

    def buffered_releases(self) -> list[p.LeaseRef]:
        """The leases whose `Release` waits in the reconnect buffer (sent after the next Welcome).
        The owner claims them in its `Reattach`, which goes out first, so the restarted daemon
        accepts those releases from this new connection. Decodes the buffer (at reconnect only)."""
        return self.outbox.held_releases()

    def _flush_out(self) -> None:
        """Send this loop turn's coalesced frames now (`Outbox.flush`)."""
        self.outbox.flush()

    def _send_if_up(self, raw: bytes) -> bool:
        """The outbox's send: False (the frames are held, the link goes down) when not connected, or
        when the daemon may have reaped the connection since the frames were queued (the loop, or
        the whole process, stalled between `send` and this flush at the end of the turn)."""
        if not self.connected or self.welcome is None:
            return False
        if self._unheard(time.monotonic(), self.welcome.liveness_timeout_ms / 1000):
            return False
        return self._raw_send(raw)

    def _raw_send(self, raw: bytes) -> bool:
        if self.sock is None:
            return False
        try:
            self.sock.send(raw, _NOBLOCK)
        except zmq.Again:
            return False
        self._last_send = time.monotonic()
        # A send can consume the FD's edge (ZeroMQ's FD is edge-like): look now, which is cheap,
        # and schedule one read only when a frame is already waiting.
        if not self._recheck_queued and _readable(self.sock):
            self._recheck_queued = True
            self._running_loop().call_soon(self._recheck)
        return True

    def _recheck(self) -> None:
        self._recheck_queued = False
        self._on_readable()

    def _on_readable(self) -> None:
        # One readability check per message (and one for a wake with nothing to read), never a
        # `zmq.Again` raised per wake; the last check, which finds nothing, re-arms the FD.
        while self.sock is not None and _readable(self.sock):
            raw = self.sock.recv(_NOBLOCK)
            self._last_recv = time.monotonic()
            try:
                frame = self.dec.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("undecodable frame from daemon error=%s", exc)
                continue
            if type(frame) is p.Replies:
                self._dispatch_replies(frame)
            else:
                self._dispatch(frame)

    def _dispatch_replies(self, replies: p.Replies) -> None:
        for raw in replies.frames:
            try:
                frame = self.inner_dec.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("undecodable frame in a Replies from the daemon error=%s", exc)
                continue
            self._dispatch(frame)

    def _dispatch(self, frame: p.DaemonFrame) -> None:
        match frame:
            case p.Welcome():
                reconnected = self.ever_connected
                self.connected = self.ever_connected = True
                self._hello_at = _ANSWERED  # never said again on this socket, never waited for
                self.reconnecting_since = None
                self._backoff_s = 0.05
                self.welcome = frame
                self.receipts.horizon_s = 2 * (frame.liveness_timeout_ms / 1000)
                self.batching = self.version >= p.BATCH_MIN_VERSION
                self.outbox.max_frame_bytes = frame.max_frame_bytes or p.DEFAULT_MAX_FRAME_BYTES
                self._follow(frame)
                self.on_welcome(frame, reconnected)
                for raw in self.outbox.take_held():
                    if self.batching:
                        self.outbox.queue(raw, True)
                    else:
                        self._raw_send(raw)
            case p.Error() if (
                frame.code == p.ErrorCode.VERSION and not self.connected and self.version > p.PROTOCOL_MIN
            ):
                log.info(
                    "daemon refused protocol %d (%s); saying Hello with version %d",
                    self.version,
                    frame.message,
                    p.PROTOCOL_MIN,
                )
                self.version = p.PROTOCOL_MIN
                self._try_hello()
            case p.HeartbeatAck():
                self.receipts.heartbeat_acked(frame.seq)
            case p.Error() if frame.code == p.ErrorCode.NOT_HELLO:
                if self.connected:
                    log.warning("daemon does not know this connection (restarted?); saying Hello again")
                    self.link_down()
            case p.Admitted() | p.Rejected():
                self.receipts.answered(frame.request_id)
                self.on_frame(frame)
            case _:
                self.on_frame(frame)

    # ------------------------------------------------------------------ liveness
    def _follow(self, welcome: p.Welcome) -> None:
        """Point the heartbeat thread at the connection `welcome` names (started on the first token;
        a daemon that names none, an older one, gets the link's own heartbeats only)."""
        if not welcome.conn_token:
            if self.heartbeats is not None:
                self.heartbeats.follow(0, 1.0, 1.0)
            return
        if self.heartbeats is None:
            self.heartbeats = HeartbeatThread(
                self.ctx, self.endpoint, self, self.curve_server_key, self.curve_client_keys
            )
        self.heartbeats.follow(
            welcome.conn_token, welcome.heartbeat_ms / 1000, welcome.liveness_timeout_ms / 1000 * REAP_SHARE
        )

    def _unheard(self, now: float, liveness_s: float) -> bool:
        """The daemon may have heard nothing for this connection for `REAP_SHARE` of its liveness
        timeout: we sent nothing that long, and the heartbeat thread did not cover the time since our
        last frame without such a gap (it was stopped with the process, or starved of the GIL)."""
        gap_s = liveness_s * REAP_SHARE
        if now - self._last_send <= gap_s:
            return False
        beats, welcome = self.heartbeats, self.welcome
        return (
            beats is None or welcome is None or not beats.covered_since(welcome.conn_token, self._last_send, now, gap_s)
        )

    def _silent_too_long(self, now: float) -> bool:
        """The connection may be gone on the daemon's side: either the daemon heard nothing for it for
        `REAP_SHARE` of its liveness timeout (`_unheard`: the daemon reaps a router it has not heard
        from for that long, so the next frame on this connection would arrive before a Hello —
        whatever we read afterwards, since an answer read late proves nothing about now), or no frame
        came from the daemon for the liveness timeout (it is gone). For the second check it reads
        what is already queued first, so a loop that was merely busy does not mistake unread frames
        for silence."""
        if self.welcome is None:
            return False
        liveness_s = self.welcome.liveness_timeout_ms / 1000
        if self._unheard(now, liveness_s):
            return True
        if now - self._heard(self.welcome) <= liveness_s:
            return False
        self._on_readable()
        return self.connected and now - self._heard(self.welcome) > liveness_s

    def _heard(self, welcome: p.Welcome) -> float:
        """Monotonic time (s) the daemon was last known alive and knowing this connection: the last frame
        read, or the last heartbeat of the thread it answered (while this loop was blocked)."""
        if self.heartbeats is None:
            return self._last_recv
        return max(self._last_recv, self.heartbeats.acked_at(welcome.conn_token))

    def link_down(self) -> None:
        """The daemon is presumed gone: reconnect with backoff. Releases it may not have read are
        buffered again: claimed in the owner's `Reattach` and re-sent after the next Welcome (a
        release the old daemon did apply is a stale no-op: its (slot, generation) no longer names a
        lease)."""
        if self.connected:
            self.outbox.hold_first(self.receipts.unread())
            self.connected = False
            if self.heartbeats is not None:
                self.heartbeats.follow(0, 1.0, 1.0)  # credit nothing until the next Welcome names a connection
            self.reconnects += 1
            self.reconnecting_since = time.monotonic()
            self._next_hello = 0.0

    def _on_timer(self) -> None:
        if self.closed:
            return
        now = time.monotonic()
        # checked before a heartbeat could go out on a reaped connection
        if self.connected and self.welcome is not None and self._silent_too_long(now):
            log.warning(
                "link quiet (sent %.1fs ago, received %.1fs ago) endpoint=%s; reconnecting",
                now - self._last_send,
                now - self._last_recv,
                self.endpoint,
            )
            self.link_down()
        if self.connected and self.welcome is not None:
            hb_s = self.welcome.heartbeat_ms / 1000
            quiet = now - self._last_send >= hb_s * 0.9 or now - self._last_recv >= hb_s * 0.9
            if quiet and now - self._last_hb >= hb_s * 0.9:  # at most one heartbeat per period
                if self.outbox.turn_pending:
                    self._flush_out()  # frames of this turn go first: the ack then confirms them too
                self._hb_seq += 1
                self._last_hb = now
                self.receipts.heartbeat_sent(self._hb_seq)
                if self.connected and not self._raw_send(self.enc.encode(p.Heartbeat(self._hb_seq))):
                    log.warning("daemon connection closed endpoint=%s; reconnecting", self.endpoint)
                    self.link_down()  # no pipe any more: the daemon is gone
        if not self.connected and self.sock is not None and self._hello_at is None:
            self._try_hello()  # the connection completed since the last try
        if not self.connected and now >= self._next_hello and not self._hello_pending(now):
            self.version = self.max_version  # a new (maybe upgraded) daemon: offer our highest again
            self._new_socket()  # a fresh identity: the (new) daemon treats us as a new connection
            self._next_hello = now + self._backoff_s
            # A socket tries its endpoint once (no ZeroMQ reconnect): retry often enough that a
            # restarted daemon hears our Reattach within its re-attach grace (its liveness timeout).
            ceiling = self.max_backoff_s
            if self.welcome is not None:
                ceiling = min(ceiling, self.welcome.liveness_timeout_ms / 1000 / 4)
            self._backoff_s = min(self._backoff_s * 2, ceiling)
        period = (
            0.05 if not self.connected or self.welcome is None else min(0.25, (self.welcome.heartbeat_ms / 1000) / 2)
        )
        self._timer = self._running_loop().call_later(period, self._on_timer)
