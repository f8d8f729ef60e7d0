"""`HeartbeatThread`: a client's heartbeats, sent from a thread of their own on a DEALER of their own.

The daemon declares a data connection dead when nothing credited it for `liveness_timeout_ms`
(docs/PROTOCOL.md "Liveness"). A router's event loop can be busy far longer than that — parsing large
bodies, a synchronous call, forwarding a burst — while its leases run fine on their engines, so the
heartbeats that keep its connection alive do not come from that loop. Each open client runs one
thread, which alone owns one DEALER (pyzmq sockets are not thread-safe) connected to the daemon's data
endpoint, and sends `Heartbeat(seq, conn_token)` every `heartbeat_ms` naming the data connection by its
`Welcome.conn_token`: the daemon credits that connection and answers `heartbeat_ack`, which tells the
link that the daemon lives and still knows its connection (`acked`) while its own loop hears nothing.

The thread ends when the client closes (`stop`), when its owner is garbage-collected (it holds only a
weak reference to it), and with the process; a forked child has no such thread, so it never
heartbeats for its parent's connection. Whatever stops the thread — the process stopped (SIGSTOP), or
one native call holding the GIL longer than the liveness timeout — lets the daemon declare the router
dead, and the link then finds a gap in this thread's record (`run`): it presumes its connection reaped
and says Hello again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any

import msgspec
import zmq

from .. import protocol as p

log = logging.getLogger(__name__)

THREAD_NAME = "kvsched-heartbeat"
# How long `stop` waits for the thread to close its socket (s): it wakes at once from its wait and
# never blocks in ZeroMQ (every call is NOBLOCK), so this bounds only a starved machine.
STOP_JOIN_S = 5.0
_NOBLOCK = int(zmq.NOBLOCK)


class HeartbeatThread:
    """One thread and its DEALER, heartbeating for the data connection `follow` names.

    Args:
        ctx: the client's zmq.Context (the thread keeps it alive until its socket is closed).
        endpoint: the daemon's data socket.
        owner: the object whose life bounds the thread's (the client's link); weakly referenced.
        curve_server_key / curve_client_keys: as the data socket's (None: no CURVE).
    Attributes:
        run: (conn_token, first, last) — monotonic times (s) of the first and the last heartbeat of the
            current unbroken run for that token (no two consecutive sends further apart than the
            follow's `gap_s`), or None before the first. Written by the thread only, as one tuple.
        acked: (conn_token, sent) — monotonic time (s) a heartbeat was sent that the daemon answered
            `heartbeat_ack` for that token (so it was alive and knew that connection then), the
            latest one; or None. Written by the thread only.
    """

    def __init__(
        self,
        ctx: zmq.Context[Any],
        endpoint: str,
        owner: object,
        curve_server_key: bytes | None = None,
        curve_client_keys: tuple[bytes, bytes] | None = None,
    ) -> None:
        self.run: tuple[int, float, float] | None = None
        self.acked: tuple[int, float] | None = None
        self._target: tuple[int, float, float] = (0, 1.0, 1.0)  # (conn_token, period_s, gap_s)
        self._stopped = threading.Event()
        self._wake = threading.Event()  # set by `follow` and `stop`: the thread looks at once
        self._pid = os.getpid()
        self._thread = threading.Thread(
            target=_beat,
            name=THREAD_NAME,
            daemon=True,
            args=(
                ctx,
                endpoint,
                curve_server_key,
                curve_client_keys,
                weakref.ref(self),
                weakref.ref(owner),
                self._stopped,
                self._wake,
            ),
        )
        self._on_owner_gone = weakref.finalize(owner, _signal, self._stopped, self._wake)
        self._thread.start()

    def follow(self, conn_token: int, period_s: float, gap_s: float) -> None:
        """Heartbeat every `period_s` (s) for the data connection `conn_token` (0: send nothing, e.g.
        while the link reconnects); a pause longer than `gap_s` (s) between two sends starts a new run."""
        self._target = (conn_token, period_s, gap_s)
        self._wake.set()

    @property
    def target(self) -> tuple[int, float, float]:
        """(conn_token, period_s, gap_s) as last set by `follow` (read by the thread each turn)."""
        return self._target

    def covered_since(self, conn_token: int, since: float, now: float, gap_s: float) -> bool:
        """True when heartbeats for `conn_token` went out without a pause longer than `gap_s` (s) from
        within `gap_s` after `since` until within `gap_s` before `now` (monotonic s): the daemon was
        told all along that this connection lives."""
        run = self.run
        return run is not None and run[0] == conn_token and run[1] - since <= gap_s and now - run[2] <= gap_s

    def acked_at(self, conn_token: int) -> float:
        """Monotonic time (s) of the latest heartbeat for `conn_token` the daemon answered; -inf if none."""
        acked = self.acked
        return acked[1] if acked is not None and acked[0] == conn_token else float("-inf")

    def stop(self) -> None:
        """End the thread and wait (at most `STOP_JOIN_S`) until it closed its socket; a no-op in a
        forked child (the thread, and its socket's owner, live in the parent only)."""
        self._on_owner_gone.detach()
        _signal(self._stopped, self._wake)
        if os.getpid() == self._pid and self._thread is not threading.current_thread():
            self._thread.join(STOP_JOIN_S)
            if self._thread.is_alive():
                log.warning("heartbeat thread did not stop within %.0fs", STOP_JOIN_S)


def _signal(stopped: threading.Event, wake: threading.Event) -> None:
    """Tell the thread to end (from `stop`, or when the owner is collected)."""
    stopped.set()
    wake.set()


def _beat(
    ctx: zmq.Context[Any],
    endpoint: str,
    server_key: bytes | None,
    client_keys: tuple[bytes, bytes] | None,
    state_ref: weakref.ref[HeartbeatThread],
    owner_ref: weakref.ref[object],
    stopped: threading.Event,
    wake: threading.Event,
) -> None:
    """The thread: heartbeat while the owner lives and `stopped` is not set; close the socket at the
    end. Holds the `HeartbeatThread` and the owner only weakly (never across a wait)."""
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 16)  # a few beats queue while the daemon is slow; more are dropped
        sock.setsockopt(zmq.RCVHWM, 16)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no beat queued for a connection that is not up
        if server_key is not None and client_keys is not None:
            sock.curve_serverkey = server_key
            sock.curve_publickey, sock.curve_secretkey = client_keys
        sock.connect(endpoint)
        enc = p.make_encoder()
        dec = msgspec.msgpack.Decoder(p.HeartbeatAck | p.Error)
        seq = 0
        unanswered: dict[int, tuple[int, float]] = {}  # seq -> (token, sent) of the last beats sent
        while not stopped.is_set() and owner_ref() is not None:
            wake.clear()  # before reading the target: a `follow` from now on wakes the next wait
            state = state_ref()
            if state is None:
                return
            token, period_s, gap_s = state.target
            if token:
                seq += 1
                try:
                    sock.send(enc.encode(p.Heartbeat(seq, token)), _NOBLOCK)
                except zmq.Again:
                    pass  # no connection up (the daemon restarting) or a full queue: this beat is skipped
                else:
                    now = time.monotonic()
                    run = state.run
                    unbroken = run is not None and run[0] == token and now - run[2] <= gap_s
                    state.run = (token, run[1] if unbroken and run is not None else now, now)
                    unanswered[seq] = (token, now)
                    if len(unanswered) > 64:  # answers lost (a daemon restart): forget the oldest
                        del unanswered[next(iter(unanswered))]
            while sock.poll(0):
                _read_answer(sock, dec, unanswered, state)
            del state
            wake.wait(period_s)
    except zmq.ZMQError as exc:  # the context was terminated under us (interpreter exit): nothing left to do
        log.debug("heartbeat thread ends error=%s", exc)
    finally:
        sock.close(0)


def _read_answer(
    sock: zmq.Socket[Any],
    dec: msgspec.msgpack.Decoder[Any],
    unanswered: dict[int, tuple[int, float]],
    state: HeartbeatThread,
) -> None:
    """Read one answer: a `heartbeat_ack` records when its beat was sent (`HeartbeatThread.acked`); an
    `error` (a token the daemon no longer knows: the link finds that out on its own) is dropped."""
    try:
        answer = dec.decode(sock.recv(_NOBLOCK))
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    if isinstance(answer, p.HeartbeatAck):
        beat = unanswered.pop(answer.seq, None)
        if beat is not None:
            state.acked = beat
