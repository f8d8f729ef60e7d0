"""The admin ROUTER socket's pump: read admin messages, decode them, call the admin handler, reply.

The actor owns the loop and calls `AdminSocket.serve` from its reader callback; what a handler
returns besides its reply (scheduler outcomes, e.g. a cancel's revocation) goes back to the actor's
`deliver`, so admin operations stay serialized with scheduling (docs/ARCHITECTURE.md, "The daemon's
I/O pattern"). DEALER and REQ peers are both answered (`envelope.split_request`); a malformed or
undecodable message gets an `AdminError`, a handler that raises gets `AdminError(INTERNAL)` and a
logged traceback, and the actor keeps running. No policy here: `admin.py` holds the handlers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import msgspec
import zmq

from .. import protocol as p
from .envelope import ADMIN_SHAPE_ERROR, split_request
from .metrics import Metrics
from .reader import read_some

log = logging.getLogger(__name__)

ADMIN_BUDGET = 64  # admin messages answered per wake; more left waiting re-arm the reader at once
_NOBLOCK = int(zmq.NOBLOCK)


class AdminSocket:
    """Answers the admin socket's messages, at most `ADMIN_BUDGET` per `serve` call.

    Args:
        sock: the bound admin ROUTER socket.
        handler: `(AdminRequest, now_us) -> (AdminReply, list[Admit | Reject])` (`admin.handle`
            bound to its context), or None (every request then gets `AdminError(INTERNAL)`).
        metrics: `Metrics` (malformed messages count in `malformed{code="malformed"}`).
        enc: the msgspec msgpack encoder the replies are encoded with.
    """

    def __init__(
        self, sock: zmq.Socket, handler: Callable | None, metrics: Metrics, enc: msgspec.msgpack.Encoder
    ) -> None:
        self.sock = sock
        self.handler = handler
        self.metrics = metrics
        self.enc = enc
        self.dec = p.make_admin_request_decoder()

    def serve(self, t: int, deliver: Callable[[list, int], None]) -> int:
        """Answer the waiting admin messages (up to `ADMIN_BUDGET`), each reply sent before its
        outcomes are handed to `deliver(outcomes, t)`. `t` is the wake's time (µs).

        Returns:
            int: how many messages were read (== `ADMIN_BUDGET`: more may be waiting).
        """

        def answer(parts: list[bytes]) -> None:
            envelope, reply, outcomes = self._envelope(parts, t)
            with contextlib.suppress(zmq.ZMQError):  # the peer is gone or reads nothing: no answer
                self.sock.send_multipart((*envelope, self.enc.encode(reply)), _NOBLOCK)
            deliver(outcomes, t)

        return read_some(self.sock, ADMIN_BUDGET, answer)

    def _envelope(self, parts: list[bytes], t: int) -> tuple[list[bytes], p.AdminReply, list]:
        """(envelope to reply with, reply, outcomes) of one admin message (`envelope.split_request`:
        DEALER and REQ are served; any other shape gets a malformed `AdminError`)."""
        envelope, payload = split_request(parts)
        if payload is not None:
            return envelope, *self._reply(payload, t)
        self.metrics.malformed.labels(code="malformed").inc()
        return envelope, p.AdminError(int(p.ErrorCode.MALFORMED), ADMIN_SHAPE_ERROR.format(n=len(parts) - 1)), []

    def _reply(self, payload: bytes, t: int) -> tuple[p.AdminReply, list]:
        try:
            req = self.dec.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:  # deep nesting: Recursion
            self.metrics.malformed.labels(code="malformed").inc()
            return p.AdminError(code=int(p.ErrorCode.MALFORMED), message=str(exc)[:300]), []
        if self.handler is None:
            return p.AdminError(code=int(p.ErrorCode.INTERNAL), message="admin not available"), []
        try:
            return self.handler(req, t)
        except Exception as exc:  # an admin bug must not kill the actor; the operator sees it
            log.exception("admin request failed request=%s", type(req).__name__)
            return p.AdminError(code=int(p.ErrorCode.INTERNAL), message=f"{type(exc).__name__}: {exc}"), []
