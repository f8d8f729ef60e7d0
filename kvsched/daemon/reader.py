"""Reading a ZeroMQ socket on the event loop: the one statement of the edge-triggered read idiom.

A ZeroMQ socket's FD (`zmq.FD`) is edge-like: it signals when the socket's state changes, not while a
message waits, and every send, receive or `EVENTS` read processes the socket's pending commands and
can consume the edge of a message that arrived meanwhile. So a reader callback drains the socket
with NOBLOCK while it has POLLIN, at most a budget of messages per wake (other readers and timers
run between wakes), and asks for another wake itself when it stopped on its budget or the socket is
still readable (docs/ARCHITECTURE.md, "The daemon's I/O pattern"). `Reader` owns the registration
and the one queued wake of a socket; `read_some` is the budgeted drain; `readable` the check.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq

_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)
_zmq_poll = zmq.zmq_poll


def readable(sock: zmq.Socket) -> bool:
    """True when `sock` has a message to read. `zmq_poll` with a zero timeout rather than
    `getsockopt(EVENTS)`: pyzmq 27 builds a `SocketOption` enum on every `getsockopt`, which
    costs about as much again as the check itself (both process the socket's pending commands,
    so either one re-arms the edge-triggered ZMQ FD)."""
    return bool(_zmq_poll([(sock, _POLLIN)], 0))


def read_some(sock: zmq.Socket, budget: int, handle: Callable[[list[bytes]], None]) -> int:
    """Hand each waiting multipart message of `sock` to `handle`, at most `budget` of them, until the
    socket has none (EAGAIN) or `handle` closed it. Returns how many were read (`budget`: more may wait)."""
    n = 0
    while n < budget and not sock.closed:
        try:
            parts = sock.recv_multipart(_NOBLOCK)
        except zmq.Again:
            break
        n += 1
        handle(parts)
    return n


class Reader:
    """One socket's reader callback on `loop`: registered by `start()`, unregistered by `stop()`.

    Args:
        loop: the running event loop.
        sock: the ZeroMQ socket.
        drain: one wake's work: reads at most its budget, returns True when another wake is needed
            (it stopped on its budget, or found the socket still readable after its sends).
    Attributes:
        sock: the socket; stopped: True once `stop()` ran (no wake runs or is queued after it).

    At most one wake is queued per reader, never more: every path that finds the socket still
    readable (a wake that used its whole budget, a timer, a flush, the FD firing meanwhile) asks
    again while a flood lasts. Queued side by side, copies would all run in one loop turn, so that
    turn (and with it every other reader and timer) would wait for ever more wakes: a flood of
    200,000 Enqueues grew it past 25 back-to-back wakes and held `kvsched queues` for seconds
    (tests/daemon/test_admin_flood.py).
    """

    __slots__ = ("_fd", "_queued", "drain", "loop", "sock", "stopped")

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: zmq.Socket, drain: Callable[[], bool]) -> None:
        self.loop = loop
        self.sock = sock
        self.drain = drain
        self._fd: int | None = None
        self._queued: asyncio.Handle | None = None
        self.stopped = False

    def start(self) -> None:
        """Register the FD's reader and queue a first wake (the FD signals only after the socket's
        state was read once)."""
        self._fd = self.sock.fileno()
        self.loop.add_reader(self._fd, self.wake)
        self.wake_soon()

    def stop(self) -> None:
        """Unregister the reader and drop a queued wake (before the socket is closed)."""
        self.stopped = True
        if self._fd is not None:
            self.loop.remove_reader(self._fd)
            self._fd = None
        if self._queued is not None:
            self._queued.cancel()
            self._queued = None

    def wake_soon(self) -> None:
        """Run `wake` on the next loop turn, unless a wake is already queued."""
        if self._queued is None and not self.stopped:
            self._queued = self.loop.call_soon(self.wake)

    def rearm(self) -> None:
        """Queue a wake when the socket is readable: after a send outside a wake, which can swallow
        the FD's edge of a message that arrived meanwhile."""
        if not self.stopped and readable(self.sock):
            self.wake_soon()

    def wake(self) -> None:
        """The reader callback: one `drain`, then another wake if it asks. A queued wake is this one,
        or is dropped because this one, run by the FD's own reader, does its work."""
        if self._queued is not None:
            self._queued.cancel()
            self._queued = None
        if not self.stopped and self.drain():
            self.wake_soon()
